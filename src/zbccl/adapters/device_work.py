"""Work objects and launching of CUDA collectives in the process group (NCCL's semantics).

A synchronous CUDA collective runs on the current stream and returns the shared completed Work (later
work on the stream is ordered after it). An ``async_op=True`` one runs on the group's side stream
after the work already on the current stream (:func:`launch`); its :class:`DeviceWork` holds a CUDA
event recorded after the kernel. ``wait()`` makes the current stream wait on it (no host block);
``synchronize()`` blocks the host, bounded (:func:`wait_event`); device-side errors (timeouts naming
the ranks, mismatched arguments) come from ``DeviceOps.check()``. :func:`cuda_barrier` is the group's
barrier with a CUDA device, as NCCL's: every rank's earlier device work is done when it returns.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..errors import ZbcclInvalidUsageError, ZbcclTimeoutError
from ..ops import barrier
from .work import CompletedWork, timeout_seconds

__all__ = ["DeviceWork", "launch", "wait_event", "cuda_barrier"]


def launch(comm, side, result: list[torch.Tensor], inputs: tuple[torch.Tensor, ...],
           run: Callable[[], None]) -> dist.Work:
    """Run ``run`` (which enqueues the op) on the side stream ``side`` after the current stream's work; the
    operands are marked used by ``side`` (``record_stream``), so the caching allocator does not reuse them
    before the op ran. Inside a capture ``side`` joins the capture (``wait()`` must join it back before
    the capture ends, as with NCCL). An op that raised returns a Work carrying the error."""
    cur = torch.cuda.current_stream(side.device)
    captured = torch.cuda.is_current_stream_capturing()
    side.wait_stream(cur)
    try:
        with torch.cuda.stream(side):
            run()
    except Exception as exc:  # noqa: BLE001 - the Work hands it to wait()/exception()/the future
        cur.wait_stream(side)  # joined back: a capture must end with its forked streams joined
        return CompletedWork(result, exc)
    event = torch.cuda.Event()
    event.record(side)
    for t in (*result, *inputs):
        if isinstance(t, torch.Tensor) and t.is_cuda:
            t.record_stream(side)
    return DeviceWork(result, event, side, comm.device_state.get("cuda"), timeout=comm.timeout, captured=captured)


#: How long past the communicator's timeout ``DeviceWork.synchronize`` waits for an event: the kernels'
#: bounded waits end at the timeout, and their status words are written just after.
_GRACE_S = 10.0


class DeviceWork(CompletedWork):
    """The handle of a collective enqueued on a CUDA stream (NCCL's semantics).

    ``event`` was recorded on ``stream`` right after the op's kernels. ``wait()`` makes the *current*
    stream wait on it and returns at once (the host never blocks), then raises any error the kernels
    already reported (``DeviceOps.check()``: a peer that never arrived, mismatched arguments, named by
    rank). ``is_completed()`` queries the event. ``synchronize()`` (and ``wait()`` under
    ``blocking=True``) blocks the host until the event completed, polling with back-off up to the
    communicator's timeout, then checks: a device-side timeout raises
    :class:`~zbccl.errors.ZbcclTimeoutError` naming the ranks. ``get_future()`` is a CUDA-aware future
    completed with the result tensors: its ``wait()`` and callbacks are ordered after the op on the
    stream that uses them, as NCCL's. An op captured in a CUDA graph runs at each replay: its Work only
    orders streams inside the capture (``wait()``); querying or blocking on it raises.
    """

    def __init__(self, result: list[torch.Tensor], event, stream, ops, *, timeout: float, captured: bool) -> None:
        super().__init__(result)
        self._event, self._stream, self._ops = event, stream, ops
        self._timeout = timeout
        self._captured = captured

    def _check(self) -> None:
        check = getattr(self._ops, "check", None)
        if check is not None:
            check()

    def _refuse_captured(self, what: str) -> None:
        if self._captured:
            raise ZbcclInvalidUsageError(
                f"{what}: the op was captured in a CUDA graph and runs at each replay, expected a Work of an "
                "eager op, got one of a capture (use graph.replay() and stream/event synchronisation instead)")

    def wait(self, timeout=None) -> bool:
        """Order the current stream after the op (no host block); raise an error the kernels reported."""
        if self._error is not None:
            raise self._error
        torch.cuda.current_stream(self._stream.device).wait_event(self._event)
        if not self._captured:
            self._check()
        return True

    def block_current_stream(self) -> None:
        self.wait()

    def is_completed(self) -> bool:
        self._refuse_captured("is_completed")
        if self._error is not None:
            return True
        return bool(self._event.query())

    def is_success(self) -> bool:
        if not self.is_completed():
            return False
        try:
            self._check()
        except BaseException as exc:  # noqa: BLE001 - reported as the Work's error
            self._error = exc
        return self._error is None

    def exception(self) -> BaseException | None:
        if self._error is None and not self._captured and self._event.query():
            try:
                self._check()
            except BaseException as exc:  # noqa: BLE001 - reported as the Work's error
                self._error = exc
        return self._error

    def synchronize(self, timeout=None) -> None:
        """Block the host until the op completed on the device (bounded), then raise a device-side error."""
        self._refuse_captured("synchronize")
        if self._error is not None:
            raise self._error
        seconds = timeout_seconds(timeout) or self._timeout + _GRACE_S  # the kernels' own bound, then a margin
        wait_event(self._event, seconds, check=self._check, op="synchronize")

    def get_future(self) -> torch.futures.Future:
        """A CUDA-aware future holding the result tensors, ordered after the op (see the class docstring)."""
        if self._future is None:
            fut = torch.futures.Future(devices=[self._stream.device])
            if self._error is not None:
                fut.set_exception(self._error)
            else:
                with torch.cuda.stream(self._stream):
                    self._stream.wait_event(self._event)
                    fut.set_result(self._result)
            self._future = fut
        return self._future


def wait_event(event, seconds: float, *, check: Callable[[], None], op: str) -> None:
    """Block the host until ``event`` completed, polling with back-off (50 us .. 2 ms) for at most ``seconds``;
    ``check()`` raises a device-side error (it runs at each back-off step and at the end). Raises
    :class:`~zbccl.errors.ZbcclTimeoutError` if the event is still pending after the bound."""
    deadline = time.monotonic() + seconds
    pause = 50e-6
    while not event.query():
        check()
        if time.monotonic() >= deadline:
            raise ZbcclTimeoutError(
                f"{op}: the device op did not complete in {seconds:.1f}s, expected the kernels' bounded waits "
                "to end it, got it still running (a kernel before it on the stream may be stuck)")
        time.sleep(pause)
        pause = min(pause * 2, 2e-3)
    check()


def cuda_barrier(comm, device: torch.device, timeout: float | None) -> None:
    """NCCL's barrier: return once every rank's device work issued before it completed. Outside a capture:
    this rank's stream is drained (bounded, device-side errors raised), then the host barrier. Inside a
    capture: a device barrier on the current stream (the host cannot wait in a capture)."""
    with torch.cuda.device(device):
        if torch.cuda.is_current_stream_capturing():
            barrier(comm=comm, timeout=timeout, device="cuda")
            return
        event = torch.cuda.Event()
        event.record()
        ops = comm.device_state.get("cuda")
        check = getattr(ops, "check", None) or (lambda: None)
        wait_event(event, timeout or comm.timeout, check=check, op="barrier")
    barrier(comm=comm, timeout=timeout)
