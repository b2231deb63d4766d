"""Run by test_process_group_groups.test_under_torchrun: the zbccl backend under real torchrun.

Usage: python -m torch.distributed.run --standalone --nproc-per-node 2 pg_torchrun_script.py
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import zbccl


def main() -> None:
    dist.init_process_group("zbccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    pg = dist.group.WORLD
    assert pg.comm is not None, pg.fallback_reason
    t = torch.full((8,), float(rank + 1))
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((8,), world * (world + 1) / 2))
    # functional collectives on the zbccl group
    r = funcol.all_reduce(torch.full((4,), float(rank)), "sum", pg).wait()
    assert torch.equal(r, torch.full((4,), float(sum(range(world)))))
    calls = []
    real = pg.all_gather_single
    pg.all_gather_single = lambda *a: calls.append(1) or real(*a)  # did the op reach the zbccl group?
    g = funcol.all_gather_single(torch.full((2,), float(rank)), 0, pg).wait()
    assert calls, "funcol all_gather did not reach the zbccl group"
    assert torch.equal(g, torch.arange(world).repeat_interleave(2).float())
    gloo = dist.new_group(backend="gloo")
    for group in (pg, gloo):  # other backends' functional ops are unaffected by zbccl's kernels
        g = funcol.all_gather_single(torch.full((2,), float(rank)), 0, group).wait()
        assert torch.equal(g, torch.arange(world).repeat_interleave(2).float())
        s = funcol.reduce_scatter_single(torch.arange(2.0 * world), "sum", 0, group).wait()
        assert torch.equal(s, torch.arange(2.0 * world)[2 * rank:2 * rank + 2] * world)
    a = funcol.all_to_all_single(torch.arange(2.0 * world) + 10 * rank, None, None, pg).wait()
    assert torch.equal(a, torch.tensor([10.0 * q + 2 * rank + i for q in range(world) for i in range(2)]))
    # DTensor: shard, redistribute to replicate, partial -> replicate
    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(4.0 * world).reshape(2 * world, 2)
    d = distribute_tensor(full, mesh, [Shard(0)])
    assert torch.equal(d.redistribute(mesh, [Replicate()]).to_local(), full)
    p = DTensor.from_local(torch.full((3,), float(rank)), mesh, [Partial()])
    assert torch.equal(p.redistribute(mesh, [Replicate()]).to_local(), torch.full((3,), float(sum(range(world)))))
    # DistributedDataParallel: its reducer's C++ allreduce reaches the zbccl group
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(2):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(rank * 10 + step))
        opt.zero_grad()
        ddp(x).square().sum().backward()
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(every, flat)
    assert all(torch.equal(every[0], e) for e in every), "DDP replicas diverged"
    with zbccl.heap_scope():
        before = zbccl.memory_stats()["staged_bytes"]
        x = torch.full((1024,), float(rank))
        dist.all_reduce(x)
        assert zbccl.memory_stats()["staged_bytes"] == before
    dist.destroy_process_group()
    print(f"zbccl torchrun ok rank {rank}", flush=True)


if __name__ == "__main__":
    main()
