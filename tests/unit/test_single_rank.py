"""A single-rank world needs no launcher: init() with no environment."""

from __future__ import annotations

import os
import threading

import pytest
import torch

import zbccl


@pytest.fixture
def no_dist_env(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)


def _use_single_rank_world(comm) -> None:
    assert (comm.rank, comm.world_size, comm.local_rank, comm.local_world_size) == (0, 1, 0, 1)
    comm.barrier()
    t = zbccl.zeros(10)
    h = zbccl.export(t)
    v = comm.peer_tensor(0, h)
    v[3] = 7.0
    assert t[3] == 7.0
    assert zbccl.memory_stats()["heap_bytes"] == 2 << 20
    sub = comm.new_group([0])
    sub.barrier()
    assert sub.world_size == 1


def test_single_rank_world(no_dist_env):
    comm = zbccl.init(heap_size="2M")
    try:
        _use_single_rank_world(comm)  # its heap tensors die with its frame, so finalize unmaps the heap
    finally:
        zbccl.finalize()
    with pytest.raises(zbccl.ZbcclInvalidUsageError, match="not initialized"):
        zbccl.empty(3)
    assert not zbccl.is_heap_tensor(torch.ones(2))


def test_bad_arguments(no_dist_env):
    with pytest.raises(zbccl.ZbcclInvalidUsageError, match="heap_size"):
        zbccl.init(heap_size=10)
    with pytest.raises(zbccl.ZbcclInvalidUsageError, match="bad heap_size"):
        zbccl.init(heap_size="a lot")
    with pytest.raises(zbccl.ZbcclInvalidUsageError, match="rendezvous"):
        zbccl.init(world_size=2)
    with pytest.raises(zbccl.ZbcclInvalidUsageError, match="rank must be"):
        zbccl.init(store=torch.distributed.HashStore(), rank=3, world_size=2)
    with pytest.raises(zbccl.ZbcclInvalidUsageError, match="ZBCCL_HEAP_SIZE"):
        os.environ["ZBCCL_HEAP_SIZE"] = "lots"
        try:
            zbccl.init()
        finally:
            del os.environ["ZBCCL_HEAP_SIZE"]
    assert not zbccl.is_initialized()


def _zbccl_maps() -> list[str]:
    with open("/proc/self/maps") as f:
        return [line for line in f if "zbccl" in line]


def test_finalize_without_init_is_a_no_op(no_dist_env):
    assert not zbccl.is_initialized()
    threads, maps = sorted(t.name for t in threading.enumerate()), _zbccl_maps()
    assert zbccl.finalize() is None  # raises nothing, twice
    zbccl.finalize()
    assert not zbccl.is_initialized() and zbccl.get_default() is None
    assert sorted(t.name for t in threading.enumerate()) == threads and _zbccl_maps() == maps, "it built something"
    with pytest.raises(zbccl.ZbcclInvalidUsageError, match="not initialized"):
        zbccl.empty(3)
    # it left nothing behind that stops a later init, and finalize after finalize is a no-op too
    comm = zbccl.init(heap_size="1M")
    assert zbccl.is_initialized() and comm.world_size == 1
    zbccl.finalize()
    zbccl.finalize()
    assert not zbccl.is_initialized() and _zbccl_maps() == maps


def _ops_and_profiler_ranges() -> None:
    from torch.profiler import ProfilerActivity, profile

    t = zbccl.zeros(256).fill_(3.0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        zbccl.all_reduce(t, "avg")
        out = torch.empty(256)
        zbccl.all_gather_into_tensor(out, t)
        zbccl.reduce_scatter_tensor(out, t)
        zbccl.broadcast(t, 0)
    names = {e.name for e in prof.events()}
    assert "zbccl::all_reduce(1024B)" in names, sorted(n for n in names if "zbccl" in n)
    assert any(n.startswith("zbccl::all_gather") for n in names)
    assert torch.equal(t, torch.full((256,), 3.0)) and torch.equal(out, t)
    with pytest.raises(zbccl.ZbcclInvalidUsageError, match="reduce op"):
        zbccl.all_reduce(t, "median")
    with pytest.raises(zbccl.ZbcclInvalidUsageError, match="avg needs a floating"):
        zbccl.all_reduce(zbccl.zeros(4, dtype=torch.int32), "avg")
    with pytest.raises(zbccl.ZbcclInvalidUsageError, match="src out of range"):
        zbccl.broadcast(t, 1)


def test_ops_in_a_single_rank_world_and_profiler_ranges(no_dist_env):
    zbccl.init(heap_size="4M")
    try:
        _ops_and_profiler_ranges()  # heap tensors die with its frame
    finally:
        zbccl.finalize()
