"""``Work`` objects the zbccl process group returns (torch's async handle).

zbccl's CPU collectives block the host until they are complete on this rank
(the op is one handshake over shared memory; there is no device stream to
enqueue on). So a CPU collective's Work is created *completed*: with ``async_op=True``
the op still ran inside the call, and ``wait()`` only reports its outcome.
An op that failed under ``async_op=True`` does not raise at the call: its
Work carries the error, and ``wait()``, ``exception()`` and the future give
the :class:`~zbccl.errors.ZbcclError` subclass to the caller.

CUDA collectives are enqueued on a stream and never block the host:
:class:`DeviceWork` holds a CUDA event recorded after the op (NCCL's semantics,
see its docstring).

Point-to-point receives are the other exception: :class:`PendingWork` completes
later (in ``wait()``, or while any other wait of the same group makes
progress), so that ``irecv``/``isend`` pairs posted in any order never
deadlock.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from .. import env
from ..errors import ZbcclInvalidUsageError, ZbcclTimeoutError

__all__ = ["CompletedWork", "PendingWork", "DeviceWork", "wait_event", "timeout_seconds"]


def timeout_seconds(timeout) -> float | None:
    """Seconds of a torch ``wait(timeout)`` argument (``timedelta``, number or None / 0: no limit)."""
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    # torch passes timedelta.max and the like for "very long": the longest wait zbccl can represent.
    return min(seconds, env.MAX_SECONDS) if seconds > 0 else None


class CompletedWork(dist.Work):
    """The handle of an op that already ran: its result tensors, or the error it raised."""

    def __init__(self, result: list[torch.Tensor] | None = None, error: BaseException | None = None, *,
                 source_rank: int = -1) -> None:
        super().__init__()
        self._result = list(result) if result is not None else []
        self._error = error
        self._source = source_rank
        self._future: torch.futures.Future | None = None

    def wait(self, timeout=None) -> bool:
        """Returns True, or raises the op's error (the op already ran: ``timeout`` cannot expire)."""
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> list[torch.Tensor]:
        if self._error is not None:
            raise self._error
        return self._result

    def source_rank(self) -> int:
        return self._source

    def _source_rank(self) -> int:
        return self._source

    def synchronize(self) -> None:
        self.wait()

    def get_future(self) -> torch.futures.Future:
        """A future completed with the result tensors, or with the op's error."""
        if self._future is None:
            fut = torch.futures.Future()
            if self._error is not None:
                fut.set_exception(self._error)
            else:
                fut.set_result(self._result)
            self._future = fut
        return self._future


class PendingWork(CompletedWork):
    """A handle completed later by ``step(timeout) -> bool`` (point-to-point ops).

    ``step(None)`` must not block: it makes what progress it can and returns
    whether the op is complete; ``step(seconds)`` blocks up to that long and
    raises on timeout or a lost peer. ``wait()`` without a timeout uses the
    group's default.
    """

    def __init__(self, result: list[torch.Tensor], step: Callable[[float | None], bool], *,
                 default_timeout: float) -> None:
        super().__init__(result)
        self._step = step
        self._done = False
        self._default = default_timeout

    def _finish(self, timeout: float | None) -> bool:
        if self._done or self._error is not None:
            return True
        try:
            self._done = self._step(timeout)
        except BaseException as exc:
            self._error = exc
            return True
        return self._done

    def wait(self, timeout=None) -> bool:
        seconds = timeout_seconds(timeout)
        self._finish(seconds if seconds is not None else self._default)
        return super().wait()

    def is_completed(self) -> bool:
        return self._finish(None)

    def is_success(self) -> bool:
        return self._finish(None) and self._error is None

    def exception(self) -> BaseException | None:
        self._finish(None)
        return self._error

    def source_rank(self) -> int:
        self.wait()
        return self._source

    def _source_rank(self) -> int:
        return self.source_rank()

    def get_future(self) -> torch.futures.Future:
        """A future completed once the op is: completes it now (blocking) if it is not yet."""
        if self._future is None:
            try:
                self.wait()
            except BaseException:  # noqa: BLE001 - the future carries it
                pass
        return super().get_future()


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
