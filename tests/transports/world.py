"""Set up one transport alone (no ``zbccl.init``) in each rank of a ``run_world`` world."""

from __future__ import annotations

import json
import uuid

import torch

from zbccl.bootstrap.store import StoreBootstrap
from zbccl.bootstrap.topology import HostInfo, Topology, local_host_info
from zbccl.heap import layout, transports

__all__ = ["open_transport", "line", "payload", "DATA"]

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
