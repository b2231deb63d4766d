"""Arena: fuzzed alloc/free against a model, plus the failure paths and placement policy."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from zbccl.errors import ZbcclInvalidUsageError
from zbccl.sma import Arena

KIB = 1 << 10
MIB = 1 << 20


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


class ArenaMachine(RuleBasedStateMachine):
    """Random alloc/free sequences; after each step the arena must agree with a plain model."""

    live = Bundle("live")

    @initialize(
        units=st.integers(min_value=1, max_value=256),
        slack=st.integers(min_value=0, max_value=63),
        align=st.sampled_from([64, 128, 512]),
        small_threshold=st.sampled_from([0, 256, 2 * KIB, MIB]),
    )
    def setup(self, units: int, slack: int, align: int, small_threshold: int) -> None:
        self.arena = Arena(units * align + slack, alignment=align, small_threshold=small_threshold)
        self.align = align
        self.model: dict[int, int] = {}  # offset -> size of live blocks

    def _size(self, mode: str, a: int, d: int) -> int:
        size, align = self.arena.size, self.align
        if mode == "small":  # many blocks live at once, so holes form
            return 1 + a % (size // 8 + align)
        if mode == "band":  # 16..39 units: several sizes share a bin, so best fit is tested within one
            return (16 + a % 24) * align + d
        if mode == "any":
            return 1 + a % (size + align)
        if mode == "near_align":  # k * alignment - 1, + 0, + 1
            return max(1, (a % 9) * align + d)
        return max(1, size - a % (2 * align) + d)  # near the whole arena, a little over included

    @rule(
        target=live,
        mode=st.sampled_from(["small", "small", "band", "band", "any", "near_align", "near_whole"]),
        a=st.integers(0, 1 << 20),
        d=st.integers(-1, 1),
    )
    def alloc(self, mode: str, a: int, d: int) -> int:
        return self._alloc(self._size(mode, a, d))

    @rule(target=live, a=st.integers(0, 1 << 20))
    def alloc_small(self, a: int) -> int:
        return self._alloc(1 + a % (self.arena.size // 32 + self.align))

    def _alloc(self, nbytes: int) -> int:
        need = _round_up(nbytes, self.align)
        before = list(self.arena.free_blocks())
        fitting = [(start, size) for start, size in before if size >= need]
        offset = self.arena.alloc(nbytes)
        if offset is None:
            assert not fitting, f"alloc({nbytes}) failed although {fitting} fit"
            return multiple()
        if need >= self.arena.small_threshold:
            # Large: the highest-addressed fitting free block, carved at its high end.
            start, size = max(fitting)
            assert offset == start + size - need, (offset, start, size, need)
        else:
            # Small: best fit (smallest fitting block, lowest address among equals), at its low end.
            best = min(size for _, size in fitting)
            assert offset == min(start for start, size in fitting if size == best), (offset, best, need)
        assert offset % self.align == 0
        assert self.arena.block_size(offset) == need
        self.model[offset] = need
        return offset

    @rule(offset=consumes(live))
    def free(self, offset: int) -> None:
        if offset not in self.model:  # already freed by double_free; the bundle still holds it
            with pytest.raises(ZbcclInvalidUsageError, match=f"{offset}"):
                self.arena.free(offset)
            return
        assert self.arena.free(offset) == self.model.pop(offset)

    @precondition(lambda self: self.model)
    @rule(pick=st.integers(0, 1 << 20))
    def double_free(self, pick: int) -> None:
        offset = sorted(self.model)[pick % len(self.model)]
        self.arena.free(offset)
        with pytest.raises(ZbcclInvalidUsageError, match=f"offset {offset} is not a live block"):
            self.arena.free(offset)
        del self.model[offset]

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "arena"):
            return
        arena = self.arena
        arena.check()
        assert dict(arena.used_blocks()) == self.model
        spans = sorted(self.model.items())
        for (a, na), (b, _) in zip(spans, spans[1:]):
            assert a + na <= b, f"blocks at {a} and {b} overlap"
        assert arena.used_bytes + arena.free_bytes == arena.size
        assert arena.used_bytes == sum(self.model.values())
        assert arena.num_used_blocks == len(self.model)
        free = list(arena.free_blocks())
        assert arena.num_free_blocks == len(free)
        assert arena.largest_free_block == max((n for _, n in free), default=0)

    def teardown(self) -> None:
        if not hasattr(self, "arena"):
            return
        for offset in list(self.model):
            self.arena.free(offset)
        self.arena.check()
        expected = [(0, self.arena.size)]
        assert list(self.arena.free_blocks()) == expected, "freeing everything must coalesce fully"


ArenaMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestArenaFuzz = ArenaMachine.TestCase


def test_usable_size_rounds_down_to_alignment() -> None:
    arena = Arena(1000, alignment=64)
    assert arena.size == 960
    assert arena.free_bytes == 960 and arena.used_bytes == 0
    assert Arena(63).size == 0 and Arena(63).alloc(1) is None


@pytest.mark.parametrize("alignment", [0, 1, 32, 48, 100, -64])
def test_bad_alignment(alignment: int) -> None:
    with pytest.raises(ZbcclInvalidUsageError, match="alignment"):
        Arena(4096, alignment=alignment)


@pytest.mark.parametrize("nbytes", [0, -1])
def test_bad_request_size(nbytes: int) -> None:
    with pytest.raises(ZbcclInvalidUsageError, match=f"got {nbytes}"):
        Arena(4096).alloc(nbytes)


def test_double_free_and_unknown_offset_name_the_offset() -> None:
    arena = Arena(4096)
    a = arena.alloc(100)
    b = arena.alloc(100)
    assert (a, b) == (0, 128)
    assert arena.free(a) == 128
    with pytest.raises(ZbcclInvalidUsageError, match="offset 0 is not a live block"):
        arena.free(a)
    with pytest.raises(ZbcclInvalidUsageError, match="offset 64 is not a live block"):
        arena.free(64)  # inside a live block, not its start
    with pytest.raises(ZbcclInvalidUsageError, match="unknown offset 12345"):
        arena.block_size(12345)
    arena.check()


def test_exact_fit_fills_whole_arena() -> None:
    arena = Arena(64 * KIB + 5)
    offset = arena.alloc(64 * KIB)
    assert offset == 0
    assert arena.free_bytes == 0 and arena.largest_free_block == 0 and arena.num_free_blocks == 0
    assert arena.alloc(1) is None
    assert arena.alloc(64 * KIB + 1) is None
    assert arena.free(offset) == 64 * KIB
    assert list(arena.free_blocks()) == [(0, 64 * KIB)]


def test_small_low_large_high() -> None:
    arena = Arena(16 * MIB, small_threshold=MIB)
    small = [arena.alloc(1000) for _ in range(3)]
    large = [arena.alloc(2 * MIB) for _ in range(2)]
    assert small == [0, 1024, 2048]
    assert large == [14 * MIB, 12 * MIB]
    # The single free block sits between the two groups.
    assert list(arena.free_blocks()) == [(3 * KIB, 12 * MIB - 3 * KIB)]
    arena.check()


def test_best_fit_prefers_smallest_hole() -> None:
    arena = Arena(64 * KIB, small_threshold=MIB)
    blocks = [arena.alloc(n) for n in (4 * KIB, 64, 1 * KIB, 64, 2 * KIB, 64)]
    for offset in blocks[0], blocks[2], blocks[4]:
        arena.free(offset)  # holes of 4 KiB, 1 KiB, 2 KiB, then the tail
    assert arena.alloc(1500) == blocks[4], "the 2 KiB hole is the best fit for 1500 B"
    assert arena.alloc(900) == blocks[2]
    assert arena.alloc(3000) == blocks[0]
    arena.check()


def test_best_fit_within_one_bin() -> None:
    # 32..35 alignment units share one bin: the scan must still pick the tightest hole.
    arena = Arena(64 * KIB, small_threshold=MIB)
    holes = {}
    for units in (35, 33, 34):
        holes[units] = arena.alloc(units * 64)
        arena.alloc(64)  # separator, so the holes cannot merge
    for offset in holes.values():
        arena.free(offset)
    assert arena.alloc(33 * 64) == holes[33]
    assert arena.alloc(32 * 64 + 1) == holes[34]
    assert arena.alloc(34 * 64) == holes[35]
    arena.check()


def test_free_coalesces_both_neighbours() -> None:
    arena = Arena(8 * KIB)
    a, b, c = (arena.alloc(1 * KIB) for _ in range(3))
    arena.free(a)
    arena.free(c)
    assert arena.num_free_blocks == 2  # [a] and [c + tail] merged
    arena.free(b)
    assert list(arena.free_blocks()) == [(0, 8 * KIB)]
    arena.check()


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 300 * KIB), min_size=1, max_size=40), seed=st.randoms())
def test_free_all_in_any_order_coalesces(sizes: list[int], seed) -> None:  # noqa: ANN001
    arena = Arena(4 * MIB, small_threshold=64 * KIB)
    offsets = [o for o in (arena.alloc(n) for n in sizes) if o is not None]
    assume(offsets)
    seed.shuffle(offsets)
    for offset in offsets:
        arena.free(offset)
        arena.check()
    assert list(arena.free_blocks()) == [(0, 4 * MIB)]
