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
from threading import get_ident

__all__ = ["OpLock"]


class OpLock:
    """FIFO, reentrant lock with a timeout and a stop condition.

    Ownership is one C ``Lock`` (``mutex``); the uncontended path is a single
    non-blocking acquire (:meth:`try_acquire`, which :func:`.registry.collective`'s
    guard tries first: ops of a few microseconds must not pay a microsecond here). Contended threads queue
    under a condition and take ``mutex`` only at the queue's head; a newcomer
    skips the queue only while it is empty. Reentry by the owner counts ``depth``.
    """

    __slots__ = ("mutex", "owner", "depth", "queue", "_cond", "_watchers")

    def __init__(self) -> None:
        self.mutex = threading.Lock()
        self.owner: int | None = None  # set by the owner once it took mutex, cleared before release
        self.depth = 0  # reentries beyond the first; written only by the owner
        self.queue: deque[int] = deque()  # idents of waiting threads, in arrival order
        self._cond = threading.Condition(threading.Lock())
        self._watchers = 0  # threads in wait_idle (finalize)

    def try_acquire(self) -> bool:
        """Take the lock if it is free and nobody queues (or this thread holds it already)."""
        if not self.queue and self.mutex.acquire(False):
            self.owner = get_ident()
            return True
        if self.owner == get_ident():
            self.depth += 1
            return True
        return False

    def acquire(self, timeout: float, stop: Callable[[], bool] | None = None) -> bool:
        """Take the lock within ``timeout`` seconds; False on timeout or once ``stop()`` is true."""
        if self.try_acquire():
            return True
        me = get_ident()
        with self._cond:
            self.queue.append(me)
            deadline = time.monotonic() + timeout
            try:
                while True:
                    if self.queue[0] == me and self.mutex.acquire(False):
                        self.queue.popleft()
                        self.owner = me
                        return True
                    left = deadline - time.monotonic()
                    if left <= 0 or (stop is not None and stop()):
                        return False
                    self._cond.wait(left)
            finally:
                if self.owner != me:  # gave up (timeout, stop, or an exception in wait)
                    self.queue.remove(me)
                    self._cond.notify_all()

    def release(self) -> None:
        if self.depth:
            self.depth -= 1
            return
        self.owner = None
        self.mutex.release()
        # A waiter appends itself under _cond before it tries mutex, so it either took the
        # lock already or is seen here and woken.
        if self.queue or self._watchers:
            with self._cond:
                self._cond.notify_all()

    def wake(self) -> None:
        """Make waiting threads re-check their stop condition (``finalize`` calls it)."""
        with self._cond:
            self._cond.notify_all()

    def _busy(self, ignore: int) -> bool:
        owner = self.owner
        if owner is not None:
            return owner != ignore or any(t != ignore for t in self.queue)
        # A thread between taking mutex and setting owner is already in flight.
        return self.mutex.locked() or any(t != ignore for t in self.queue)

    def busy(self) -> bool:
        """True while another thread holds the lock or waits for it."""
        with self._cond:
            return self._busy(get_ident())

    def held_by_me(self) -> bool:
        return self.owner == get_ident()

    def wait_idle(self, deadline: float) -> bool:
        """Wait until no other thread holds or waits for the lock, or ``deadline`` (monotonic) passes."""
        me = get_ident()
        with self._cond:
            self._watchers += 1
            try:
                while self._busy(me):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._cond.wait(min(left, 0.05))
                return True
            finally:
                self._watchers -= 1
