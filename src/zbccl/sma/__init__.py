"""SMA, the secondary memory allocator: offset arithmetic over one rank's heap, no I/O.

``Arena`` places blocks (best fit, small-low / large-high); ``CachingAllocator``
is the thread- and finalizer-safe front end with size classes, a block cache,
external cache tiers and statistics.
"""

from .arena import Arena
from .caching import CachingAllocator
from .stats import STAT_KEYS, format_stats

__all__ = ["STAT_KEYS", "Arena", "CachingAllocator", "format_stats"]
