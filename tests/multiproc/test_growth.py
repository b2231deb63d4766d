"""A heap that grows, across processes: peers see the grown range, collectives run on it, sizes differ."""

from __future__ import annotations

import torch

from tests.spawn import run_world

MiB = 1 << 20


def payload(rank: int, n: int) -> torch.Tensor:
    """Values that encode their source: f(rank, index) = rank * 1e6 + index (exact in float32 here)."""
    return (torch.arange(n, dtype=torch.float64) + rank * 1_000_000).to(torch.float32)


def _grown_tensor(zbccl, comm, n: int, initial: int):  # noqa: ANN001
    t = zbccl.empty(n, dtype=torch.float32)
    assert zbccl.export(t).offset >= initial, "expected a tensor in the grown range"
    return t


def _grow_then_collectives(ctx, sizes, maxes):  # noqa: ANN001
    import zbccl

    comm = ctx.init(heap_size=sizes[ctx.rank], heap_max=maxes[ctx.rank])
    world, me = ctx.world_size, ctx.rank
    try:
        assert [comm.heap_size_of(r) for r in range(world)] == sizes
        n = MiB // 4  # 1 MiB of float32
        if me == 0:
            fill = zbccl.empty(sizes[0] - MiB // 2, dtype=torch.uint8)  # the initial heap is (nearly) full
            x = _grown_tensor(zbccl, comm, n, sizes[0])
            out = _grown_tensor(zbccl, comm, world * n, sizes[0])
            assert zbccl.memory_stats()["grow_count"] == 1
        else:
            x, out = zbccl.empty(n, dtype=torch.float32), zbccl.empty(world * n, dtype=torch.float32)
        grown = comm.all_gather_object(zbccl.memory_stats()["heap_bytes"])
        assert grown[0] > sizes[0] and grown[1:] == sizes[1:]
        assert [comm.heap_size_of(r) for r in range(world)] == grown, "peers read the live size"

        # Peers read the grown range directly and write into it.
        x.copy_(payload(me, n))
        handles = comm.all_gather_object(zbccl.export(x))
        comm.barrier()
        if me == 1:
            peer = comm.peer_tensor(0, handles[0])
            assert torch.equal(peer, payload(0, n)), "rank 1 reads rank 0's grown range"
            peer[:4] = -1.0
        comm.barrier()
        if me == 0:
            assert x[:4].tolist() == [-1.0] * 4, "rank 0 sees rank 1's write into its grown range"
        comm.barrier()

        # Collectives with rank 0's operands in its grown range: zero-buffer, exact.
        # oneshot and pull read the peers' operands; twoshot and push also write into them.
        from zbccl.ops.tuner import force_algorithm

        staged = zbccl.memory_stats()["staged_bytes"]
        for reduce_algo, gather_algo in (("oneshot", "pull"), ("twoshot", "push")):
            force_algorithm(comm, "all_reduce", reduce_algo)
            force_algorithm(comm, "all_gather", gather_algo)
            x.copy_(payload(me, n))
            zbccl.all_reduce(x)
            assert torch.equal(x, sum(payload(r, n).double() for r in range(world)).float()), reduce_algo
            x.copy_(payload(me, n))
            out.zero_()
            zbccl.all_gather_into_tensor(out, x)
            assert torch.equal(out, torch.cat([payload(r, n) for r in range(world)])), gather_algo
        assert zbccl.memory_stats()["staged_bytes"] == staged, "heap tensors must not be staged"
        if me == 0:
            del fill
        del x, out
        return comm.heap_bytes
    finally:
        zbccl.finalize()


def test_rank0_grows_and_collectives_use_the_grown_range():
    sizes, maxes = [8 * MiB, 16 * MiB], ["512M", 0]  # heaps and bounds differ per rank; rank 1 never grows
    got = run_world(_grow_then_collectives, 2, sizes=sizes, maxes=maxes)
    assert got[0] == 8 * MiB + 64 * MiB and got[1] == 16 * MiB


def test_world3_growth():
    sizes, maxes = [8 * MiB, 12 * MiB, 16 * MiB], ["256M", "auto", 0]
    got = run_world(_grow_then_collectives, 3, sizes=sizes, maxes=maxes)
    assert got[0] > sizes[0] and got[1:] == sizes[1:]
