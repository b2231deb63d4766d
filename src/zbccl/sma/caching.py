"""The SMA front end: a caching allocator over one rank's heap, safe for threads and finalizers.

Size classes and the cache of freed blocks are ``blockcache.py``; this module
owns the locking, the live-block records, cache tiers and statistics.

Locking: one :class:`~zbccl.sma.deferlock.DeferLock` guards all state. A
finalizer's ``free`` on a thread already inside ``malloc`` is deferred, never
lost and never deadlocks (protocol in ``deferlock.py``); a queued free that turns
out invalid counts in ``bad_frees``. Cache-tier callbacks (``cached``, ``drain``)
run with the lock released, so a tier may hold its own lock while calling
``malloc``/``free`` without a lock-order inversion. The ``grow`` callback runs
with the lock held (two threads must not grow at once); it may not call back
into the allocator.

Placement and the cache. Only blocks below ``small_threshold`` are cached; a
large one goes straight back to the arena, so every large placement sees the
free space coalesced (a cached large block reused later keeps an address the
arena would no longer choose, and pins a hole). Guarantee, with the arena's
"large from the top" rule (fuzz-tested): when every live block is large and each
was allocated while every large block live then is still live, a request of up
to ``free_bytes`` succeeds. Growth (``growth.py``): a request that does not fit
even after the flush grows the heap, up to ``max_bytes``.
"""

from __future__ import annotations

from collections.abc import Callable

from zbccl.errors import ZbcclInvalidUsageError, ZbcclOutOfMemoryError

from .arena import Arena
from .blockcache import BlockCache, Record
from .deferlock import DeferLock
from .growth import Growth
from .stats import format_stats

__all__ = ["CachingAllocator"]


def _check_count(op: str, nbytes: int) -> None:
    if nbytes < 0:
        raise ZbcclInvalidUsageError(f"{op}: bad size, expected nbytes >= 0, got {nbytes}")


_Tier = tuple[Callable[[], tuple[int, int]], Callable[[], None]]  # (cached, drain)


class CachingAllocator:
    """Size-class caching allocator over an :class:`Arena` of ``heap_bytes`` bytes.

    Offsets are relative to the heap start; the allocator never touches memory.
    Freed blocks are cached per size class (LIFO, so hot blocks are reused) and
    given back to the arena when the cache exceeds ``cache_limit``, on
    :meth:`empty_cache`, or when an allocation would otherwise fail.

    Size classes (:meth:`round_size`, see :class:`~zbccl.sma.blockcache.BlockCache`):
    the request rounded to the alignment up to ``max(4 KiB, 8 * alignment)``,
    above that 8 classes per octave, so a block exceeds its request by < 12.5 %.

    Thread-safe, and ``free`` may be called from a finalizer on a thread that is
    inside another call (see the module docstring).

    Args:
        heap_bytes: size of the heap the offsets index (its initial size when it may grow).
        alignment: power of two >= 64; every offset and block size is a multiple.
        cache_limit: most bytes kept cached (oldest blocks released first); None: no limit.
        small_threshold: blocks of at least this size are placed from the heap's high end and never cached.
        max_bytes: (keyword-only) most bytes the heap may grow to; None: ``heap_bytes`` (no growth).
        grow: (keyword-only) ``grow(new_size)`` makes the heap ``new_size`` bytes or raises
            ZbcclOutOfMemoryError; required when ``max_bytes > heap_bytes``.
        before: (keyword-only) called, without the lock, when an allocation, the statistics or a snapshot
            starts: the runtime passes ``zbccl.heap.releases.drain``, which frees the blocks of the tensors
            that died since (their deaths only queue the free, so that no Ctrl-C is lost in a finalizer).
    """

    def __init__(
        self,
        heap_bytes: int,
        *,
        alignment: int = 64,
        cache_limit: int | None = None,
        small_threshold: int = 1 << 20,
        max_bytes: int | None = None,
        grow: Callable[[int], None] | None = None,
        before: Callable[[], None] | None = None,
    ) -> None:
        self._before = before or (lambda: None)
        if cache_limit is not None and cache_limit < 0:
            raise ZbcclInvalidUsageError(
                f"CachingAllocator: bad cache_limit, expected None or >= 0, got {cache_limit}"
            )
        self._arena = Arena(heap_bytes, alignment=alignment, small_threshold=small_threshold)
        top = self._arena.size if max_bytes is None else max_bytes & -alignment
        if top < self._arena.size or (top > self._arena.size and grow is None):
            raise ZbcclInvalidUsageError(
                f"CachingAllocator: bad max_bytes, expected >= heap_bytes ({self._arena.size}) and a grow "
                f"callback when larger, got {max_bytes} with grow={grow!r}"
            )
        self._growth = Growth(top, grow)
        self._blocks = BlockCache(alignment, cache_limit, self._arena.free)
        self._guard = DeferLock(self._free_locked)
        # offset -> (size, requested, kind, seq) of live blocks (tier-held included).
        self._live: dict[int, Record] = {}
        self._tiers: dict[str, _Tier] = {}
        self._seq = 0
        self._allocated = self._requested = self._peak = 0
        self._alloc_count = self._free_count = self._cache_hits = self._oom_count = 0
        self._fallback_allocs = self._fallback_bytes = self._staged_bytes = 0

    def _acquire(self, op: str) -> None:
        self._guard.acquire(op)

    def _release(self) -> None:
        self._guard.release()

    # -- sizes --------------------------------------------------------------------

    def round_size(self, nbytes: int) -> int:
        """Size class of a request: the block size ``malloc(nbytes)`` reserves (see class docstring)."""
        return self._blocks.round_size(nbytes)

    # -- allocation ------------------------------------------------------------------

    def try_malloc(self, nbytes: int, *, kind: str = "explicit") -> int | None:
        """Like :meth:`malloc` (cache, arena, then flush and drain tiers), but return None when full."""
        self._before()
        offset = self._alloc(self.round_size(nbytes), nbytes, kind, False)
        return offset if offset is not None else self._alloc_hard(nbytes, kind)

    def _alloc_hard(self, nbytes: int, kind: str) -> int | None:
        size = self.round_size(nbytes)
        if size > self._growth.max_bytes:
            self._growth.error = f"the request exceeds heap_max_bytes={self._growth.max_bytes}"
            return None  # neither flushing nor growing can help
        for _, drain in self._tiers.values():
            drain()
        return self._alloc(size, nbytes, kind, True)

    def malloc(self, nbytes: int, *, kind: str = "explicit") -> int:
        """Reserve a block of ``round_size(nbytes)`` bytes and return its heap offset.

        Order: same-class cache hit, arena, then (cache released into the arena
        and every cache tier drained) the arena again. Raises
        ZbcclOutOfMemoryError, whose message carries the request and the stats.
        ``kind`` is a free-form label shown by :meth:`snapshot`.
        """
        self._before()
        offset = self._alloc(self.round_size(nbytes), nbytes, kind, False)
        if offset is None:
            offset = self._alloc_hard(nbytes, kind)
        if offset is not None:
            return offset
        self._acquire("malloc")
        self._oom_count += 1
        why = self._growth.error
        self._release()
        why = f"; growth refused: {why}" if why else ""
        raise ZbcclOutOfMemoryError(
            f"malloc: out of heap memory, expected room for {self.round_size(nbytes)} bytes "
            f"(requested {nbytes}), got {format_stats(self.stats())}{why}"
        )

    def _alloc(self, size: int, requested: int, kind: str, flush: bool) -> int | None:
        self._acquire("malloc")
        try:
            offset = self._blocks.take(size)
            if offset is not None:
                self._cache_hits += 1
            else:
                if flush:
                    self._blocks.evict()
                offset = self._arena.alloc(size)
                if offset is None and flush and self._growth.extend(self._arena, size):
                    offset = self._arena.alloc(size)
                if offset is None:
                    return None
            self._seq += 1
            self._live[offset] = (size, requested, kind, self._seq)
            self._alloc_count += 1
            self._requested += requested
            self._allocated += size
            if self._allocated > self._peak:
                self._peak = self._allocated
            return offset
        finally:
            self._release()

    def free(self, offset: int) -> None:
        """Return the block at ``offset`` to the cache (large blocks: to the arena); never waits on a lock its own thread holds.

        Raises ZbcclInvalidUsageError for an unknown offset or a double free when
        applied at once; a free queued behind a busy lock counts in ``bad_frees``.
        """
        if not self._guard.enter_or_defer(offset):
            return
        try:
            self._free_locked(offset)
        finally:
            self._guard.release()

    def _free_locked(self, offset: int) -> None:
        rec = self._live.pop(offset, None)
        if rec is None:
            what = "double free of" if offset in self._blocks else "unknown offset"
            raise ZbcclInvalidUsageError(
                f"free: {what} {offset}, expected the offset of a live block, got {offset}"
            )
        self._free_count += 1
        self._allocated -= rec[0]
        self._requested -= rec[1]
        if rec[0] >= self._arena.small_threshold:
            self._arena.free(offset)  # never cached: see "Placement and the cache"
        else:
            self._blocks.put(offset, rec)

    def empty_cache(self) -> None:
        """Release every cached block to the arena (cache tiers are not drained)."""
        self._before()
        self._acquire("empty_cache")
        try:
            self._blocks.evict()
        finally:
            self._release()

    # -- queries ----------------------------------------------------------------------

    def owns(self, offset: int) -> bool:
        """True if a live block (tier-held included) starts at ``offset``."""
        return offset in self._live

    def _record(self, op: str, offset: int) -> Record:
        rec = self._live.get(offset)
        if rec is None:
            raise ZbcclInvalidUsageError(
                f"{op}: unknown offset {offset}, expected the offset of a live block, got {offset}"
            )
        return rec

    def block_size(self, offset: int) -> int:
        """Rounded size in bytes of the live block at ``offset``."""
        return self._record("block_size", offset)[0]

    def requested_size(self, offset: int) -> int:
        """Bytes the caller asked for when the live block at ``offset`` was allocated."""
        return self._record("requested_size", offset)[1]

    # -- counters and cache tiers --------------------------------------------------------

    def record_fallback(self, nbytes: int) -> None:
        """Count an allocation of ``nbytes`` that fell back to ordinary memory because the heap was full."""
        _check_count("record_fallback", nbytes)
        self._acquire("record_fallback")
        self._fallback_allocs += 1
        self._fallback_bytes += nbytes
        self._release()

    def record_staged(self, nbytes: int) -> None:
        """Count ``nbytes`` a collective copied through the heap because a tensor lay outside it."""
        _check_count("record_staged", nbytes)
        self._acquire("record_staged")
        self._staged_bytes += nbytes
        self._release()

    def add_cache_tier(
        self, name: str, *, cached: Callable[[], tuple[int, int]], drain: Callable[[], None]
    ) -> None:
        """Register an external cache of blocks obtained from this allocator.

        ``cached()`` returns ``(bytes, blocks)`` the tier holds now (rounded
        sizes); ``drain()`` hands every held block back through :meth:`free`.
        Both run without the allocator lock held. Tier-held blocks count as
        cached, not allocated, in :meth:`stats`; tiers are drained before
        :meth:`malloc` gives up.
        """
        if name in self._tiers:
            raise ZbcclInvalidUsageError(
                f"add_cache_tier: duplicate name, expected a name not registered yet, got {name!r}"
            )
        self._tiers = {**self._tiers, name: (cached, drain)}  # copy: readers iterate unlocked

    def remove_cache_tier(self, name: str) -> None:
        """Unregister the tier ``name`` (its blocks stay live until it frees them)."""
        if name not in self._tiers:
            raise ZbcclInvalidUsageError(
                f"remove_cache_tier: unknown tier, expected one of {sorted(self._tiers)}, got {name!r}"
            )
        self._tiers = {k: v for k, v in self._tiers.items() if k != name}

    # -- introspection --------------------------------------------------------------------

    def stats(self) -> dict[str, int | float]:
        """Counters and gauges, keyed exactly as :data:`STAT_KEYS` documents."""
        self._before()
        tier_bytes = tier_blocks = 0
        for cached, _ in self._tiers.values():
            nbytes, nblocks = cached()
            tier_bytes, tier_blocks = tier_bytes + nbytes, tier_blocks + nblocks
        self._acquire("stats")
        try:
            arena = self._arena
            free_bytes = arena.free_bytes
            largest = arena.largest_free_block
            return {
                "heap_bytes": arena.size,
                "heap_max_bytes": self._growth.max_bytes,
                "grow_count": self._growth.count,
                "allocated_bytes": self._allocated - tier_bytes,
                "requested_bytes": max(0, self._requested - tier_bytes),
                "peak_allocated_bytes": self._peak,
                "cached_bytes": self._blocks.nbytes + tier_bytes,
                "cached_blocks": len(self._blocks) + tier_blocks,
                "active_blocks": len(self._live) - tier_blocks,
                "free_bytes": free_bytes,
                "largest_free_block": largest,
                "fragmentation": 0.0 if free_bytes == 0 else 1.0 - largest / free_bytes,
                "alloc_count": self._alloc_count,
                "free_count": self._free_count,
                "cache_hits": self._cache_hits,
                "oom_count": self._oom_count,
                "fallback_allocs": self._fallback_allocs,
                "fallback_bytes": self._fallback_bytes,
                "staged_bytes": self._staged_bytes,
                "bad_frees": self._guard.bad,
            }
        finally:
            self._release()

    def reset_peak(self) -> None:
        """Set ``peak_allocated_bytes`` to the bytes allocated now."""
        self._acquire("reset_peak")
        self._peak = self._allocated
        self._release()

    def snapshot(self) -> list[dict[str, int | str]]:
        """Live and cached blocks sorted by offset: ``offset``, ``size``, ``requested``, ``kind``, ``seq``.

        Cached blocks have kind ``"cached"`` and keep the ``requested`` and
        ``seq`` of their last allocation. Tier-held blocks appear as live blocks.
        """
        self._before()
        self._acquire("snapshot")
        try:
            rows = [(off, rec, rec[2]) for off, rec in self._live.items()]
            rows += [(off, rec, "cached") for off, rec in self._blocks.items()]
        finally:
            self._release()
        rows.sort(key=lambda row: row[0])
        return [
            {"offset": off, "size": rec[0], "requested": rec[1], "kind": kind, "seq": rec[3]}
            for off, rec, kind in rows
        ]

    def after_fork_in_child(self) -> None:
        """Re-arm the lock in a forked child (only for the runtime's at-fork hook)."""
        self._guard.after_fork_in_child()

    def check(self) -> None:
        """Verify internal invariants (arena, cache and counters); raise AssertionError if broken."""
        self._acquire("check")
        try:
            self._arena.check()
            arena_used = dict(self._arena.used_blocks())
            ours = {off: rec[0] for off, rec in self._live.items()}
            cached = dict(self._blocks.items())
            assert not ours.keys() & cached.keys(), "a block is both live and cached"
            ours.update((off, rec[0]) for off, rec in cached.items())
            assert ours == arena_used, "live + cached blocks differ from the arena's used blocks"
            self._blocks.check()
            assert self._allocated == sum(rec[0] for rec in self._live.values()), "allocated drifted"
            assert self._requested == sum(rec[1] for rec in self._live.values()), "requested drifted"
            assert self._peak >= self._allocated, "peak below allocated"
        finally:
            self._release()
