"""SMA placement: a flushed cache leaves no hole (issue 7's 192 MiB repro) and the "stack" guarantee, fuzzed."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from zbccl.sma import CachingAllocator

KIB = 1 << 10
MIB = 1 << 20


def _doubling_rounds(alloc: CachingAllocator, smallest: int, largest: int) -> None:
    """Issue 7: per n, malloc(n) and free it, then malloc(n) and malloc(2n) and free both."""
    n = smallest
    while n <= largest:
        alloc.free(alloc.malloc(n))
        a, b = alloc.malloc(n), alloc.malloc(2 * n)
        alloc.free(a)
        alloc.free(b)
        alloc.check()
        n *= 2


def test_issue7_doubling_sizes_fit_in_192_mib() -> None:
    # Before the fix, malloc(128 MiB) at n = 64 MiB raised with free_bytes=128 MiB,
    # largest_free_block=65 MiB: a cached 64 MiB block had been reused at offset 65 MiB.
    alloc = CachingAllocator(192 * MIB)
    _doubling_rounds(alloc, 4 * KIB, 64 * MIB)
    s = alloc.stats()
    assert s["oom_count"] == 0 and s["active_blocks"] == 0
    alloc.empty_cache()
    assert alloc.stats()["largest_free_block"] == 192 * MIB


def test_large_blocks_are_not_cached_and_pack_at_the_top() -> None:
    alloc = CachingAllocator(16 * MIB)
    a = alloc.malloc(2 * MIB)
    assert a == 14 * MIB
    alloc.free(a)
    s = alloc.stats()
    assert s["cached_bytes"] == 0 and s["largest_free_block"] == 16 * MIB, "freed straight to the arena"
    b, c = alloc.malloc(3 * MIB), alloc.malloc(MIB)
    assert (b, c) == (13 * MIB, 12 * MIB), "highest-addressed fit, one run against the top"
    small = alloc.malloc(KIB)
    alloc.free(small)
    assert alloc.stats()["cached_blocks"] == 1, "small blocks are still cached"


def _largest_class_within(alloc: CachingAllocator, nbytes: int) -> int:
    """The largest block size (size class) of at most ``nbytes``."""
    size = alloc.round_size(1)
    while alloc.round_size(size + 1) <= nbytes:
        size = alloc.round_size(size + 1)
    return size


def _sizes(small: int, large: int):  # noqa: ANN202
    return st.one_of(st.integers(1, small - 1), st.integers(small, large))


@settings(max_examples=150, deadline=None)
@given(
    rounds=st.lists(st.lists(_sizes(64 * KIB, 512 * KIB), min_size=1, max_size=8), min_size=1, max_size=6),
    final=st.lists(_sizes(64 * KIB, 512 * KIB), min_size=1, max_size=8),
    order=st.randoms(use_true_random=False),
)
def test_stack_guarantee(rounds: list[list[int]], final: list[int], order) -> None:  # noqa: ANN001
    """Rounds of allocations freed in any order, then a last round whose large blocks stay live.

    The documented guarantee (sma/caching.py): those large blocks form one run
    ending at the top, and once no small block is live a request of the whole
    free space succeeds (the flush returns the cached small blocks at the bottom).
    Sizes are bounded so that every round fits: 8 x 512 KiB of 8 MiB.
    """
    heap = 8 * MIB
    alloc = CachingAllocator(heap, small_threshold=64 * KIB)
    for sizes in rounds:
        offsets = [alloc.malloc(n) for n in sizes]
        order.shuffle(offsets)
        for offset in offsets:
            alloc.free(offset)
    got = [(offset, alloc.block_size(offset)) for offset in (alloc.malloc(n) for n in final)]
    for offset, size in got:
        if size < 64 * KIB:  # large or small by block size (size class), not by request
            alloc.free(offset)
    large = sorted((offset, size) for offset, size in got if size >= 64 * KIB)
    pos = heap
    for offset, size in reversed(large):
        assert offset + size == pos, f"large blocks {large} are not one run ending at {heap}"
        pos = offset
    alloc.check()
    rest = heap - sum(size for _, size in large)
    if rest:
        block = _largest_class_within(alloc, rest)
        offset = alloc.malloc(block)  # (nearly) the whole free space, in one block
        assert offset == (rest - block if block >= 64 * KIB else 0)
    assert alloc.stats()["oom_count"] == 0


@settings(max_examples=100, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), _sizes(4 * KIB, 3 * MIB)), min_size=1, max_size=60),
       order=st.randoms(use_true_random=False))
def test_free_all_and_flush_leaves_one_block(ops: list[tuple[bool, int]], order) -> None:  # noqa: ANN001
    """Any sequence of mallocs and frees: freeing everything and flushing leaves one free block."""
    alloc = CachingAllocator(16 * MIB, small_threshold=256 * KIB)
    live: list[int] = []
    for free_one, n in ops:
        if free_one and live:
            alloc.free(live.pop(order.randrange(len(live))))
        else:
            offset = alloc.try_malloc(n)
            if offset is not None:
                live.append(offset)
    order.shuffle(live)
    for offset in live:
        alloc.free(offset)
    alloc.empty_cache()
    alloc.check()
    s = alloc.stats()
    assert (s["free_bytes"], s["largest_free_block"]) == (16 * MIB, 16 * MIB)
    assert alloc.malloc(16 * MIB) == 0
