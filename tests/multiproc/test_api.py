"""The explicit heap-tensor API and init's rendezvous modes."""

from __future__ import annotations

import gc

import pytest
import torch

from tests.spawn import run_world

MiB = 1 << 20


def _explicit_api(ctx):
    import zbccl

    comm = ctx.init(heap_size=4 * MiB, heap_max=0)  # a fixed heap: running out of it is tested below
    try:
        base = zbccl.memory_stats()
        assert base["heap_bytes"] == 4 * MiB and base["allocated_bytes"] == 0
        a = zbccl.empty(3, 5, dtype=torch.bfloat16)
        b = zbccl.zeros((7,), dtype=torch.int32)
        c = zbccl.empty_like(a)
        assert a.shape == (3, 5) and a.dtype == torch.bfloat16 and a.is_contiguous()
        assert torch.equal(b, torch.zeros(7, dtype=torch.int32))
        assert c.shape == a.shape and c.dtype == a.dtype
        assert all(zbccl.is_heap_tensor(t) for t in (a, b, c, a[1:], a.t()))
        assert not zbccl.is_heap_tensor(torch.empty(4))
        assert len({a.data_ptr() % 64, b.data_ptr() % 64, c.data_ptr() % 64}) == 1 and a.data_ptr() % 64 == 0
        st = zbccl.memory_stats()
        assert st["active_blocks"] == 3 and st["alloc_count"] == 3
        snap = zbccl.memory_snapshot()
        assert sum(1 for blk in snap if blk["kind"] == "explicit") == 3
        # Views keep the block; the last reference returns it, with no explicit free.
        view = a[1]
        del a
        gc.collect()
        assert zbccl.memory_stats()["active_blocks"] == 3
        del view, b, c
        gc.collect()
        st = zbccl.memory_stats()
        assert st["active_blocks"] == 0 and st["allocated_bytes"] == 0 and st["free_count"] == 3
        assert st["peak_allocated_bytes"] > 0
        # Out of heap: a clear error carrying the stats.
        with pytest.raises(zbccl.ZbcclOutOfMemoryError, match="heap"):
            zbccl.empty(8 * MiB, dtype=torch.uint8)
        # export refuses a tensor outside the heap.
        with pytest.raises(zbccl.ZbcclInvalidUsageError, match="not in this rank's heap"):
            zbccl.export(torch.ones(3))
        # Zero-element tensors work and export.
        z = zbccl.empty(0, 4)
        h = zbccl.export(z)
        assert comm.peer_tensor(comm.rank, h).shape == (0, 4)
        with pytest.raises(zbccl.ZbcclInvalidUsageError):
            zbccl.init(store=ctx.store(), rank=ctx.rank, world_size=ctx.world_size)
        return True
    finally:
        zbccl.finalize()
        assert not zbccl.is_initialized()


def test_explicit_tensors_and_stats():
    assert run_world(_explicit_api, 2) == [True, True]


def _reinit(ctx):
    import zbccl

    jobs = []
    for round_ in range(3):
        comm = ctx.init(heap_size=MiB)
        t = zbccl.empty(16, dtype=torch.int64).fill_(round_ * 10 + ctx.rank)
        hs = comm.all_gather_object(zbccl.export(t))
        comm.barrier()
        peer = comm.peer_tensor(1 - comm.rank, hs[1 - comm.rank])
        assert int(peer[0]) == round_ * 10 + 1 - comm.rank
        jobs.append(comm.job_id)
        del t, peer
        zbccl.finalize()
    assert len(set(jobs)) == 3
    return jobs


def test_init_finalize_init_on_one_store():
    a, b = run_world(_reinit, 2)
    assert a == b


def _torchrun_env(ctx):
    import os

    import zbccl

    os.environ.update({"RANK": str(ctx.rank), "WORLD_SIZE": str(ctx.world_size), "LOCAL_RANK": str(ctx.rank),
                       **ctx.agent_store_env()})
    comm = zbccl.init(heap_size=MiB, timeout=30)
    try:
        comm.barrier()
        return (comm.rank, comm.world_size, comm.local_rank, comm.local_world_size)
    finally:
        zbccl.finalize()


def test_init_from_torchrun_environment():
    assert run_world(_torchrun_env, 2) == [(0, 2, 0, 2), (1, 2, 1, 2)]


def _init_method(ctx):
    import os

    import zbccl

    env = ctx.agent_store_env()
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = env["TORCHELASTIC_USE_AGENT_STORE"]
    url = f"tcp://{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    comm = zbccl.init(init_method=url, rank=ctx.rank, world_size=ctx.world_size, heap_size=MiB, timeout=30)
    try:
        comm.barrier()
        return comm.world_size
    finally:
        zbccl.finalize()


def test_init_from_url():
    assert run_world(_init_method, 2) == [2, 2]


def _from_group(ctx):
    import torch.distributed as dist

    import zbccl

    dist.init_process_group("gloo", store=ctx.store(), rank=ctx.rank, world_size=ctx.world_size)
    try:
        comm = zbccl.init(group=dist.group.WORLD, heap_size=MiB)
        t = zbccl.empty(4, dtype=torch.float32).fill_(ctx.rank + 1)
        hs = comm.all_gather_object(zbccl.export(t))
        comm.barrier()
        total = sum(float(comm.peer_tensor(r, hs[r])[0]) for r in range(comm.world_size))
        zbccl.finalize()
        return total
    finally:
        dist.destroy_process_group()


def test_init_from_process_group():
    assert run_world(_from_group, 2) == [3.0, 3.0]


def _scoped(ctx):
    import zbccl
    from zbccl.adapters.scope import hook_stats

    comm = ctx.init(heap_size=8 * MiB, heap_max=0)  # a fixed heap: the fallback when it is full is tested
    try:
        x = torch.randn(64, 32)
        w = torch.randn(32, 16)
        with zbccl.heap_scope():
            y = x @ w
            z = torch.cat([y, torch.full_like(y, float(ctx.rank))])
            e = torch.empty(1000)
        outside = x @ w
        assert all(zbccl.is_heap_tensor(t) for t in (y, z, e)), "op outputs must land in the heap"
        assert not zbccl.is_heap_tensor(outside) and not zbccl.is_heap_tensor(x)
        assert torch.allclose(y, outside)
        # a scoped tensor is a normal heap tensor: export it, a peer reads it
        hs = comm.all_gather_object(zbccl.export(z))
        comm.barrier()
        peer = comm.peer_tensor(1 - comm.rank, hs[1 - comm.rank])
        assert torch.equal(peer[64:], torch.full((64, 16), float(1 - comm.rank)))
        del peer
        comm.barrier()
        # freed anywhere, memory returns (cached by the hook tier, accounted as cached)
        before = zbccl.memory_stats()["allocated_bytes"]
        del y, z, e
        gc.collect()
        st = zbccl.memory_stats()
        assert st["allocated_bytes"] < before and st["allocated_bytes"] == 0, st
        # heap full: ordinary memory and a fallback count; strict raises
        with zbccl.heap_scope():
            big = torch.ones(4 << 20)  # 16 MiB > 8 MiB heap
        assert not zbccl.is_heap_tensor(big) and float(big.sum()) == 4 << 20
        assert zbccl.memory_stats()["fallback_allocs"] >= 1 and hook_stats()["fallback_allocs"] >= 1
        with pytest.raises(RuntimeError, match="strict=True"):
            with zbccl.heap_scope(strict=True):
                torch.ones(4 << 20)
        # collectives on scoped tensors are zero-copy
        st0 = zbccl.memory_stats()["staged_bytes"]
        with zbccl.heap_scope():
            t = torch.full((1000,), float(ctx.rank + 1))
        zbccl.all_reduce(t)
        assert torch.equal(t, torch.full((1000,), 3.0))
        assert zbccl.memory_stats()["staged_bytes"] == st0
        return True
    finally:
        zbccl.finalize()


def test_heap_scope_places_op_outputs_in_the_heap():
    assert run_world(_scoped, 2) == [True, True]
