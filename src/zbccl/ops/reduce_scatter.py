"""reduce_scatter (even and per-rank sizes): rank r reduces slice r of every input.

Heap placement: every rank's *input* must be in the heap (peers read their
slice of it); the output may be private. A private input is staged into a
heap block first (counted in ``staged_bytes``).

Algorithm ``pull``: after ``ARRIVE``, rank r reduces slice r of all N inputs,
in rank order, straight into its output (one read of each slice, one write);
``DONE``. An output that is exactly slice r of this rank's own input is fine:
only rank r reads that slice; any other overlap of output and input is
refused on every rank. The per-rank sizes travel in the size vectors and
are compared exactly. bf16/fp16 accumulate in fp32 and round once.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import ZbcclInvalidUsageError
from ..runtime.communicator import Communicator
from ..runtime.registry import collective
from .allreduce import _show
from .args import index_list, overlap_error, tensor_error
from .channel import ERR_USAGE, Header
from .dtypes import AVG, dtype_code, reduce_op_code
from .entry import open_op
from .fastpath import native_channel
from .operands import Operand
from .plan import OP_REDUCE_SCATTER, choose, nthreads, profiled

__all__ = ["reduce_scatter_tensor", "reduce_scatter_v"]

_RS = "reduce_scatter"


@collective("reduce_scatter_tensor")
def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op="sum", *,
                          comm: Communicator | None = None, timeout: float | None = None) -> torch.Tensor:
    """Collective: ``output`` (``input.numel() / world_size`` elements) gets slice ``rank`` of the
    element-wise reduction of every rank's ``input``. ``op`` as in :func:`all_reduce`.
    ``output`` may be exactly slice ``rank`` of ``input`` (in place); any other overlap is refused.
    ``timeout``: seconds this op may wait (default: the communicator's).
    Blocks the host until no peer reads this rank's ``input`` any more.
    """
    error = tensor_error(output, "output", op=_RS, written=True) or tensor_error(input, "input", op=_RS)
    counts = [0] * comm.world_size if error else [output.numel()] * comm.world_size
    return _run(comm, _RS, output, input, op, counts, 1, error, timeout)


@collective("reduce_scatter_v")
def reduce_scatter_v(output: torch.Tensor, input: torch.Tensor, sizes: list[int], op="sum", *,
                     comm: Communicator | None = None, timeout: float | None = None) -> torch.Tensor:
    """Collective: reduce-scatter with per-rank sizes along dim 0.

    ``input`` is ``[sum(sizes), *rest]`` on every rank; ``output`` is ``[sizes[rank], *rest]``.
    Every rank must pass the same ``sizes`` (integers). Aliasing and ``timeout`` as in
    :func:`reduce_scatter_tensor`.
    """
    op_name = "reduce_scatter_v"
    error = tensor_error(output, "output", op=op_name, written=True) or tensor_error(input, "input", op=op_name)
    rows, size_error = index_list(sizes, "sizes", op=op_name)
    error = error or size_error
    row = int(np.prod(input.shape[1:])) if error is None and input.dim() > 1 else 1
    counts = [0] * comm.world_size if error else [s * row for s in rows]
    return _run(comm, op_name, output, input, op, counts, row, error, timeout)


def _local_error(op: str, output, input, red_op, counts, rank: int, world: int) -> tuple[int, int, str | None]:
    """``(dtype code, reduce op code, error)`` from this rank's arguments alone."""
    try:
        dt = dtype_code(input.dtype, op=op)
        red = reduce_op_code(red_op, input.dtype, op=op)
    except ZbcclInvalidUsageError as exc:
        return 0, 0, str(exc)
    if input.dtype != output.dtype:
        return dt, red, f"{op}: input and output dtypes differ, got {input.dtype} and {output.dtype}"
    if len(counts) != world or min(counts) < 0:
        return dt, red, f"{op}: expected {world} non-negative sizes, got {len(counts)}"
    if input.numel() != sum(counts) or output.numel() != counts[rank]:
        return dt, red, (f"{op}: wrong sizes, expected input {sum(counts)} and output {counts[rank]} elements, "
                         f"got {input.numel()} and {output.numel()}")
    # Supported aliasing: the output is exactly this rank's slice of a contiguous input (only this
    # rank reads that slice, and it reads it before writing each element).
    exact = (input.is_contiguous() and output.is_contiguous()
             and output.data_ptr() == input.data_ptr() + sum(counts[:rank]) * input.element_size())
    return dt, red, overlap_error(output, input, op=op, allowed=exact)


def _run(comm, op: str, output, input, red_op, counts: list[int], row: int, error: str | None,
         timeout) -> torch.Tensor:
    W, me = comm.world_size, comm.rank
    dt = red = 0
    if error is None:
        dt, red, error = _local_error(op, output, input, red_op, counts, me, W)
    with profiled(op, input):
        ch = open_op(comm, OP_REDUCE_SCATTER, error, op=op, timeout=timeout)
        if ch is None:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input.view(output.shape))
            return output
        seq = ch.seq
        try:
            if not _fast(ch, op, output, input, counts, row, dt, red):
                _staged(ch, op, output, input, counts, row, dt, red)
        except BaseException as exc:
            ch.left(seq, exc, op=op)
            raise
    return output


def _fast(ch, op: str, output: torch.Tensor, input: torch.Tensor, counts: list[int], row: int, dt: int,
          red: int) -> bool:
    """The common case in one native call: contiguous tensors, input in the heap."""
    nat = native_channel(ch)
    if nat is None or not (input.is_contiguous() and output.is_contiguous()):
        return False
    isz = input.element_size()
    n_in = input.numel()
    in_off = input.data_ptr() - ch.my_base
    if not n_in or not 0 <= in_off <= ch.my_size - n_in * isz:
        return False
    algo, _ = choose(ch, OP_REDUCE_SCATTER, input.dtype, n_in * isz)
    digest, counts_addr = ch.sizes(counts)
    ch.seq += 1
    rc = nat.reduce_scatter(nat.handle, ch.seq, in_off, output.data_ptr(), counts_addr, n_in, output.numel(),
                            row, digest, isz, dt, red, algo)
    if rc:
        nat.raise_for(rc, op=op, show=_show)
    return True


def _python_path(ch, op: str, src: Operand, out_t, counts, row: int, digest: int, dt: int, red: int, algo: int,
                 error: str | None) -> None:
    W, me, isz = ch.world_size, ch.rank, out_t.element_size()
    hdrs = ch.begin([0, OP_REDUCE_SCATTER, dt, red, src.t.numel(), out_t.numel(), src.offset, -1, algo, 0,
                     row, digest], op=op, vectors=np.asarray(counts, dtype=np.int64), error=error or src.error,
                    kind=src.kind if error is None else ERR_USAGE)
    ch.agree(hdrs, (Header.OP, Header.DTYPE, Header.REDOP, Header.IN_NUMEL, Header.ROW, Header.ALGO), op=op,
             show=_show)
    ch.agree_sizes(W, op=op, row=row)
    srcs = ch.check_span(hdrs, Header.IN_OFF, src.t.numel() * isz, op=op)
    lo = sum(counts[:me]) * isz
    if counts[me]:
        table = np.asarray([s + lo for s in srcs], dtype=np.uint64)
        ch.prims.reduce_n(out_t.data_ptr(), int(table.ctypes.data), W, counts[me], dt, red,
                          float(W) if red == AVG else 1.0, nthreads())
    ch.end(op=op)


def _staged(ch, op: str, output, input, counts: list[int], row: int, dt: int, red: int) -> None:
    """Inputs outside the heap or non-contiguous tensors: stage, then the same protocol."""
    isz = input.element_size()
    src = Operand(ch, input, op=op, role="input", read=True, write=False)
    out_t = output if output.is_contiguous() else torch.empty_like(output, memory_format=torch.contiguous_format)
    try:
        algo, _ = choose(ch, OP_REDUCE_SCATTER, input.dtype, input.numel() * isz)
        digest, counts_addr = ch.sizes(counts)
        nat = native_channel(ch)
        if nat is not None and src.error is None:
            ch.seq += 1
            rc = nat.reduce_scatter(nat.handle, ch.seq, src.offset, out_t.data_ptr(), counts_addr,
                                    input.numel(), output.numel(), row, digest, isz, dt, red, algo)
            if rc:
                nat.raise_for(rc, op=op, show=_show)
        else:
            _python_path(ch, op, src, out_t, counts, row, digest, dt, red, algo, None)
    finally:
        src.finish()
    if out_t is not output:
        output.copy_(out_t)
        ch.ctx.sma.record_staged(output.numel() * isz)
