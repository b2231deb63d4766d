"""all_reduce: in place, over every rank's heap tensor.

Heap placement: the tensor must be in the heap (peers read it); otherwise it
is staged through a heap block (counted in ``staged_bytes``).

Algorithms (chosen by the tuner, identical on every rank, checked in the
handshake):

* ``oneshot``: after ``ARRIVE``, every rank reduces all N inputs, in rank
  order, into a private scratch buffer; ``DONE`` (nobody reads the inputs any
  more); copy scratch into the tensor. Two rendezvous, reads N·W, writes 2N.
  Best for small messages.
* ``twoshot``: the tensor is cut into chunks (the tuner's chunk size). For
  chunk k, rank r reduces slice r of the chunk from all N inputs straight
  into slice r of its own tensor (only rank r ever reads slice r, so writing
  it in place is safe) and signals ``PHASE = base + k+1``; once every
  peer signalled chunk k, rank r copies their reduced slices of chunk k into
  its own tensor. The native path gathers chunk k-1 while chunk k is being
  reduced elsewhere, so freshly reduced lines are read from cache. ``DONE``
  ends the op. No scratch at all. Best for large messages.

Heap tensors take the native fast path: the whole op is one C call
(``native/csrc/chan_ops.c``) running this same protocol. Its large twoshot
gathers write with cached or streaming stores, chosen per rank by measuring
both (``fastpath.StoreKind``; the protocol is the same either way).

Bitwise identity across ranks: oneshot reduces in rank order on every rank;
twoshot reduces each slice once and copies it. bf16/fp16 accumulate in fp32
and round once.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ..errors import ZbcclInvalidUsageError
from ..runtime.communicator import Communicator
from ..runtime.registry import collective
from .args import tensor_error
from .channel import ERR_NOMEM, Header
from .dtypes import AVG, CODE_DTYPES, dtype_code, op_name, reduce_op_code
from .entry import open_op
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


@collective("all_reduce")
def all_reduce(tensor: torch.Tensor, op="sum", *, comm: Communicator | None = None,
               timeout: float | None = None) -> torch.Tensor:
    """Collective: reduce ``tensor`` over all ranks, in place; returns ``tensor``.

    ``tensor``: any shape, a CPU tensor. ``op``: ``"sum"``, ``"avg"``, ``"max"``, ``"min"``,
    ``"product"`` or a ``torch.distributed.ReduceOp``. dtypes: float32/64, bfloat16, float16 and
    integers (avg: floats only). ``timeout``: seconds this op may wait (default: the
    communicator's). Blocks the host until every rank finished reading this rank's tensor.
    Every rank gets bitwise identical results.
    """
    error = tensor_error(tensor, "tensor", op=_OP, written=True)
    dt = red = 0
    if error is None:
        try:
            dt = dtype_code(tensor.dtype, op=_OP)
            red = reduce_op_code(op, tensor.dtype, op=_OP)
        except ZbcclInvalidUsageError as exc:
            error = str(exc)
    with profiled(_OP, tensor):
        ch = open_op(comm, OP_ALL_REDUCE, error, op=_OP, timeout=timeout)
        if ch is not None:
            seq = ch.seq
            try:
                _run(ch, tensor, dt, red)
            except BaseException as exc:
                ch.left(seq, exc, op=_OP)
                raise
    return tensor


def _run(ch, tensor: torch.Tensor, dt: int, red: int) -> None:
    count = tensor.numel()
    itemsize = tensor.element_size()
    nbytes = count * itemsize
    algo, chunk = choose(ch, OP_ALL_REDUCE, tensor.dtype, nbytes)
    chunk_elems = max(1, chunk // itemsize)
    nat = native_channel(ch)
    if nat is not None and nbytes and tensor.is_contiguous():
        addr = tensor.data_ptr()
        off = addr - ch.my_base
        if 0 <= off and off + nbytes <= ch.my_size:
            # Zero-copy fast path: the whole protocol in one native call.
            ch.seq += 1
            timed = nbytes >= nat.stores.MIN_BYTES
            if timed:
                nat.stores.before(nbytes)
            t0 = time.perf_counter_ns() if timed else 0
            rc = nat.all_reduce(nat.handle, ch.seq, addr, off, count, itemsize, dt, red, algo, chunk_elems)
            if rc:
                nat.raise_for(rc, op=_OP, show=_show)
            if timed:
                nat.stores.after(nbytes, time.perf_counter_ns() - t0)
            return
    operand = Operand(ch, tensor, op=_OP, role="tensor", read=True, write=True)
    try:
        if nat is not None and nbytes and operand.error is None:
            ch.seq += 1
            rc = nat.all_reduce(nat.handle, ch.seq, operand.addr, operand.offset, count, itemsize, dt, red,
                                algo, chunk_elems)
            if rc:
                nat.raise_for(rc, op=_OP, show=_show)
        else:
            _python_path(ch, operand, count, itemsize, dt, red, algo, chunk_elems)
    finally:
        operand.finish()


def _python_path(ch, operand: Operand, count: int, itemsize: int, dt: int, red: int, algo: int,
                 chunk: int) -> None:
    """The same protocol in Python: errors, empty tensors, and machines without the native core."""
    error, kind, scratch = operand.error, operand.kind, 0
    if algo == ONESHOT and count and error is None:
        try:  # before ARRIVE: a rank that cannot get its scratch fails the group with the reason
            scratch = ch.scratch(count * itemsize)
        except (RuntimeError, MemoryError) as exc:
            error, kind = f"{_OP}: cannot allocate {count * itemsize} bytes of scratch memory for oneshot: {exc}", \
                ERR_NOMEM
    hdrs = ch.begin([0, OP_ALL_REDUCE, dt, red, count, count, operand.offset, -1, algo, 0, 0, 0, 0, chunk],
                    op=_OP, error=error, kind=kind)
    ch.agree(hdrs, (Header.OP, Header.DTYPE, Header.REDOP, Header.IN_NUMEL, Header.ALGO, Header.AUX), op=_OP,
             show=_show)
    if count == 0:
        ch.end(op=_OP)
        return
    srcs = ch.check_span(hdrs, Header.IN_OFF, count * itemsize, op=_OP)
    divisor = float(ch.world_size) if red == AVG else 1.0
    table = np.asarray(srcs, dtype=np.uint64)
    if algo == ONESHOT:
        ch.prims.reduce_n(scratch, int(table.ctypes.data), ch.world_size, count, dt, red, divisor, nthreads())
        ch.end(op=_OP)
        ch.prims.copy(operand.addr, scratch, count * itemsize, nthreads())
        return
    # twoshot, chunk by chunk (the native path pipelines the same steps one chunk apart)
    W, me, dst = ch.world_size, ch.rank, operand.addr
    for k, lo in enumerate(range(0, count, chunk)):
        parts = [(lo + a, lo + b) for a, b in slices(min(chunk, count - lo), W, itemsize)]
        a, b = parts[me]
        if b > a:
            part = np.asarray([s + a * itemsize for s in srcs], dtype=np.uint64)
            ch.prims.reduce_n(dst + a * itemsize, int(part.ctypes.data), W, b - a, dt, red, divisor, nthreads())
        ch.phase(k + 1, op=_OP)
        rows = [(dst + a * itemsize, srcs[q] + a * itemsize, (b - a) * itemsize)
                for q, (a, b) in enumerate(parts) if q != me and b > a]
        if rows:
            t = np.asarray(rows, dtype=np.int64)
            ch.prims.copy_many(int(t.ctypes.data), len(rows), nthreads())
    ch.end(op=_OP)
