"""Shared pieces of the Triton kernel tests (``test_triton_*.py``): payloads, the DeviceOps of a rank.

The kernels run under the Triton interpreter in the spawned ranks (``ENV`` is set there before
triton is first imported, never in the pytest process), over the real shm heap: their loads, stores
and atomics go to the peers' mapped segments.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

__all__ = ["ENV", "FLOATS", "INTS", "DTYPES", "needs_triton", "payload", "device_ops"]

ENV = {"TRITON_INTERPRET": "1"}
FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
INTS = [torch.int32, torch.int64, torch.int8, torch.uint8, torch.int16]
DTYPES = FLOATS + INTS + [torch.bool]

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed (pip install zbccl[cuda])")


def payload(rank: int, n: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """f(rank, index): distinct per source rank and position (and per ``salt``, for repeated calls)."""
    i = torch.arange(n, dtype=torch.float64)
    if dtype.is_floating_point:
        return (torch.sin(i * 0.37 + rank * 1.3 + salt * 0.11) * 50 + rank).to(dtype)
    if dtype == torch.bool:
        return (i.long() + rank + salt) % 3 == 0
    hi = 100 if dtype in (torch.int8, torch.uint8) else 10_000
    return ((i.long() * 7 + rank * 13 + salt * 5 + 1) % hi).to(dtype)


def device_ops(ctx, *, timeout_s: float = 30.0, heap_size: str = "32M"):
    """``(comm, DeviceOps)`` of this rank over the world's shm heap."""
    from zbccl.ops.device import DeviceOps

    comm = ctx.init(heap_size=heap_size)
    dev = DeviceOps(comm.rank, comm.ranks, comm._ctx.heap.transport, slot=comm.slot, timeout_s=timeout_s,
                    barrier=comm.barrier)
    return comm, dev
