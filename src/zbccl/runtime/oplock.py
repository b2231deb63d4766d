"""The op lock of one communicator: ops from several threads run one at a time, in arrival order.

A communicator's ops share its op channel (sequence number, flag lines, the
native channel's GIL bookkeeping), so two threads inside ops of one
communicator at once crash or pair the wrong ops. Every public op therefore
holds its communicator's :class:`OpLock` for its whole duration.

The lock is **per communicator, not per process**: ops on different
communicators use different comm slots and never touch each other's state, so
they may run concurrently (as NCCL communicators do). One lock for the whole
process would serialise them and could deadlock across ranks: if rank 0's
threads reach a world op then a group op and rank 1's threads the reverse,
each rank would hold its lock inside the op the other has not reached.

It is FIFO (a ticket queue: the documented order is the order in which
threads arrive at the lock; ``threading.Lock`` guarantees no order) and
reentrant (``zbccl.barrier`` calls ``Communicator.barrier``). The lock also
tells ``finalize`` which ops are still in flight: an op counts from the
moment it queues until it returns.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

__all__ = ["OpLock"]


class OpLock:
    """FIFO, reentrant lock with a timeout and a stop condition."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._owner: int | None = None
        self._depth = 0
        self._queue: deque[int] = deque()  # idents of waiting threads, in arrival order

    def acquire(self, timeout: float, stop: Callable[[], bool] | None = None) -> bool:
        """Take the lock within ``timeout`` seconds; False on timeout or once ``stop()`` is true."""
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:
                self._depth += 1
                return True
            if self._owner is None and not self._queue:
                self._owner, self._depth = me, 1
                return True
            self._queue.append(me)
            deadline = time.monotonic() + timeout
            try:
                while self._owner is not None or self._queue[0] != me:
                    left = deadline - time.monotonic()
                    if left <= 0 or (stop is not None and stop()):
                        return False
                    self._cond.wait(left)
                self._queue.popleft()
                self._owner, self._depth = me, 1
                return True
            finally:
                if self._owner != me:  # gave up (timeout, stop, or an exception in wait)
                    self._queue.remove(me)
                    self._cond.notify_all()

    def release(self) -> None:
        with self._cond:
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
                self._cond.notify_all()

    def wake(self) -> None:
        """Make waiting threads re-check their stop condition (``finalize`` calls it)."""
        with self._cond:
            self._cond.notify_all()

    def _busy(self, ignore: int) -> bool:
        return (self._owner is not None and self._owner != ignore) or any(t != ignore for t in self._queue)

    def busy(self) -> bool:
        """True while another thread holds the lock or waits for it."""
        with self._cond:
            return self._busy(threading.get_ident())

    def held_by_me(self) -> bool:
        with self._cond:
            return self._owner == threading.get_ident()

    def wait_idle(self, deadline: float) -> bool:
        """Wait until no other thread holds or waits for the lock, or ``deadline`` (monotonic) passes."""
        me = threading.get_ident()
        with self._cond:
            while self._busy(me):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.05))
            return True
