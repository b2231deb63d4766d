"""How far the SMA grows its heap when a request does not fit: pure arithmetic, no I/O.

The caching front end (``caching.py``) asks :func:`grow_target` for the new heap
size once a request failed even after its cache was flushed, then calls the
heap's ``grow`` callback (which reserves the memory) and extends its arena.

Policy: grow by at least ``step`` bytes (so a run of growing requests does not
grow once per request), rounded up to ``granule`` (2 MiB: huge-page friendly),
never beyond ``max_bytes``; when a step would cross ``max_bytes`` but the request
itself fits below it, grow exactly to ``max_bytes``.
"""

from __future__ import annotations

__all__ = ["GRANULE", "STEP", "grow_target"]

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
