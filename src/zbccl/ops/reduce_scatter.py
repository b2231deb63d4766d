"""reduce_scatter (even and per-rank sizes): rank r reduces slice r of every input.

Heap placement: every rank's *input* must be in the heap (peers read their
slice of it); the output may be private. A private input is staged into a
heap block first (counted in ``staged_bytes``).

Algorithm ``pull``: after ``ARRIVE``, rank r reduces slice r of all N inputs,
in rank order, straight into its output (one read of each slice, one write);
``DONE``. An output that aliases slice r of this rank's own input is fine:
only rank r reads that slice. bf16/fp16 accumulate in fp32 and round once.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import ZbcclInvalidUsageError
from ..runtime.communicator import Communicator
from ..runtime.registry import collective
from ..runtime.state import resolve_comm
from .allreduce import _show
from .channel import Header, channel_of
from .dtypes import AVG, DTYPE_CODES, dtype_code, reduce_op_code
from .fastpath import native_channel
from .operands import Operand
from .plan import OP_REDUCE_SCATTER, choose, nthreads, profiled

__all__ = ["reduce_scatter_tensor", "reduce_scatter_v"]


@collective("reduce_scatter_tensor")
def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op="sum", *,
                          comm: Communicator | None = None) -> torch.Tensor:
    """Collective: ``output`` (``input.numel() / world_size`` elements) gets slice ``rank`` of the
    element-wise reduction of every rank's ``input``. ``op`` as in :func:`all_reduce`.
    Blocks the host until no peer reads this rank's ``input`` any more.
    """
    comm = resolve_comm(comm)
    with profiled("reduce_scatter", input):
        W = comm.world_size
        n = output.numel()
        if W > 1 and _fast(comm, output, input, op, n, W):
            return output
        return _run(comm, "reduce_scatter", output, input, op, [n] * W, 1)


def _fast(comm, output: torch.Tensor, input: torch.Tensor, red_op, n: int, W: int) -> bool:
    """The common case in one native call: contiguous tensors, input in the heap, sizes consistent.

    Anything else (and any error) goes to :func:`_run`, which checks and reports it.
    """
    if n == 0 or output.dtype != input.dtype or input.numel() != n * W:
        return False
    if not (input.is_contiguous() and output.is_contiguous()):
        return False
    dt = DTYPE_CODES.get(input.dtype)
    ch = channel_of(comm)
    nat = native_channel(ch)
    if nat is None or dt is None:
        return False
    isz = input.element_size()
    in_off = input.data_ptr() - ch.my_base
    if not 0 <= in_off <= ch.my_size - n * W * isz:
        return False
    try:
        red = reduce_op_code(red_op, input.dtype, op="reduce_scatter")
    except ZbcclInvalidUsageError:
        return False  # _run reports it on every rank
    algo, _ = choose(ch, OP_REDUCE_SCATTER, input.dtype, n * W * isz)
    digest, counts_addr = ch.sizes([n] * W)
    ch.seq += 1
    rc = nat.reduce_scatter(nat.handle, ch.seq, in_off, output.data_ptr(), counts_addr, n * W, n, 1, digest, isz,
                            dt, red, algo)
    if rc:
        nat.raise_for(rc, op="reduce_scatter", show=_show)
    return True


@collective("reduce_scatter_v")
def reduce_scatter_v(output: torch.Tensor, input: torch.Tensor, sizes: list[int], op="sum", *,
                     comm: Communicator | None = None) -> torch.Tensor:
    """Collective: reduce-scatter with per-rank sizes along dim 0.

    ``input`` is ``[sum(sizes), *rest]`` on every rank; ``output`` is ``[sizes[rank], *rest]``.
    Every rank must pass the same ``sizes``.
    """
    comm = resolve_comm(comm)
    with profiled("reduce_scatter_v", input):
        row = int(np.prod(input.shape[1:])) if input.dim() > 1 else 1
        return _run(comm, "reduce_scatter_v", output, input, op, [int(s) * row for s in sizes], row)


def _local_error(op: str, output, input, counts, rank: int, world: int) -> str | None:
    if input.dtype != output.dtype:
        return f"{op}: input and output dtypes differ, got {input.dtype} and {output.dtype}"
    if len(counts) != world or min(counts) < 0:
        return f"{op}: expected {world} non-negative sizes, got {len(counts)}"
    if input.numel() != sum(counts) or output.numel() != counts[rank]:
        return (f"{op}: wrong sizes, expected input {sum(counts)} and output {counts[rank]} elements, "
                f"got {input.numel()} and {output.numel()}")
    return None


def _python_path(ch, op: str, src: Operand, out_t, counts, row: int, digest: int, dt: int, red: int, algo: int,
                 error: str | None) -> None:
    W, me, isz = ch.world_size, ch.rank, out_t.element_size()
    hdrs = ch.begin([0, OP_REDUCE_SCATTER, dt, red, src.t.numel(), out_t.numel(), src.offset, -1, algo, 0,
                     row, digest], op=op, error=error or src.error)
    ch.agree(hdrs, (Header.OP, Header.DTYPE, Header.REDOP, Header.IN_NUMEL, Header.ROW, Header.DIGEST,
                    Header.ALGO), op=op, show=_show)
    srcs = ch.check_span(hdrs, Header.IN_OFF, src.t.numel() * isz, op=op)
    lo = sum(counts[:me]) * isz
    if counts[me]:
        table = np.asarray([s + lo for s in srcs], dtype=np.uint64)
        ch.prims.reduce_n(out_t.data_ptr(), int(table.ctypes.data), W, counts[me], dt, red,
                          float(W) if red == AVG else 1.0, nthreads())
    ch.end(op=op)


def _run(comm, op: str, output, input, red_op, counts: list[int], row: int) -> torch.Tensor:
    W, me = comm.world_size, comm.rank
    try:
        dt = dtype_code(input.dtype, op=op)
        red = reduce_op_code(red_op, input.dtype, op=op)
    except ZbcclInvalidUsageError as exc:
        if W == 1:
            raise
        channel_of(comm).fail_together(OP_REDUCE_SCATTER, str(exc), op=op)
    error = _local_error(op, output, input, counts, me, W)
    if W == 1 and error is None:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input.view(output.shape))
        return output
    ch = channel_of(comm)
    isz = input.element_size()
    src = Operand(ch, input, op=op, role="input", read=True, write=False)
    out_t = output if output.is_contiguous() else torch.empty_like(output, memory_format=torch.contiguous_format)
    try:
        algo, _ = choose(ch, OP_REDUCE_SCATTER, input.dtype, input.numel() * isz)
        digest, counts_addr = ch.sizes(counts)
        nat = native_channel(ch)
        if nat is not None and (error or src.error) is None:
            ch.seq += 1
            rc = nat.reduce_scatter(nat.handle, ch.seq, src.offset, out_t.data_ptr(), counts_addr,
                                    input.numel(), output.numel(), row, digest, isz, dt, red, algo)
            if rc:
                nat.raise_for(rc, op=op, show=_show)
        else:
            _python_path(ch, op, src, out_t, counts, row, digest, dt, red, algo, error)
    finally:
        src.finish()
    if out_t is not output:
        output.copy_(out_t)
        ch.ctx.sma.record_staged(output.numel() * isz)
    return output
