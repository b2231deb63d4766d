"""CachingAllocator alone: fuzzed stats invariants, size classes, cache reuse, OOM, stats."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    rule,
)

from zbccl.errors import ZbcclInvalidUsageError, ZbcclOutOfMemoryError
from zbccl.sma import STAT_KEYS, CachingAllocator

KIB = 1 << 10
MIB = 1 << 20


class CachingMachine(RuleBasedStateMachine):
    """Random malloc/free/empty_cache; the stats must add up after every step."""

    live = Bundle("live")

    @initialize(
        heap=st.integers(16 * KIB, 512 * KIB),
        cache_limit=st.sampled_from([None, 0, 8 * KIB, 64 * KIB]),
        small_threshold=st.sampled_from([4 * KIB, MIB]),
    )
    def setup(self, heap: int, cache_limit: int | None, small_threshold: int) -> None:
        self.alloc = CachingAllocator(heap, cache_limit=cache_limit, small_threshold=small_threshold)
        self.cache_limit = cache_limit
        self.model: dict[int, int] = {}  # offset -> requested bytes
        self.ooms = 0

    @rule(target=live, nbytes=st.one_of(st.integers(1, 5 * KIB), st.integers(1, 200 * KIB)))
    def malloc(self, nbytes: int) -> int:
        try:
            offset = self.alloc.malloc(nbytes, kind="fuzz")
        except ZbcclOutOfMemoryError as exc:
            self.ooms += 1
            assert f"requested {nbytes}" in str(exc) and "heap_bytes=" in str(exc)
            if self.alloc.round_size(nbytes) <= self.alloc.stats()["heap_bytes"]:
                # OOM flushed the cache: nothing stays cached behind a failure.
                assert self.alloc.stats()["cached_bytes"] == 0
            return multiple()
        assert offset not in self.model
        assert offset % 64 == 0
        assert self.alloc.block_size(offset) == self.alloc.round_size(nbytes)
        assert self.alloc.requested_size(offset) == nbytes
        self.model[offset] = nbytes
        return offset

    @rule(offset=consumes(live))
    def free(self, offset: int) -> None:
        if offset in self.model:
            self.alloc.free(offset)
            del self.model[offset]
        else:  # an earlier bundle entry for a reused offset
            with pytest.raises(ZbcclInvalidUsageError, match=str(offset)):
                self.alloc.free(offset)

    @rule()
    def empty_cache(self) -> None:
        self.alloc.empty_cache()
        assert self.alloc.stats()["cached_bytes"] == 0

    @invariant()
    def stats_add_up(self) -> None:
        if not hasattr(self, "alloc"):
            return
        self.alloc.check()
        s = self.alloc.stats()
        assert set(s) == set(STAT_KEYS)
        assert s["allocated_bytes"] + s["cached_bytes"] + s["free_bytes"] == s["heap_bytes"]
        assert s["peak_allocated_bytes"] >= s["allocated_bytes"]
        assert s["active_blocks"] == len(self.model)
        assert s["alloc_count"] - s["free_count"] == len(self.model)
        assert s["requested_bytes"] == sum(self.model.values())
        assert s["allocated_bytes"] == sum(self.alloc.round_size(n) for n in self.model.values())
        assert s["oom_count"] == self.ooms
        assert 0.0 <= s["fragmentation"] < 1.0
        if self.cache_limit is not None:
            assert s["cached_bytes"] <= self.cache_limit
        assert all(self.alloc.owns(o) for o in self.model)


CachingMachine.TestCase.settings = settings(
    max_examples=80, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestCachingFuzz = CachingMachine.TestCase


# -- size classes -------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(nbytes=st.one_of(st.integers(1, 64 * KIB), st.integers(1, 1 << 44)))
def test_round_size_bounds(nbytes: int) -> None:
    alloc = CachingAllocator(MIB)
    size = alloc.round_size(nbytes)
    assert size >= nbytes and size % 64 == 0
    assert alloc.round_size(size) == size, "a class size is its own class"
    assert alloc.round_size(nbytes + 1) >= size, "classes are monotonic"
    if nbytes <= 4 * KIB:
        assert size - nbytes < 64
    else:
        assert (size - nbytes) / nbytes < 0.125


def test_round_size_has_eight_classes_per_octave() -> None:
    alloc = CachingAllocator(MIB)
    classes = {alloc.round_size(n) for n in range(4 * KIB + 1, 8 * KIB + 1)}
    assert sorted(classes) == [4 * KIB + i * 512 for i in range(1, 9)]
    assert alloc.round_size(1) == 64 and alloc.round_size(4 * KIB) == 4 * KIB
    large = CachingAllocator(MIB, alignment=4 * KIB)  # exact region grows to 8 * alignment
    assert large.round_size(20 * KIB) == 20 * KIB and large.round_size(33 * KIB) % (4 * KIB) == 0


@pytest.mark.parametrize("nbytes", [0, -5])
def test_bad_sizes(nbytes: int) -> None:
    alloc = CachingAllocator(MIB)
    with pytest.raises(ZbcclInvalidUsageError, match=f"got {nbytes}"):
        alloc.malloc(nbytes)
    with pytest.raises(ZbcclInvalidUsageError, match=f"got {nbytes}"):
        alloc.try_malloc(nbytes)
    with pytest.raises(ZbcclInvalidUsageError, match="cache_limit"):
        CachingAllocator(MIB, cache_limit=-1)
    with pytest.raises(ZbcclInvalidUsageError, match="alignment"):
        CachingAllocator(MIB, alignment=32)


# -- cache behaviour ----------------------------------------------------------------------


def test_cache_reuses_same_class_lifo() -> None:
    alloc = CachingAllocator(MIB)
    a, b = alloc.malloc(1000), alloc.malloc(1000)
    alloc.free(a)
    alloc.free(b)
    assert alloc.stats()["cached_blocks"] == 2
    assert alloc.malloc(1000) == b, "LIFO: the hottest block first"
    assert alloc.malloc(970) == a, "970 B is in 1000 B's class (1024)"
    assert alloc.stats()["cache_hits"] == 2
    alloc.free(a)
    c = alloc.malloc(2000)  # another class: never served from the 1024 B cache
    assert c != a and alloc.stats()["cache_hits"] == 2
    assert alloc.block_size(c) == 2048


def test_cache_limit_releases_oldest_first() -> None:
    alloc = CachingAllocator(MIB, cache_limit=2 * KIB)
    blocks = [alloc.malloc(KIB) for _ in range(3)]
    for offset in blocks:
        alloc.free(offset)
    s = alloc.stats()
    assert s["cached_bytes"] == 2 * KIB and s["cached_blocks"] == 2
    cached = [row["offset"] for row in alloc.snapshot() if row["kind"] == "cached"]
    assert cached == sorted(blocks[1:]), "the oldest block went back to the arena"


def test_oom_flushes_cache_and_coalesces() -> None:
    alloc = CachingAllocator(64 * KIB)
    small = [alloc.malloc(4 * KIB) for _ in range(16)]  # the whole heap
    for offset in small:
        alloc.free(offset)
    assert alloc.stats()["cached_bytes"] == 64 * KIB
    big = alloc.malloc(48 * KIB)  # fits only once the cached blocks are merged
    s = alloc.stats()
    assert s["cached_bytes"] == 0 and s["allocated_bytes"] == 48 * KIB and s["oom_count"] == 0
    assert alloc.try_malloc(32 * KIB) is None
    assert alloc.stats()["oom_count"] == 0, "try_malloc counts nothing on failure"
    with pytest.raises(ZbcclOutOfMemoryError) as info:
        alloc.malloc(32 * KIB)
    message = str(info.value)
    assert message.startswith("malloc:") and "32768" in message
    for key in ("heap_bytes=65536", "allocated_bytes=49152", "cached_bytes=0", "largest_free_block=16384"):
        assert key in message
    assert "fragmentation=" in message
    assert alloc.stats()["oom_count"] == 1
    alloc.free(big)
    alloc.check()


def test_request_larger_than_heap_keeps_cache() -> None:
    alloc = CachingAllocator(64 * KIB)
    alloc.free(alloc.malloc(KIB))
    with pytest.raises(ZbcclOutOfMemoryError, match="requested 1000000"):
        alloc.malloc(1_000_000)
    assert alloc.stats()["cached_bytes"] == KIB, "flushing cannot help a request above the heap size"


def test_free_errors_and_queries() -> None:
    alloc = CachingAllocator(MIB)
    offset = alloc.malloc(100, kind="tensor")
    assert alloc.owns(offset) and not alloc.owns(offset + 64)
    assert alloc.block_size(offset) == 128 and alloc.requested_size(offset) == 100
    alloc.free(offset)
    assert not alloc.owns(offset)
    with pytest.raises(ZbcclInvalidUsageError, match=f"double free of {offset}"):
        alloc.free(offset)
    with pytest.raises(ZbcclInvalidUsageError, match="unknown offset 4242"):
        alloc.free(4242)
    with pytest.raises(ZbcclInvalidUsageError, match=f"unknown offset {offset}"):
        alloc.block_size(offset)
    assert alloc.stats()["bad_frees"] == 0, "synchronous errors raise instead of counting"


def test_stats_keys_counters_peak_and_snapshot() -> None:
    alloc = CachingAllocator(MIB + 10)
    assert set(alloc.stats()) == set(STAT_KEYS)
    assert alloc.stats()["heap_bytes"] == MIB and alloc.stats()["fragmentation"] == 0.0
    a = alloc.malloc(5000, kind="tensor")
    b = alloc.malloc(100)
    alloc.free(a)
    alloc.record_fallback(300)
    alloc.record_fallback(200)
    alloc.record_staged(4096)
    s = alloc.stats()
    assert (s["fallback_allocs"], s["fallback_bytes"], s["staged_bytes"]) == (2, 500, 4096)
    assert s["peak_allocated_bytes"] == 5120 + 128 and s["allocated_bytes"] == 128
    alloc.reset_peak()
    assert alloc.stats()["peak_allocated_bytes"] == 128
    rows = alloc.snapshot()
    assert [r["offset"] for r in rows] == sorted(r["offset"] for r in rows)
    by_offset = {r["offset"]: r for r in rows}
    assert by_offset[a] == {"offset": a, "size": 5120, "requested": 5000, "kind": "cached", "seq": 1}
    assert by_offset[b] == {"offset": b, "size": 128, "requested": 100, "kind": "explicit", "seq": 2}
    with pytest.raises(ZbcclInvalidUsageError, match="got -1"):
        alloc.record_staged(-1)
