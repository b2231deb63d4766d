"""Low-latency dispatch and combine (placeholder)."""

from __future__ import annotations

__all__ = ["LowLatencyState"]


class LowLatencyState:
    def __init__(self) -> None:
        self.idx = 0
        self.buffers: dict = {}
