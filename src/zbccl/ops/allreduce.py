"""all_reduce: in place, over every rank's heap tensor.

Heap placement: the tensor must be in the heap (peers read it); otherwise it
is staged through a heap block (counted in ``staged_bytes``).

Algorithms (chosen by the tuner, identical on every rank, checked in the
handshake):

* ``oneshot``: after ``ARRIVE``, every rank reduces all N inputs, in rank
  order, into a private scratch buffer; ``DONE`` (nobody reads the inputs any
  more); copy scratch into the tensor. Two rendezvous, reads N·W, writes 2N.
  Best for small messages.
* ``twoshot``: after ``ARRIVE``, rank r reduces slice r of all N inputs
  straight into slice r of its own tensor (only rank r ever reads slice r,
  so writing it in place is safe); ``PHASE``; rank r copies every other
  rank's reduced slice q into its own slice q; ``DONE``. Three rendezvous,
  reads 2N, writes 2N - no scratch at all. Best for large messages.

Bitwise identity across ranks: oneshot reduces in rank order on every rank;
twoshot reduces each slice once and copies it. bf16/fp16 accumulate in fp32
and round once.
"""

from __future__ import annotations

import numpy as np
import torch

from ..runtime.communicator import Communicator
from ..runtime.state import resolve_comm
from .channel import Header, channel_of
from .dtypes import AVG, CODE_DTYPES, dtype_code, op_name, reduce_op_code
from .fastpath import native_channel
from .operands import Operand
from .plan import ALGO_NAMES, ONESHOT, OP_ALL_REDUCE, choose, nthreads, profiled, slices

__all__ = ["all_reduce"]

_OP = "all_reduce"


def _show(field: int, value: int) -> str:
    if field == Header.DTYPE:
        return str(CODE_DTYPES.get(value, value)).removeprefix("torch.")
    if field == Header.REDOP:
        return op_name(value)
    if field == Header.ALGO:
        return ALGO_NAMES.get(value, str(value))
    return str(value)


def all_reduce(tensor: torch.Tensor, op="sum", *, comm: Communicator | None = None) -> torch.Tensor:
    """Collective: reduce ``tensor`` over all ranks, in place; returns ``tensor``.

    ``op``: ``"sum"``, ``"avg"``, ``"max"``, ``"min"``, ``"product"`` or a
    ``torch.distributed.ReduceOp``. dtypes: float32/64, bfloat16, float16 and
    integers (avg: floats only). Blocks the host until every rank finished
    reading this rank's tensor. Every rank gets bitwise identical results.
    """
    comm = resolve_comm(comm)
    with profiled(_OP, tensor):
        dt = dtype_code(tensor.dtype, op=_OP)
        red = reduce_op_code(op, tensor.dtype, op=_OP)
        if comm.world_size == 1:
            return tensor
        ch = channel_of(comm)
        count = tensor.numel()
        itemsize = tensor.element_size()
        nbytes = count * itemsize
        algo = choose(ch, OP_ALL_REDUCE, tensor.dtype, nbytes)
        if nbytes and tensor.is_contiguous():
            addr = tensor.data_ptr()
            off = addr - ch.my_base
            nat = native_channel(ch)
            if nat is not None and 0 <= off and off + nbytes <= ch.my_size:
                # Zero-copy fast path: the whole protocol in one native call.
                ch.seq += 1
                rc = nat.all_reduce(nat.handle, ch.seq, addr, off, count, itemsize, dt, red, algo)
                if rc:
                    nat.raise_for(rc, op=_OP, show=_show)
                return tensor
        _generic(ch, tensor, dt, red, algo, count, nbytes)
        return tensor


def _generic(ch, tensor: torch.Tensor, dt: int, red: int, algo: int, count: int, nbytes: int) -> None:
    """The Python path: staging, local errors, empty tensors; same protocol as the native one."""
    operand = Operand(ch, tensor, op=_OP, role="tensor", read=True, write=True)
    try:
        hdrs = ch.begin([0, OP_ALL_REDUCE, dt, red, count, count, operand.offset, -1, algo], op=_OP,
                        error=operand.error)
        ch.agree(hdrs, (Header.OP, Header.DTYPE, Header.REDOP, Header.IN_NUMEL, Header.ALGO), op=_OP,
                 show=_show)
        if nbytes:
            srcs = ch.check_span(hdrs, Header.IN_OFF, nbytes, op=_OP)
            (_oneshot if algo == ONESHOT else _twoshot)(ch, operand.addr, srcs, count, tensor.element_size(),
                                                        dt, red)
        else:
            ch.end(op=_OP)
    finally:
        operand.finish()


def _oneshot(ch, dst: int, srcs: list[int], count: int, itemsize: int, dt: int, red: int) -> None:
    prims, W = ch.prims, ch.world_size
    table = np.asarray(srcs, dtype=np.uint64)
    scratch = ch.scratch(count * itemsize)
    prims.reduce_n(scratch, int(table.ctypes.data), W, count, dt, red, float(W) if red == AVG else 1.0,
                   nthreads())
    ch.end(op=_OP)
    prims.copy(dst, scratch, count * itemsize, nthreads())


def _twoshot(ch, dst: int, srcs: list[int], count: int, itemsize: int, dt: int, red: int) -> None:
    prims, W, me = ch.prims, ch.world_size, ch.rank
    parts = slices(count, W, itemsize)
    lo, hi = parts[me]
    if hi > lo:
        table = np.asarray([s + lo * itemsize for s in srcs], dtype=np.uint64)
        prims.reduce_n(dst + lo * itemsize, int(table.ctypes.data), W, hi - lo, dt, red,
                       float(W) if red == AVG else 1.0, nthreads())
    ch.phase(op=_OP)
    copies = [(dst + a * itemsize, srcs[q] + a * itemsize, (b - a) * itemsize)
              for q, (a, b) in enumerate(parts) if q != me and b > a]
    if copies:
        table = np.asarray(copies, dtype=np.int64)
        prims.copy_many(int(table.ctypes.data), len(copies), nthreads())
    ch.end(op=_OP)
