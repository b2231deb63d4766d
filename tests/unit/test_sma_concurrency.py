"""CachingAllocator with others: external cache tiers, reentrant frees from finalizers, threads."""

from __future__ import annotations

import gc
import logging
import random
import sys
import threading

import pytest

from zbccl.errors import ZbcclInvalidUsageError
from zbccl.sma import CachingAllocator

KIB = 1 << 10
MIB = 1 << 20


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
