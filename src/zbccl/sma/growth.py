"""How far the SMA grows its heap when a request does not fit, and the bookkeeping of doing it.

The caching front end (``caching.py``) holds a :class:`Growth`; once a request
failed even after its cache was flushed, :meth:`Growth.extend` asks
:func:`grow_target` for the new heap size, calls the heap's ``grow`` callback
(which reserves the memory, or raises ZbcclOutOfMemoryError with the reason and
changes nothing) and then extends the arena at its top. No I/O here: the
callback does it.

Policy: grow by at least ``step`` bytes (so a run of growing requests does not
grow once per request), rounded up to ``granule`` (2 MiB: huge-page friendly),
never beyond ``max_bytes``; when a step would cross ``max_bytes`` but the request
itself fits below it, grow exactly to ``max_bytes``.
"""

from __future__ import annotations

from collections.abc import Callable

from zbccl.errors import ZbcclOutOfMemoryError

from .arena import Arena

__all__ = ["GRANULE", "STEP", "Growth", "grow_target"]

GRANULE = 2 << 20
STEP = 64 << 20


def grow_target(size: int, need: int, tail: int, max_bytes: int, *, step: int = STEP,
                granule: int = GRANULE) -> int | None:
    """The heap size to grow to so that a block of ``need`` bytes fits, or None if ``max_bytes`` forbids it.

    ``size`` is the heap's current size and ``tail`` the size of the free block
    that ends at its top (0 if the top block is in use): the new range merges with it.
    """
    required = size + need - tail
    if required > max_bytes:
        return None
    target = max(required, size + step)
    target = (target + granule - 1) // granule * granule
    return min(target, max_bytes)


class Growth:
    """The growth state of one allocator: its bound, callback, count and last refusal.

    Not thread-safe: the caller holds the allocator's lock (two threads must not grow at once).
    """

    def __init__(self, max_bytes: int, grow: Callable[[int], None] | None) -> None:
        self.max_bytes = max_bytes
        self._grow = grow
        self.count = 0
        #: Why the last growth was refused (for the out-of-memory message), or None.
        self.error: str | None = None

    def extend(self, arena: Arena, size: int) -> bool:
        """Grow the heap and ``arena`` so that a block of ``size`` bytes fits; False if refused."""
        if size > self.max_bytes:
            self.error = f"the request exceeds heap_max_bytes={self.max_bytes}"
            return False
        target = grow_target(arena.size, size, arena.free_tail, self.max_bytes)
        if target is None or self._grow is None:
            self.error = (f"{size} more bytes do not fit below heap_max_bytes={self.max_bytes} "
                          f"(heap_bytes={arena.size}, free at the top {arena.free_tail})")
            return False
        try:
            self._grow(target)
        except ZbcclOutOfMemoryError as exc:
            self.error = str(exc)
            return False
        arena.extend(target)
        self.count += 1
        self.error = None
        return True
