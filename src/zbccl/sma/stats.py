"""The SMA's statistics: every key ``memory_stats()`` returns, documented once."""

from __future__ import annotations

__all__ = ["STAT_KEYS", "format_stats"]

STAT_KEYS: dict[str, str] = {
    "heap_bytes": "usable heap size now: the constructor's heap_bytes rounded down to the alignment, "
    "plus what growth added",
    "heap_max_bytes": "most bytes the heap may grow to (ZBCCL_HEAP_MAX); equal to heap_bytes when it cannot grow",
    "grow_count": "times the heap grew (a request did not fit even after the cache flush)",
    "allocated_bytes": "bytes of live blocks at their rounded sizes, minus blocks held by cache tiers",
    "requested_bytes": "sum of the sizes callers asked for, over live blocks; tier-held blocks are "
    "subtracted at their rounded size, so this is a lower bound while a tier holds blocks",
    "peak_allocated_bytes": "highest allocated_bytes since creation or reset_peak() (tier-held blocks "
    "count as allocated here: the allocator cannot see when a tier takes them)",
    "cached_bytes": "bytes of freed blocks kept for reuse, in this allocator and in its cache tiers",
    "cached_blocks": "number of blocks counted by cached_bytes",
    "active_blocks": "number of live blocks, not counting tier-held ones",
    "free_bytes": "bytes free in the arena (excludes cached blocks)",
    "largest_free_block": "largest contiguous free range in the arena, in bytes",
    "fragmentation": "0.0 when free_bytes is 0, else 1 - largest_free_block / free_bytes",
    "alloc_count": "successful malloc/try_malloc calls, cache hits included",
    "free_count": "blocks freed by callers (applied frees, queued ones once drained)",
    "cache_hits": "allocations served from the cache without touching the arena",
    "oom_count": "malloc calls that raised ZbcclOutOfMemoryError",
    "fallback_allocs": "allocations served from ordinary memory because the heap was full (record_fallback)",
    "fallback_bytes": "bytes of those fallback allocations",
    "staged_bytes": "bytes collectives copied through the heap for tensors outside it (record_staged)",
    "bad_frees": "queued frees (from finalizers) of unknown or already freed offsets, dropped and logged",
}


def format_stats(stats: dict[str, int | float]) -> str:
    """One-line human summary of a :meth:`CachingAllocator.stats` dict."""
    return (
        f"heap_bytes={stats['heap_bytes']}, heap_max_bytes={stats['heap_max_bytes']}, allocated_bytes={stats['allocated_bytes']}, "
        f"cached_bytes={stats['cached_bytes']}, free_bytes={stats['free_bytes']}, "
        f"largest_free_block={stats['largest_free_block']}, "
        f"fragmentation={stats['fragmentation']:.3f}, active_blocks={stats['active_blocks']}"
    )
