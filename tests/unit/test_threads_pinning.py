"""Thread and spin decisions from every local rank's affinity mask (fake masks, no world)."""

from __future__ import annotations

import pytest

from zbccl.bootstrap.topology import HostInfo, Topology, format_cpus, masks_oversubscribed
from zbccl.runtime.threads import plan_threads, shared_threads


def cpus(lo: int, hi: int) -> frozenset[int]:
    return frozenset(range(lo, hi))


def test_pinned_ranks_get_all_their_cores():
    # vLLM/SGLang style: 4 ranks, each pinned to its own 32 cores of a 128-core host.
    masks = [cpus(32 * i, 32 * (i + 1)) for i in range(4)]
    assert [shared_threads(m, masks) for m in masks] == [32] * 4
    assert not masks_oversubscribed(masks)


def test_unpinned_ranks_share_the_machine():
    masks = [cpus(0, 128)] * 4
    assert shared_threads(masks[0], masks) == 32
    assert not masks_oversubscribed(masks)
    assert masks_oversubscribed([cpus(0, 2)] * 4)  # 4 ranks on 2 cores


def test_overlapping_and_identical_pins():
    a, b, c = cpus(0, 4), cpus(2, 6), cpus(0, 1)
    # CPUs 2,3 are shared by a and b: a gets 2 + 2 * 1/2 = 3.
    assert shared_threads(a, [a, b]) == 3 and shared_threads(b, [a, b]) == 3
    assert masks_oversubscribed([c, c])  # both ranks pinned to core 0
    assert shared_threads(c, [c, c]) == 1  # never below one
    assert not masks_oversubscribed([frozenset({0}), frozenset({1})])
    # Three ranks confined to cores {0, 1} (one on 0-1, two on 0) although the host has 8.
    assert masks_oversubscribed([cpus(0, 2), c, c, cpus(2, 8)])
    # 8 ranks each on its own core: fine, however few cores each has.
    assert not masks_oversubscribed([frozenset({i}) for i in range(8)])


@pytest.mark.parametrize("want, expect", [(-1, (32, None)), (0, (6, None)), (5, (5, 5))])
def test_torch_threads_change_only_when_asked(want, expect):
    masks = [cpus(32 * i, 32 * (i + 1)) for i in range(4)]
    assert plan_threads(want, masks[1], masks, torch_threads=6) == expect


def test_topology_decides_from_every_local_rank():
    # 8 ranks each pinned to its own core: this rank's one core alone said "oversubscribed".
    own = tuple(HostInfo("h", "host", 100 + r, 1, (r,)) for r in range(8))
    assert not Topology(3, own).oversubscribed
    infos = tuple(HostInfo("h", "host", 100 + r, 32, tuple(range(32 * r, 32 * (r + 1)))) for r in range(4))
    same = tuple(HostInfo("h", "host", 100 + r, 1, (0,)) for r in range(2))
    assert Topology(0, same).oversubscribed
    info = HostInfo.from_dict(infos[2].to_dict())
    assert info == infos[2] and format_cpus(info.cpus) == "64-95"
    assert format_cpus([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
