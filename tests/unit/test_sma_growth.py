"""SMA growth: Arena.extend, the growth target, and CachingAllocator growing through its callback."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zbccl.errors import ZbcclInvalidUsageError, ZbcclOutOfMemoryError
from zbccl.sma import Arena, CachingAllocator
from zbccl.sma.growth import GRANULE, STEP, grow_target

KIB = 1 << 10
MIB = 1 << 20


def test_grow_target() -> None:
    assert grow_target(10 * MIB, MIB, 0, 1 << 40) == 10 * MIB + STEP, "at least one step"
    assert grow_target(10 * MIB, 100 * MIB, 0, 1 << 40) == 110 * MIB, "the request, granule-rounded"
    assert grow_target(10 * MIB, 100 * MIB + 1, 0, 1 << 40) == 110 * MIB + GRANULE
    assert grow_target(10 * MIB, 8 * MIB, 4 * MIB, 16 * MIB) == 16 * MIB, "capped at the max"
    assert grow_target(10 * MIB, 8 * MIB, 2 * MIB, 16 * MIB) == 16 * MIB, "exactly the max still fits"
    assert grow_target(10 * MIB, 8 * MIB, 1 * MIB, 16 * MIB) is None, "17 MiB would be needed"


@settings(max_examples=100, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["alloc", "free", "extend"]), st.integers(1, 300 * KIB)),
                    max_size=60),
       order=st.randoms(use_true_random=False))
def test_extend_keeps_invariants(ops: list[tuple[str, int]], order) -> None:  # noqa: ANN001
    arena = Arena(MIB, small_threshold=64 * KIB)
    live: list[int] = []
    for op, n in ops:
        if op == "alloc":
            offset = arena.alloc(n)
            if offset is not None:
                live.append(offset)
        elif op == "free" and live:
            arena.free(live.pop(order.randrange(len(live))))
        elif op == "extend":
            tail = arena.free_tail
            before = arena.size
            arena.extend(before + n)
            grown = arena.size - before
            assert arena.free_tail == tail + grown
        arena.check()
    for offset in live:
        arena.free(offset)
    assert list(arena.free_blocks()) == [(0, arena.size)]


def test_extend_refuses_shrinking() -> None:
    arena = Arena(MIB)
    with pytest.raises(ZbcclInvalidUsageError, match="cannot shrink"):
        arena.extend(MIB - 64)
    arena.extend(MIB + 63)  # rounded down to the alignment: nothing to add
    assert arena.size == MIB


class FakeHeap:
    """Stands in for the heap's grow callback: records sizes, refuses when told to."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.refuse: str | None = None

    def grow(self, nbytes: int) -> None:
        if self.refuse:
            raise ZbcclOutOfMemoryError(f"heap: grow: {self.refuse}")
        self.sizes.append(nbytes)


def test_malloc_grows_the_heap() -> None:
    heap = FakeHeap()
    alloc = CachingAllocator(4 * MIB, max_bytes=256 * MIB, grow=heap.grow)
    s = alloc.stats()
    assert (s["heap_bytes"], s["heap_max_bytes"], s["grow_count"]) == (4 * MIB, 256 * MIB, 0)
    first = alloc.malloc(3 * MIB)  # large: at the top
    small = alloc.malloc(KIB)
    alloc.free(small)  # cached: the growth path flushes it first
    big = alloc.malloc(8 * MIB)
    assert heap.sizes == [4 * MIB + STEP]
    assert big == 4 * MIB + STEP - 8 * MIB, "in the new range, at its top"
    s = alloc.stats()
    assert (s["heap_bytes"], s["grow_count"], s["cached_bytes"]) == (4 * MIB + STEP, 1, 0)
    alloc.check()
    alloc.free(big)  # the top 64 MiB are one free block again: the next growth merges with it
    assert alloc.round_size(150 * MIB) == 160 * MIB
    huge = alloc.malloc(150 * MIB)
    assert heap.sizes[-1] == 4 * MIB + 160 * MIB, "only what the free top block lacks"
    big = alloc.malloc(8 * MIB)
    for offset in first, big, huge:
        alloc.free(offset)
    alloc.check()
    assert alloc.stats()["largest_free_block"] == heap.sizes[-1]


def test_growth_refused_beyond_max_names_request_free_and_max() -> None:
    heap = FakeHeap()
    alloc = CachingAllocator(4 * MIB, max_bytes=16 * MIB, grow=heap.grow)
    keep = alloc.malloc(2 * MIB)
    with pytest.raises(ZbcclOutOfMemoryError) as info:
        alloc.malloc(15 * MIB)
    message = str(info.value)
    for part in ("requested 15728640", "free_bytes=2097152", "heap_max_bytes=16777216", "growth refused"):
        assert part in message, message
    assert heap.sizes == [] and alloc.stats()["heap_bytes"] == 4 * MIB
    with pytest.raises(ZbcclOutOfMemoryError, match="exceeds heap_max_bytes=16777216"):
        alloc.malloc(17 * MIB)
    assert alloc.try_malloc(12 * MIB) is not None, "up to the max it grows (12 MiB above the live 2 MiB)"
    assert heap.sizes == [16 * MIB]
    alloc.free(keep)


def test_failed_growth_changes_nothing_and_reports_why() -> None:
    heap = FakeHeap()
    heap.refuse = "cannot reserve 64 MiB more: No space left on device"
    alloc = CachingAllocator(4 * MIB, max_bytes=1 << 30, grow=heap.grow)
    assert alloc.try_malloc(8 * MIB) is None
    with pytest.raises(ZbcclOutOfMemoryError, match="No space left on device"):
        alloc.malloc(8 * MIB)
    s = alloc.stats()
    assert (s["heap_bytes"], s["grow_count"], s["oom_count"]) == (4 * MIB, 0, 1)
    heap.refuse = None
    alloc.free(alloc.malloc(8 * MIB))
    alloc.check()


def test_bad_max_bytes() -> None:
    with pytest.raises(ZbcclInvalidUsageError, match="max_bytes"):
        CachingAllocator(4 * MIB, max_bytes=2 * MIB)
    with pytest.raises(ZbcclInvalidUsageError, match="grow callback"):
        CachingAllocator(4 * MIB, max_bytes=8 * MIB)
