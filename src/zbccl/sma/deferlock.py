"""A lock for state that finalizers mutate: frees that cannot wait are deferred, never lost.

Locking protocol. One ``threading.Lock`` guards the allocator's state; ``owner``
holds the id of the thread inside a locked operation. The GC may run a tensor
finalizer that calls ``free`` on a thread already inside ``malloc``; a plain lock
would then deadlock and an RLock would let the free mutate state mid-operation. So:

* :meth:`DeferLock.enter_or_defer` (``free``) tries the lock. If it is busy and
  owned by this thread, or its owner is not recorded yet (the instant just after
  acquire or before release), the item is appended to ``pending`` (a deque:
  atomic under the GIL) and the call returns False. If another thread owns it,
  it waits: that thread never waits on us.
* Every holder drains ``pending`` before releasing, and after releasing retakes
  the lock (without blocking) while ``pending`` is non-empty; a deferring call
  does the same. Whoever holds the lock when an item is queued therefore sees it
  on its way out: a deferred free is applied late, never lost.
* A deferred item that turns out invalid cannot raise in a finalizer: ``apply``
  raising :class:`~zbccl.errors.ZbcclInvalidUsageError` is counted in ``bad``
  and logged.
* Any other call made from inside a locked operation on the same thread raises
  ZbcclInvalidUsageError (:meth:`DeferLock.acquire`) instead of deadlocking.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from threading import get_ident

from zbccl.errors import ZbcclInvalidUsageError

__all__ = ["DeferLock"]

_log = logging.getLogger(__name__)


class DeferLock:
    """The allocator's lock; ``apply(item)`` applies one deferred item with the lock held."""

    def __init__(self, apply: Callable[[int], None]) -> None:
        self._apply = apply
        self._lock = threading.Lock()
        self.owner: int | None = None
        self.pending: deque[int] = deque()
        #: Deferred items ``apply`` refused (ZbcclInvalidUsageError), dropped and logged.
        self.bad = 0

    def acquire(self, op: str) -> None:
        """Take the lock; a call from inside a locked operation on this thread raises."""
        if not self._lock.acquire(False):
            if self.owner == get_ident():
                raise ZbcclInvalidUsageError(
                    f"{op}: reentrant call, expected no allocator call other than free from "
                    f"inside an allocator operation, got {op}"
                )
            self._lock.acquire()
        self.owner = get_ident()

    def release(self) -> None:
        """Drain what was deferred, then release (and retake while more was deferred meanwhile)."""
        if self.pending:
            self._drain()
        self.owner = None
        self._lock.release()
        if self.pending:
            self._retake()

    def enter_or_defer(self, item: int) -> bool:
        """Take the lock for ``item`` (True: the caller applies it, then calls :meth:`release`), or
        queue it (False) when this thread already holds the lock or its holder is not recorded yet."""
        if not self._lock.acquire(False):
            owner = self.owner
            if owner is None or owner == get_ident():
                self.pending.append(item)  # reentrant (finalizer) or acquire/release instant
                self._retake()  # the holder may have released before the append
                return False
            self._lock.acquire()
        self.owner = get_ident()
        if self.pending:
            self._drain()
        return True

    def _retake(self) -> None:
        # An item queued between the last drain and the release: apply it unless
        # another thread holds the lock now (it will see the queue on its way out).
        while self.pending and self._lock.acquire(False):
            self.owner = get_ident()
            self._drain()
            self.owner = None
            self._lock.release()

    def _drain(self) -> None:
        pending = self.pending
        while pending:
            item = pending.popleft()
            try:
                self._apply(item)
            except ZbcclInvalidUsageError as exc:
                self.bad += 1
                _log.warning("zbccl.sma: dropped a queued free: %s", exc)

    def after_fork_in_child(self) -> None:
        """A fresh lock in a child forked while another thread may have held this one (that
        thread does not exist in the child, so the lock would block the child's frees for ever)."""
        self._lock = threading.Lock()
        self.owner = None
