"""The mooncake transport's growth table and registration splits: pure arithmetic (no Mooncake needed)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from zbccl.heap.transports.mooncake.memory import MAX_STEPS, ctrl_layout, parse_table, split_at


def test_split_at_cuts_at_every_boundary_and_nowhere_else():
    ends = [4096, 8192, 20000]
    assert split_at(ends, 0, 4096) == [(0, 4096)]
    assert split_at(ends, 4000, 200) == [(4000, 96), (4096, 104)]
    assert split_at(ends, 100, 19900) == [(100, 3996), (4096, 4096), (8192, 11808)]
    assert split_at(ends, 8192, 0) == []
    assert split_at([0, 4096], 0, 16) == [(0, 16)]  # a first registration of 0 bytes is skipped


@given(st.lists(st.integers(1, 1 << 16), min_size=1, max_size=12), st.data())
def test_split_at_covers_the_range_exactly_within_one_registration_each(steps, data):
    ends, total = [], 0
    for s in steps:
        total += s
        ends.append(total)
    offset = data.draw(st.integers(0, total))
    nbytes = data.draw(st.integers(0, total - offset))
    pieces = split_at(ends, offset, nbytes)
    assert sum(n for _, n in pieces) == nbytes and all(n > 0 for _, n in pieces)
    at = offset
    for lo, n in pieces:
        assert lo == at
        start = max([0] + [e for e in ends if e <= lo])
        end = min(e for e in ends if e > lo)
        assert start <= lo and lo + n <= end  # inside one registration
        at += n


def test_parse_table_accepts_only_a_well_formed_table():
    assert parse_table([2, 4096, 8192], 8192) == [4096, 8192]
    assert parse_table([1, 0], 4096) == [0]
    for bad in ([0, 4096], [MAX_STEPS + 1] + [1] * (MAX_STEPS + 1), [2, 8192, 4096], [2, 4096, 4096],
                [1, -1], [1, 8193], [3, 1, 2], []):
        assert parse_table(bad, 8192) is None, bad


def test_control_region_layout_scales_with_the_world():
    reply, scratch, total = ctrl_layout(2)
    assert reply >= 4096 + 2 * 64 and scratch > reply and total > scratch and total % 4096 == 0
    reply, scratch, total = ctrl_layout(1000)
    assert reply >= 4096 + 1000 * 64
