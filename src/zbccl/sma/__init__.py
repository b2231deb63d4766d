"""SMA, the secondary memory allocator: offset arithmetic over one rank's heap, no I/O.

``Arena`` places blocks (best fit, small-low / large-high); ``CachingAllocator``
is the thread- and finalizer-safe front end (locking, live blocks, cache tiers,
statistics) over ``BlockCache`` (size classes and the cache of freed blocks).
"""

from .arena import Arena
from .blockcache import BlockCache
from .caching import CachingAllocator
from .stats import STAT_KEYS, format_stats

__all__ = ["STAT_KEYS", "Arena", "BlockCache", "CachingAllocator", "format_stats"]
