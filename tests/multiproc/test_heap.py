"""The shared heap across processes: asymmetric sizes, peer views, bounds, groups."""

from __future__ import annotations

import pytest
import torch

from tests.spawn import run_world

MiB = 1 << 20


def payload(rank: int, n: int, dtype=torch.float32) -> torch.Tensor:
    """Values that encode their source: f(rank, index) = rank * 1e6 + index."""
    return (torch.arange(n, dtype=torch.float64) + rank * 1_000_000).to(dtype)


def _asymmetric(ctx, sizes):
    import zbccl

    comm = ctx.init(heap_size=sizes[ctx.rank])
    try:
        assert comm.rank == ctx.rank and comm.world_size == ctx.world_size
        assert comm.local_world_size == ctx.world_size and comm.local_rank == ctx.rank
        assert [comm.heap_size_of(r) for r in range(ctx.world_size)] == sizes
        assert comm.heap_bytes == sizes[ctx.rank]
        n = 1000
        t = zbccl.zeros(n, dtype=torch.float32)
        assert zbccl.is_heap_tensor(t)
        handles = comm.all_gather_object(zbccl.export(t))
        assert handles[ctx.rank].rank == ctx.rank
        comm.barrier()
        if ctx.rank == 0:
            peer = comm.peer_tensor(1, handles[1])
            assert peer.shape == (n,) and peer.dtype == torch.float32
            peer.copy_(payload(0, n))  # direct store into rank 1's tensor
        comm.barrier()
        if ctx.rank == 1:
            assert torch.equal(t, payload(0, n)), "rank 1 does not see rank 0's direct write"
        # Out-of-bounds handles are refused and touch nothing, on every rank.
        small = sizes[1]
        bad = zbccl.HeapHandle(rank=1, offset=small - 64, shape=(64,), stride=(1,), dtype="float32")
        with pytest.raises(zbccl.ZbcclInvalidUsageError, match="out of bounds"):
            comm.peer_tensor(1, bad)
        neg = zbccl.HeapHandle(rank=1, offset=-64, shape=(4,), stride=(1,), dtype="float32")
        with pytest.raises(zbccl.ZbcclInvalidUsageError):
            comm.peer_tensor(1, neg)
        # The same offset fits in the larger heap of rank 0: asymmetric bounds are per rank.
        ok = zbccl.HeapHandle(rank=0, offset=small, shape=(16,), stride=(1,), dtype="float32")
        assert comm.peer_tensor(0, ok).numel() == 16
        with pytest.raises(zbccl.ZbcclInvalidUsageError, match="rank out of range"):
            comm.peer_tensor(ctx.world_size, handles[0])
        comm.barrier()
        assert torch.equal(t, payload(0, n) if ctx.rank == 1 else torch.zeros(n))
        return zbccl.memory_stats()["heap_bytes"]
    finally:
        zbccl.finalize()


def test_asymmetric_heaps_peer_write_and_bounds():
    sizes = [64 * MiB, 32 * MiB]
    assert run_world(_asymmetric, 2, sizes=sizes) == sizes


def _world3(ctx):
    import zbccl

    comm = ctx.init(heap_size=(4 + ctx.rank) * MiB)
    try:
        n = 257
        mine = zbccl.empty(n, dtype=torch.bfloat16)
        mine.copy_(payload(ctx.rank, n, torch.bfloat16))
        handles = comm.all_gather_object(zbccl.export(mine))
        comm.barrier()
        for r in range(comm.world_size):
            assert torch.equal(comm.peer_tensor(r, handles[r]), payload(r, n, torch.bfloat16)), f"row of rank {r}"
        # A strided export views the same elements at the peer.
        m = zbccl.empty(8, 6, dtype=torch.int32)
        m.copy_(torch.arange(48, dtype=torch.int32).view(8, 6) + 100 * ctx.rank)
        col = m[:, 1::2]
        hs = comm.all_gather_object(zbccl.export(col))
        comm.barrier()
        for r in range(comm.world_size):
            v = comm.peer_tensor(r, hs[r])
            assert v.shape == (8, 3) and torch.equal(v, (torch.arange(48, dtype=torch.int32).view(8, 6) + 100 * r)[:, 1::2])
        # Sub-communicator over ranks {0, 2}: its own barrier and numbering.
        sub = comm.new_group([0, 2])
        if ctx.rank == 1:
            assert not sub and not sub.is_member
        else:
            assert sub.world_size == 2 and sub.ranks == (0, 2) and sub.rank == ctx.rank // 2
            for _ in range(50):
                sub.barrier()
            got = sub.all_gather_object(ctx.rank)
            assert got == [0, 2]
            v = sub.peer_tensor(1 - sub.rank, handles[2 if sub.rank == 0 else 0])
            assert v.numel() == n
        comm.barrier()
        return True
    finally:
        zbccl.finalize()


def test_world_size_3_views_and_subgroups():
    assert run_world(_world3, 3) == [True] * 3


def _many_barriers(ctx):
    import zbccl

    comm = ctx.init(heap_size=MiB)
    try:
        flag = zbccl.zeros(ctx.world_size, dtype=torch.int64)
        hs = comm.all_gather_object(zbccl.export(flag))
        views = [comm.peer_tensor(r, hs[r]) for r in range(ctx.world_size)]
        # Ring of writes separated by barriers: each round every rank writes its
        # round number into the next rank's slot; after the barrier all must see it.
        for i in range(200):
            nxt = (ctx.rank + 1) % ctx.world_size
            views[nxt][ctx.rank] = i * 10 + ctx.rank
            comm.barrier()
            prev = (ctx.rank - 1) % ctx.world_size
            assert int(flag[prev]) == i * 10 + prev, f"round {i}: stale value from rank {prev}"
            comm.barrier()
        return True
    finally:
        zbccl.finalize()


@pytest.mark.parametrize("world_size", [2, 4])
def test_barrier_orders_writes(world_size):
    # world 4 runs 4 ranks on 2 cores: waits must yield, not spin.
    assert run_world(_many_barriers, world_size) == [True] * world_size
