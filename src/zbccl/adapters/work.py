"""``Work`` objects the zbccl process group returns (torch's async handle).

zbccl's CPU collectives block the host until they are complete on this rank
(the op is one handshake over shared memory; there is no device stream to
enqueue on). So a CPU collective's Work is created *completed*: with ``async_op=True``
the op still ran inside the call, and ``wait()`` only reports its outcome.
An op that failed under ``async_op=True`` does not raise at the call: its
Work carries the error, and ``wait()``, ``exception()`` and the future give
the :class:`~zbccl.errors.ZbcclError` subclass to the caller.

CUDA collectives are enqueued on a stream and never block the host: their
Work is :class:`~.device_work.DeviceWork` (a CUDA event, NCCL's semantics).

Point-to-point receives are the other exception: :class:`PendingWork` completes
later (in ``wait()``, or while any other wait of the same group makes
progress), so that ``irecv``/``isend`` pairs posted in any order never
deadlock.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from .. import env

__all__ = ["CompletedWork", "PendingWork", "timeout_seconds"]


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
