"""SMA, the secondary memory allocator: offset arithmetic over one rank's heap, no I/O.

``Arena`` places blocks (best fit, small-low / large-high); ``CachingAllocator``
is the thread- and finalizer-safe front end with size classes, a block cache,
external cache tiers and statistics.
"""

from .arena import Arena
from .caching import STAT_KEYS, CachingAllocator

__all__ = ["STAT_KEYS", "Arena", "CachingAllocator"]
