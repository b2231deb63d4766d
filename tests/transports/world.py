"""Set up one transport alone (no ``zbccl.init``) in each rank of a ``run_world`` world."""

from __future__ import annotations

import json
import uuid

import torch

from zbccl.bootstrap.store import StoreBootstrap
from zbccl.bootstrap.topology import HostInfo, Topology, local_host_info
from zbccl.heap import layout, transports

__all__ = ["open_transport", "line", "payload", "grow_during_op", "DATA"]

#: Each rank's initial data segment in the suite.
DATA = 64 << 10


def line(k: int) -> int:
    """Pad byte offset of signal line ``k`` of the suite (comm slot 1's lines: clear of the header)."""
    return layout.slot_line(1, k)


def payload(rank: int, n: int, salt: int = 0) -> torch.Tensor:
    """``n`` int64 values that name their source: rank, index and ``salt`` (an iteration)."""
    return torch.arange(n, dtype=torch.int64) + rank * 1_000_000 + salt * 1_000_000_000


def open_transport(ctx, name: str, *, data: int = DATA, reserve: int | None = None, timeout: float = 60.0):
    """``(transport, bootstrap)``: transport ``name`` established over every rank of ``ctx``'s world."""
    boot = StoreBootstrap(ctx.store(), ctx.rank, ctx.world_size, prefix=f"conformance/{name}")
    me = {"host": local_host_info().to_dict(), "job": uuid.uuid4().hex[:12]}
    got = [json.loads(b) for b in boot.all_gather(json.dumps(me).encode(), timeout=timeout, tag="hello")]
    topo = Topology(ctx.rank, tuple(HostInfo.from_dict(g["host"]) for g in got))
    device = next(e.device for e in transports.entries() if e.name == name)
    t = transports.resolve(name)(device=device if device != "any" else "cpu")
    W = ctx.world_size
    t.establish(boot, topo, data_bytes=[data] * W, reserve_bytes=[reserve or data] * W, job_id=got[0]["job"],
                timeout=timeout)
    return t, boot


def grow_during_op(ctx, name: str, *, data: int, grow_to: int, offset: int, n: int = 4096, unmap: bool = True) -> str:
    """Rank 0 enters a one-shot all_reduce (``DeviceOps`` directly: no lane, so its main thread maps nothing) over
    ``name``'s heap; meanwhile rank 1 grows its heap to ``grow_to`` bytes and passes the kernel a tensor at
    ``offset``, in the new chunks. The result is exact only if rank 0 had mapped them before rank 1's ``grow``
    returned (the cuda transport's growth handshake). Each rank's payload names it (float64, exact). ``unmap``:
    ``close``'s (the GPU tests keep their mappings to the process's end)."""
    from zbccl.ops.device import DeviceOps

    t, boot = open_transport(ctx, name, data=data, reserve=max(4 * grow_to, data))
    me, W = ctx.rank, ctx.world_size
    try:
        dev = DeviceOps(me, range(W), t, slot=0, timeout_s=60, barrier=lambda: boot.barrier(timeout=60))
        vals = [payload(r, n).to(torch.float64) for r in range(W)]
        if me == 0:
            x = t.view(me, 0, (n,), torch.float64)
            x.copy_(vals[0].to(x.device))
            ctx.store().set("entering", b"1")  # (the interpreter runs the kernel to its end inside the call)
            dev.all_reduce(x, "sum", algo="one_shot")
        else:
            ctx.store().wait(["entering"])
            t.grow(grow_to)
            x = t.view(me, offset, (n,), torch.float64)
            x.copy_(vals[me].to(x.device))
            dev.all_reduce(x, "sum", algo="one_shot")
        if x.is_cuda:
            torch.cuda.synchronize()
        dev.check()
        assert torch.equal(x.cpu(), sum(vals[1:], vals[0])), x[:4]
        boot.barrier(timeout=60)
        return "ok"
    finally:
        t.close(unmap=unmap)
