"""The host-state probe (``bench/probe.py``) at world 2 and 3: sane numbers and a label, never timings."""

from __future__ import annotations

import math

import pytest

from tests.spawn import run_world


def _probe_twice(ctx):
    import zbccl
    from zbccl.bench.probe import probe_host_state

    comm = ctx.init(heap_size=32 << 20)
    try:
        before = zbccl.memory_stats(comm)["active_blocks"]
        first = probe_host_state(comm, reps=3, warmup=1)
        second = probe_host_state(comm)  # a second probe reuses nothing stale (fresh flags, epochs)
        after = zbccl.memory_stats(comm)["active_blocks"]
        return first, second, before, after
    finally:
        zbccl.finalize()


@pytest.mark.parametrize("world_size", [2, 3])
def test_probe_labels_and_numbers(world_size):
    results = run_world(_probe_twice, world_size, timeout=120)
    for first, second, before, after in results:
        assert first == {**results[0][0], "cost_ms": first["cost_ms"]}  # rank 0's result on every rank
        for p, reps in ((first, 3), (second, 15)):
            assert p["state"] in ("fast", "slow")
            assert p["reps"] == reps and len(p["samples_ns_per_line"]) == reps and p["lines"] > 0
            for key in ("shared_ns_per_line", "private_ns_per_line", "ratio", "cost_ms"):
                assert math.isfinite(p[key]) and p[key] > 0, (key, p)
            assert all(s > 0 and q > 0 for s, q in p["samples_ns_per_line"])
            assert len(p["cpus"]) == 2
        assert before == after  # the probe's heap blocks went back


def _world1(ctx):
    import zbccl
    from zbccl.bench.probe import probe_host_state

    comm = ctx.init(heap_size=8 << 20)
    try:
        return probe_host_state(comm)
    finally:
        zbccl.finalize()


def test_probe_world1_is_none():
    assert run_world(_world1, 1) == [None]
