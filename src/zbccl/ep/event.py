"""``EventHandle`` and ``EventOverlap``: DeepEP's overlap API, on a CPU where ops finish on return (and
``DeviceEventHandle``: a CUDA event, for ops on CUDA tensors, which are enqueued on the current stream).

Every zbccl EP op completes on the calling thread before it returns (the host is the only
"stream"), so an event is always already complete and waiting on it returns at once. The
classes keep DeepEP's contract so code written for CUDA runs unchanged: an op called with
``async_finish=False`` returns ``EventOverlap(None)`` (calling ``current_stream_wait()`` on it
fails, as in DeepEP); with ``async_finish=True`` it returns a completed event, and
``extra_tensors`` keeps the op's tensors alive as DeepEP's ``record_stream`` substitute does.
``previous_event`` and ``allocate_on_comm_stream`` are accepted and checked, nothing more:
there is no second stream to order against.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["EventHandle", "DeviceEventHandle", "EventOverlap", "completed", "stream_error"]


class EventHandle:
    """A recorded point on the host's single stream: always complete on CPU."""

    def current_stream_wait(self) -> None:
        """Make the current stream wait for this event: nothing to wait for on CPU."""

    def __repr__(self) -> str:
        return "EventHandle(complete)"


class EventOverlap:
    """DeepEP's event wrapper: ``current_stream_wait()``, ``with`` support, hooks after the wait."""

    def __init__(self, event: EventHandle | None = None, extra_tensors: tuple | None = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors
        self._release_handle_by_call = False
        self.hook_after_wait: Callable[[], Any] | None = None

    def current_stream_wait(self, release_handle: bool = False) -> None:
        """Wait for the event (already complete on CPU), then run the registered hook once."""
        assert self.event is not None, "current_stream_wait: this op ran with async_finish=False (no event)"
        self.event.current_stream_wait()
        if self.hook_after_wait is not None:
            hook, self.hook_after_wait = self.hook_after_wait, None
            hook()
        if release_handle:
            self.event = None

    def register_hook_after_wait(self, hook_after_wait: Callable[[], Any]) -> None:
        assert self.hook_after_wait is None, "A hook is already registered on this EventOverlap"
        self.hook_after_wait = hook_after_wait

    def __call__(self, release_handle: bool = False) -> EventOverlap:
        self._release_handle_by_call = release_handle
        return self

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        if self.event is not None:
            self.current_stream_wait(release_handle=self._release_handle_by_call)
        self._release_handle_by_call = False


class DeviceEventHandle(EventHandle):
    """A CUDA event recorded on the current stream (an op on CUDA tensors is enqueued there, not finished)."""

    def __init__(self) -> None:
        import torch

        self.event = torch.cuda.Event()
        self.event.record()

    def current_stream_wait(self) -> None:
        import torch

        torch.cuda.current_stream().wait_event(self.event)

    def __repr__(self) -> str:
        return f"DeviceEventHandle(complete={self.event.query()})"


def completed(async_finish: bool, tensors: tuple = (), *, device: bool = False) -> EventOverlap:
    """What an op returns: an event if ``async_finish`` (``device``: a CUDA event on the current stream, after the
    op's work; else complete), or ``EventOverlap(None)`` (DeepEP)."""
    if not async_finish:
        return EventOverlap(None)
    return EventOverlap(DeviceEventHandle() if device else EventHandle(), tensors)


def stream_error(previous_event, async_finish: bool, allocate_on_comm_stream: bool) -> str | None:
    """DeepEP's checks of the stream arguments, as an error message (or None)."""
    if allocate_on_comm_stream and (previous_event is None or not async_finish):
        return ("allocate_on_comm_stream needs previous_event and async_finish, expected both, got "
                f"previous_event={previous_event is not None}, async_finish={async_finish}")
    if previous_event is not None and not isinstance(previous_event, EventOverlap):
        return f"previous_event must be an EventOverlap, got {type(previous_event).__name__}"
    return None
