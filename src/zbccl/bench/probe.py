"""The host-state probe in benchmark headers: ``runtime/hoststate.py`` has it (``init`` runs it too)."""

from __future__ import annotations

from ..runtime.hoststate import LINES, SLOW_NS_PER_LINE, classify, format_state, probe_host_state

__all__ = ["LINES", "SLOW_NS_PER_LINE", "probe_host_state", "classify", "format_state"]
