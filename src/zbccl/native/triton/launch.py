"""Launchers: one function per kernel, over int64 pointer tables, offsets and plain tensors.

No zbccl runtime knowledge here (the ops layer validates and plans; see ``ops/device.py``). Every
launcher enqueues one kernel on the current stream (on CUDA) and returns at once; under
``TRITON_INTERPRET=1`` the kernel runs to completion on the calling thread.

Common arguments: ``data``/``pads``: int64 tensors ``[world]`` on the kernels' device, each rank's data
base and kernel-area base (``Transport.pointer_tables``); ``slot_off``: this communicator's kernel slot
inside the kernel area; ``me``: this rank's index in the tables; ``timeout_ns``: the bound of every wait;
``check``: the argument-row fields the ranks must agree on (bit i: ``geometry.A_FIELDS[i]``); ``grid``,
``block`` (elements per tile), ``num_warps``: the launch shape (the ops layer's plan; every rank must
pass the same, which the kernels check).
"""

from __future__ import annotations

import torch

from . import geometry as g
from . import kernels as k
from .prims import INTERPRET

__all__ = ["INTERPRET", "barrier", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"]

_KW = g.KMAX_WORLD
#: itemsize -> the dtype code (``native/abi.py``) of the unsigned word the copies move.
_RAW = {1: 5, 2: 6, 4: 7, 8: 8}
_SIZES = {0: 4, 1: 2, 2: 2, 3: 8, 4: 1, 5: 1, 6: 2, 7: 4, 8: 8, 9: 1}


def _dummy(pads: torch.Tensor) -> torch.Tensor:
    return pads  # an int64 tensor on the right device, for kernels that take no splits


def barrier(data: torch.Tensor, pads: torch.Tensor, *, slot_off: int, me: int, world: int, timeout_ns: int,
            op: int = g.KOP["BARRIER"], check: int = 0) -> None:
    """Entry handshake of every rank (``op`` ERROR: this rank's call failed validation; it takes part in
    the handshake so that the peers hear of it)."""
    k.barrier_kernel[(1,)](pads, _dummy(pads), slot_off, me, world, op, check, timeout_ns, KW=_KW, num_warps=1)


def all_reduce(data: torch.Tensor, pads: torch.Tensor, *, slot_off: int, me: int, world: int, in_off: int,
               out_addr: int, out_off: int, numel: int, dtype: int, red: int, two_shot: bool, inplace: bool,
               check: int, timeout_ns: int, grid: int, block: int, num_warps: int) -> None:
    k.all_reduce_kernel[(grid,)](data, pads, _dummy(pads), slot_off, me, world, in_off, out_addr, out_off, numel,
                                 check, timeout_ns, DT=dtype, ESZ=_SIZES[dtype], RED=red, TWO_SHOT=bool(two_shot),
                                 INPLACE=bool(inplace), BLOCK=block, KW=_KW, INTERP=INTERPRET,
                                 num_warps=num_warps)


def all_gather(data: torch.Tensor, pads: torch.Tensor, splits: torch.Tensor | None, *, slot_off: int, me: int,
               world: int, in_off: int, out_addr: int, dtype: int, itemsize: int, outer: int, inner: int, cnt: int,
               total: int, skip_self: bool, check: int, timeout_ns: int, grid: int, block: int,
               num_warps: int) -> None:
    """``splits``: None (every rank gives ``cnt``) or int64 ``[KMAX_WORLD]`` every rank's size along dim."""
    k.all_gather_kernel[(grid,)](data, pads, _dummy(pads) if splits is None else splits, slot_off, me, world,
                                 in_off, out_addr, dtype, outer, inner, cnt, total, check, timeout_ns,
                                 CDT=_RAW[itemsize], ESZ=itemsize, VAR=splits is not None, ROWS=outer > 1,
                                 SKIP_SELF=bool(skip_self), BLOCK=block, KW=_KW, INTERP=INTERPRET,
                                 num_warps=num_warps)


def reduce_scatter(data: torch.Tensor, pads: torch.Tensor, splits: torch.Tensor | None, *, slot_off: int, me: int,
                   world: int, in_off: int, out_addr: int, dtype: int, red: int, outer: int, inner: int, cnt: int,
                   total: int, check: int, timeout_ns: int, grid: int, block: int, num_warps: int) -> None:
    """``splits``: None (every rank's part is ``cnt``) or int64 ``[KMAX_WORLD]`` every rank's size along dim."""
    k.reduce_scatter_kernel[(grid,)](data, pads, _dummy(pads) if splits is None else splits, slot_off, me, world,
                                     in_off, out_addr, outer, inner, cnt, total, check, timeout_ns, DT=dtype,
                                     ESZ=_SIZES[dtype], RED=red, VAR=splits is not None, ROWS=outer > 1, BLOCK=block, KW=_KW,
                                     INTERP=INTERPRET, num_warps=num_warps)


def all_to_all(data: torch.Tensor, pads: torch.Tensor, splits: torch.Tensor | None, *, slot_off: int, me: int,
               world: int, in_off: int, out_addr: int, dtype: int, itemsize: int, inner: int, cnt: int, numel: int,
               check: int, timeout_ns: int, grid: int, block: int, num_warps: int) -> None:
    """Rows of ``inner`` elements. ``splits``: None (``cnt`` rows to and from every rank) or int64
    ``[2 * KMAX_WORLD]``: this rank's in_splits, then its out_splits."""
    k.all_to_all_kernel[(grid,)](data, pads, _dummy(pads) if splits is None else splits, slot_off, me, world, in_off,
                                 out_addr, dtype, inner, cnt, numel, check, timeout_ns, CDT=_RAW[itemsize],
                                 ESZ=itemsize, VAR=splits is not None, BLOCK=block, KW=_KW, INTERP=INTERPRET,
                                 num_warps=num_warps)


def broadcast(data: torch.Tensor, pads: torch.Tensor, *, slot_off: int, me: int, world: int, in_off: int,
              out_addr: int, dtype: int, itemsize: int, root: int, numel: int, check: int, timeout_ns: int,
              grid: int, block: int, num_warps: int) -> None:
    k.broadcast_kernel[(grid,)](data, pads, _dummy(pads), slot_off, me, world, in_off, out_addr, dtype, root, numel,
                                check, timeout_ns, CDT=_RAW[itemsize], ESZ=itemsize, BLOCK=block, KW=_KW,
                                INTERP=INTERPRET, num_warps=num_warps)
