"""CachingAllocator: fuzzed stats invariants, cache reuse, OOM, cache tiers, reentrancy, threads."""

from __future__ import annotations

import gc
import logging
import random
import sys
import threading

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


# -- external cache tiers -------------------------------------------------------------------


class FakeTier:
    """A native-hook stand-in: keeps blocks it got from the allocator instead of freeing them."""

    def __init__(self, alloc: CachingAllocator) -> None:
        self.alloc = alloc
        self.held: list[int] = []
        self.drains = 0

    def cached(self) -> tuple[int, int]:
        return sum(self.alloc.block_size(o) for o in self.held), len(self.held)

    def drain(self) -> None:
        self.drains += 1
        held, self.held = self.held, []
        for offset in held:
            self.alloc.free(offset)


def test_tier_accounting_and_drain_on_oom() -> None:
    alloc = CachingAllocator(64 * KIB)
    tier = FakeTier(alloc)
    alloc.add_cache_tier("native", cached=tier.cached, drain=tier.drain)
    tier.held = [alloc.malloc(8 * KIB) for _ in range(6)]  # 48 KiB held by the tier, no tensor
    keep = alloc.malloc(8 * KIB)
    s = alloc.stats()
    assert s["allocated_bytes"] == 8 * KIB and s["active_blocks"] == 1
    assert s["cached_bytes"] == 48 * KIB and s["cached_blocks"] == 6
    assert s["allocated_bytes"] + s["cached_bytes"] + s["free_bytes"] == s["heap_bytes"]
    big = alloc.malloc(40 * KIB)  # needs the tier's blocks back, coalesced
    assert tier.drains == 1 and tier.held == []
    s = alloc.stats()
    assert s["allocated_bytes"] == 48 * KIB and s["cached_bytes"] == 0
    alloc.free(big)
    alloc.free(keep)
    alloc.check()
    with pytest.raises(ZbcclInvalidUsageError, match="duplicate"):
        alloc.add_cache_tier("native", cached=tier.cached, drain=tier.drain)
    alloc.remove_cache_tier("native")
    with pytest.raises(ZbcclInvalidUsageError, match="unknown tier"):
        alloc.remove_cache_tier("native")
    tier.held = [alloc.malloc(KIB)]
    assert alloc.stats()["allocated_bytes"] == KIB, "a removed tier no longer shifts the accounting"


# -- reentrancy and threads -------------------------------------------------------------------


def _run_with_deadline(fn, seconds: float = 10.0) -> None:  # noqa: ANN001
    errors: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - reported to the test thread
            errors.append(exc)

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), "deadlock: the call did not return"
    if errors:
        raise errors[0]


def test_reentrant_free_inside_malloc_is_queued_then_applied() -> None:
    alloc = CachingAllocator(MIB, cache_limit=0)
    victim = alloc.malloc(KIB)
    real_alloc = alloc._arena.alloc
    seen: dict[str, int] = {}

    def alloc_with_finalizer(nbytes: int) -> int | None:
        alloc.free(victim)  # as a tensor finalizer would, mid-malloc, on the same thread
        alloc.free(victim)  # and a buggy second one: must be counted, not raised here
        seen["live_during"] = alloc.owns(victim)
        return real_alloc(nbytes)

    alloc._arena.alloc = alloc_with_finalizer
    result: list[int] = []
    _run_with_deadline(lambda: result.append(alloc.malloc(2 * KIB)))
    alloc._arena.alloc = real_alloc
    assert seen["live_during"], "the queued free must not mutate state mid-operation"
    assert not alloc.owns(victim) and alloc.owns(result[0])
    s = alloc.stats()
    assert s["free_count"] == 1 and s["bad_frees"] == 1 and s["active_blocks"] == 1
    alloc.check()


def test_gc_finalizer_during_malloc(caplog: pytest.LogCaptureFixture) -> None:
    alloc = CachingAllocator(MIB)
    offsets = [alloc.malloc(256) for _ in range(8)]
    gc.disable()  # the cycles below must be collected inside malloc, not before
    try:
        _finalizers_during_malloc(alloc, offsets, caplog)
    finally:
        gc.enable()
    s = alloc.stats()
    assert s["active_blocks"] == 1 and s["free_count"] == 8 and s["bad_frees"] == 1
    assert "dropped a queued free" in caplog.text
    alloc.check()


def _finalizers_during_malloc(
    alloc: CachingAllocator, offsets: list[int], caplog: pytest.LogCaptureFixture
) -> None:

    class Tensor:
        def __init__(self, offset: int) -> None:
            self.offset = offset
            self.cycle = self  # only the cyclic GC can collect it

        def __del__(self) -> None:
            alloc.free(self.offset)

    for offset in offsets:
        Tensor(offset)
    Tensor(offsets[0])  # a second owner of the same block: a finalizer-time double free
    real_alloc = alloc._arena.alloc

    def alloc_with_gc(nbytes: int) -> int | None:
        gc.collect()
        return real_alloc(nbytes)

    alloc._arena.alloc = alloc_with_gc
    with caplog.at_level(logging.WARNING, logger="zbccl.sma.caching"):
        _run_with_deadline(lambda: alloc.malloc(8 * KIB))
    alloc._arena.alloc = real_alloc


def test_reentrant_malloc_is_refused() -> None:
    alloc = CachingAllocator(MIB)
    real_alloc = alloc._arena.alloc

    def nested(nbytes: int) -> int | None:
        with pytest.raises(ZbcclInvalidUsageError, match="reentrant"):
            alloc.malloc(64)
        return real_alloc(nbytes)

    alloc._arena.alloc = nested
    _run_with_deadline(lambda: alloc.malloc(64))
    alloc._arena.alloc = real_alloc
    assert alloc.stats()["active_blocks"] == 1


def test_threads_stress_keeps_invariants() -> None:
    alloc = CachingAllocator(2 * MIB, cache_limit=256 * KIB)
    owners: dict[int, int] = {}  # live offset -> thread index, to catch a block handed out twice
    owners_lock = threading.Lock()
    handoff: list[int] = []  # blocks freed by a thread other than the allocating one
    errors: list[BaseException] = []

    def worker(index: int) -> None:
        try:
            churn(index)
        except BaseException as exc:  # noqa: BLE001 - reported to the test thread
            errors.append(exc)

    def churn(index: int) -> None:
        rng = random.Random(index)
        mine: list[int] = []
        for step in range(3000):
            if mine and (rng.random() < 0.45 or len(mine) > 40):
                offset = mine.pop(rng.randrange(len(mine)))
                with owners_lock:
                    assert owners.pop(offset) == index
                (handoff.append if rng.random() < 0.2 else alloc.free)(offset)
            else:
                nbytes = rng.choice([rng.randint(1, 4 * KIB), rng.randint(1, 96 * KIB)])
                offset = alloc.try_malloc(nbytes)
                if offset is None:
                    continue
                with owners_lock:
                    assert offset not in owners, f"offset {offset} handed out twice"
                    owners[offset] = index
                mine.append(offset)
            while handoff and rng.random() < 0.5:
                try:
                    alloc.free(handoff.pop())
                except IndexError:
                    break
            if step % 1000 == 0:
                alloc.check()
        for offset in mine:
            with owners_lock:
                owners.pop(offset)
            alloc.free(offset)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often, so they meet inside the lock
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    finally:
        sys.setswitchinterval(old_interval)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    for offset in handoff:
        alloc.free(offset)
    alloc.check()
    s = alloc.stats()
    assert owners == {} and s["allocated_bytes"] == 0 and s["active_blocks"] == 0
    assert s["alloc_count"] == s["free_count"] > 0 and s["bad_frees"] == 0
    alloc.empty_cache()
    assert alloc.stats()["largest_free_block"] == 2 * MIB
