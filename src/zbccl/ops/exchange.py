"""all_gather (even and per-rank sizes) and all_to_all_single: block exchanges.

Both ops move one block from every rank q to every rank r: all_gather sends
q's whole input to row offset ``disp[q]`` of every output; all_to_all sends
rows ``in_disp_q[r]..`` of q's input to rows ``out_disp_r[q]..`` of r's output.

Heap placement and algorithms (decided after ``ARRIVE`` from every rank's
header, so all ranks decide alike):

* ``pull`` (preferred): every input is in the heap; rank r copies each
  peer's block into its own output. Writes stay local (lines other cores do
  not hold), and the output may be private memory.
* ``push``: every output is in the heap; rank q copies its input blocks into
  the peers' outputs. Used when inputs are private but outputs are in the heap.
* neither: ranks whose input is private stage it into a heap block (counted
  in ``staged_bytes``), publish the offset, ``PHASE``, then ``pull``.

The tuner may prefer ``push`` when both are possible. ``DONE`` ends the op:
for pull it means nobody reads my input any more; for push, that my output
is complete.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import ZbcclInvalidUsageError, ZbcclOutOfMemoryError
from ..runtime.communicator import Communicator
from ..runtime.registry import collective
from .allreduce import _show
from .args import check_exchange, even_gather_code, index_list, splits, tensor_error
from .channel import Header, OpChannel
from .dtypes import DTYPE_CODES
from .entry import open_op
from .fastpath import RC_FALLBACK, native_channel
from .operands import is_strict
from .plan import OP_ALL_GATHER, OP_ALL_TO_ALL, PUSH, choose, nthreads, profiled

__all__ = ["all_gather_into_tensor", "all_gather_v", "all_to_all_single"]


def _row_elems(t: torch.Tensor) -> int:
    return int(np.prod(t.shape[1:])) if t.dim() > 1 else 1


@collective("all_gather_into_tensor")
def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, *, comm: Communicator | None = None,
                           timeout: float | None = None) -> torch.Tensor:
    """Collective: ``output`` (``world_size * input.numel()`` elements) gets every rank's ``input``
    in rank order. Pull-based when inputs are heap tensors (the output may be private); an
    ``input`` that is exactly this rank's slice of a contiguous ``output`` costs no copy for that
    slice; any other overlap of the two is refused on every rank. ``timeout``: seconds this op may
    wait (default: the communicator's). Blocks the host until the op is complete on this rank and
    no peer reads ``input`` any more.
    """
    W = comm.world_size
    dt = even_gather_code(output, input, W, comm.rank)
    if dt is not None:  # the common case, already checked
        return _start(comm, "all_gather", output, input, [input.numel()] * W, None, 1, None, timeout, dt=dt)
    error = tensor_error(output, "output", op="all_gather", written=True) or tensor_error(input, "input", op="all_gather")
    counts = [0] * W if error else [input.numel()] * W
    return _start(comm, "all_gather", output, input, counts, None, 1, error, timeout)


def _start(comm, op: str, output, input, counts, out_counts, row: int, error: str | None, timeout, *,
           dt: int | None = None) -> torch.Tensor:
    """Check locally (unless ``dt`` says the caller did), fail together or run: the one-call native
    path if it fits, else :func:`_run`."""
    W = comm.world_size
    if dt is None:
        dt = 0
        if error is None:
            dt, error = check_exchange(op, output, input, counts, out_counts, W, comm.rank)
    with profiled(op, input):
        ch = open_op(comm, OP_ALL_GATHER if out_counts is None else OP_ALL_TO_ALL, error, op=op, timeout=timeout)
        if ch is None:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input.reshape(output.shape))
            return output
        seq = ch.seq
        try:
            if out_counts is None:
                done = op == "all_gather" and _fast_all_gather(ch, output, input, input.numel(), W)
            else:
                done = _fast_all_to_all(ch, output, input, counts, out_counts, row)
            if not done:
                _run(ch, op, output, input, counts, out_counts, dt, row=row)
        except BaseException as exc:
            ch.left(seq, exc, op=op)
            raise
    return output


def _heap_offsets(ch: OpChannel, input: torch.Tensor, output: torch.Tensor, in_bytes: int,
                  out_bytes: int) -> tuple[int, int, int, int] | None:
    """``(in_addr, out_addr, in_offset, out_offset)`` for the one-call paths: None unless the
    input lies in this rank's heap; ``out_offset`` is -1 for an output outside it."""
    in_addr, out_addr = input.data_ptr(), output.data_ptr()
    in_off, out_off = in_addr - ch.my_base, out_addr - ch.my_base
    if not 0 <= in_off <= ch.my_size - in_bytes:
        return None
    if not 0 <= out_off <= ch.my_size - out_bytes:
        out_off = -1
    return in_addr, out_addr, in_off, out_off


def _fast_all_gather(ch: OpChannel, output: torch.Tensor, input: torch.Tensor, n: int, W: int) -> bool:
    """The common case in one native call: contiguous tensors, input in the heap (arguments checked)."""
    if n == 0 or not (input.is_contiguous() and output.is_contiguous()):
        return False
    nat = native_channel(ch)
    dt = DTYPE_CODES.get(input.dtype)
    if nat is None or dt is None:
        return False
    isz = input.element_size()
    offs = _heap_offsets(ch, input, output, n * isz, n * W * isz)
    if offs is None:
        return False
    in_addr, out_addr, in_off, out_off = offs
    algo, _ = choose(ch, OP_ALL_GATHER, input.dtype, n * W * isz)
    digest, counts_addr = ch.sizes([n] * W)
    ch.seq += 1
    rc = nat.all_gather(nat.handle, ch.seq, in_addr, in_off, out_addr, out_off, counts_addr, n, n * W, 1, digest,
                        isz, dt, algo)
    if rc == RC_FALLBACK:  # a peer's input is private and outputs are not all in the heap
        _finish_in_python(ch, nat.headers(), [n] * W, None, isz, algo, input, in_off, output, op="all_gather")
    elif rc:
        nat.raise_for(rc, op="all_gather", show=_show)
    return True


@collective("all_gather_v")
def all_gather_v(output: torch.Tensor, input: torch.Tensor, sizes: list[int], *,
                 comm: Communicator | None = None, timeout: float | None = None) -> torch.Tensor:
    """Collective: all-gather with per-rank sizes along dim 0.

    ``sizes[r]`` rows come from rank r; ``input`` is ``[sizes[rank], *rest]`` and ``output`` is
    ``[sum(sizes), *rest]``. Every rank must pass the same ``sizes`` (integers). Aliasing and
    ``timeout`` as in :func:`all_gather_into_tensor`.
    """
    op = "all_gather_v"
    error = tensor_error(output, "output", op=op, written=True) or tensor_error(input, "input", op=op)
    rows, size_error = index_list(sizes, "sizes", op=op)
    error = error or size_error
    row = _row_elems(output) if error is None else 1
    counts = [0] * comm.world_size if error else [s * row for s in rows]
    return _start(comm, op, output, input, counts, None, row, error, timeout)


@collective("all_to_all_single")
def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes=None,
                      input_split_sizes=None, *, comm: Communicator | None = None,
                      timeout: float | None = None) -> torch.Tensor:
    """Collective: rank q's rows ``input_split_sizes[r]`` go to rank r, landing at rank r's rows
    ``output_split_sizes[q]``. ``None`` splits mean equal splits of dim 0. Every pair must agree
    (q's input split for r equals r's output split for q), or every rank raises. ``output`` and
    ``input`` must not overlap (no in-place form). ``timeout``: seconds this op may wait.
    """
    W, op = comm.world_size, "all_to_all"
    error = tensor_error(output, "output", op=op, written=True) or tensor_error(input, "input", op=op)
    ins = outs = [0] * W
    row = 1
    if error is None:
        row = _row_elems(input)
        in_rows, error = splits(input, input_split_sizes, W, "input_split_sizes", op=op)
        out_rows, out_error = splits(output, output_split_sizes, W, "output_split_sizes", op=op)
        error = error or out_error
        if error is None:
            ins, outs = [s * row for s in in_rows], [s * row for s in out_rows]
    return _start(comm, op, output, input, ins, outs, row, error, timeout)


def _fast_all_to_all(ch: OpChannel, output: torch.Tensor, input: torch.Tensor, ins: list[int], outs: list[int],
                     row: int) -> bool:
    """One native call when the tensors are contiguous and the input is in the heap (arguments checked)."""
    n_in, n_out = input.numel(), output.numel()
    if not n_in or not (input.is_contiguous() and output.is_contiguous()):
        return False
    nat = native_channel(ch)
    dt = DTYPE_CODES.get(input.dtype)
    W = ch.world_size
    if nat is None or dt is None or len(ins) != W or len(outs) != W:
        return False
    isz = input.element_size()
    offs = _heap_offsets(ch, input, output, n_in * isz, n_out * isz)
    if offs is None:
        return False
    in_addr, out_addr, in_off, out_off = offs
    algo, _ = choose(ch, OP_ALL_TO_ALL, input.dtype, n_in * isz)
    digest, _ = ch.sizes([row])
    ch.seq += 1
    ch.vectors[ch.rank][: 2 * W] = ins + outs
    rc = nat.all_to_all(nat.handle, ch.seq, in_addr, in_off, out_addr, out_off, n_in, n_out, row, digest, isz, dt,
                        algo)
    if rc == RC_FALLBACK:
        _finish_in_python(ch, nat.headers(), ins, outs, isz, algo, input, in_off, output, op="all_to_all")
    elif rc:
        nat.raise_for(rc, op="all_to_all", show=_show)
    return True


def _run(ch: OpChannel, op: str, output, input, counts, out_counts, dt: int, *, row: int) -> None:
    """Any placement: the native call stops at RC_FALLBACK when staging is needed; Python goes on."""
    W, me = ch.world_size, ch.rank
    isz = input.element_size()
    opcode = OP_ALL_TO_ALL if out_counts is not None else OP_ALL_GATHER
    out_t = output if output.is_contiguous() else torch.empty_like(output, memory_format=torch.contiguous_format)
    in_off = ch.offset_of(input) if input.is_contiguous() else -1
    out_off = ch.offset_of(out_t)
    error = None
    if in_off < 0 and out_off < 0 and is_strict():
        error = f"{op}: neither input nor output is a contiguous heap tensor and strict mode is on"
    algo, _ = choose(ch, opcode, input.dtype, sum(counts) * isz)
    digest, counts_addr = ch.sizes(counts if out_counts is None else [row])
    vec = np.asarray(counts if out_counts is None else counts + out_counts, dtype=np.int64)
    keep = input if input.is_contiguous() else input.contiguous()  # alive until the op ends
    nat = native_channel(ch)
    hdrs = None
    if nat is not None and error is None:
        ch.seq += 1
        if out_counts is not None:
            ch.vectors[me][: 2 * W] = vec
            rc = nat.all_to_all(nat.handle, ch.seq, keep.data_ptr(), in_off, out_t.data_ptr(), out_off,
                                input.numel(), output.numel(), row, digest, isz, dt, algo)
        else:
            rc = nat.all_gather(nat.handle, ch.seq, keep.data_ptr(), in_off, out_t.data_ptr(), out_off,
                                counts_addr, input.numel(), output.numel(), row, digest, isz, dt, algo)
        if rc == RC_FALLBACK:
            hdrs = nat.headers()  # placement needs staging: continue in Python, same protocol
        elif rc:
            nat.raise_for(rc, op=op, show=_show)
    else:
        hdrs = ch.begin([0, opcode, dt, 0, input.numel(), output.numel(), in_off, out_off, algo, 0, row, digest],
                        op=op, vectors=vec, error=error)
        fields = (Header.OP, Header.DTYPE, Header.ROW) + ((Header.OUT_NUMEL,) if out_counts is None else ())
        ch.agree(hdrs, fields, op=op)
        if out_counts is None:
            ch.agree_sizes(W, op=op, row=row)
    if hdrs is not None:
        _finish_in_python(ch, hdrs, counts, out_counts, isz, algo, keep, in_off, out_t, op=op)
    if out_t is not output:
        output.copy_(out_t)
        ch.ctx.sma.record_staged(output.numel() * isz)


def _finish_in_python(ch, hdrs, counts, out_counts, isz: int, algo: int, input, in_off: int, out_t, *,
                      op: str) -> None:
    ch.phase_base = max(h[Header.PHASE_BASE] for h in hdrs)  # also when the native call began the op
    blocks = _blocks(ch, hdrs, counts, out_counts, isz, op=op)
    staged = None
    try:
        mode = _mode(hdrs, algo)
        if mode == "stage":
            staged = _stage_inputs(ch, hdrs, input, in_off, op=op)
            mode = "pull"
        _move(ch, hdrs, blocks, mode, input if in_off < 0 else None, out_t, op=op)
    finally:
        if staged is not None:
            ch.ctx.sma.free(staged)


def _blocks(ch: OpChannel, hdrs, counts, out_counts, isz: int, *, op: str) -> np.ndarray:
    """int64 [W, W, 3]: for (src q, dst r): byte offset in q's input, in r's output, length."""
    W = ch.world_size
    if out_counts is None:
        disp = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        b = np.zeros((W, W, 3), dtype=np.int64)
        b[:, :, 1] = disp[:, None] * isz
        b[:, :, 2] = np.asarray(counts, dtype=np.int64)[:, None] * isz
        return b
    vecs = np.stack([v[: 2 * W] for v in ch.vectors])  # [rank, in(W) + out(W)]
    ins, outs = vecs[:, :W], vecs[:, W:]
    if not np.array_equal(ins, outs.T):
        q, r = map(int, np.argwhere(ins != outs.T)[0])
        ch.end(op=op)
        raise ZbcclInvalidUsageError(
            f"{op}: split sizes disagree, rank {q} sends {ins[q, r] // max(1, hdrs[q][Header.ROW])} rows to rank {r} "
            f"but rank {r} expects {outs[r, q] // max(1, hdrs[r][Header.ROW])}", ranks=(q, r))
    in_disp = np.concatenate([np.zeros((W, 1), np.int64), np.cumsum(ins, axis=1)[:, :-1]], axis=1)
    out_disp = np.concatenate([np.zeros((W, 1), np.int64), np.cumsum(outs, axis=1)[:, :-1]], axis=1)
    b = np.zeros((W, W, 3), dtype=np.int64)
    b[:, :, 0] = in_disp * isz
    b[:, :, 1] = out_disp.T * isz
    b[:, :, 2] = ins * isz
    return b


def _mode(hdrs, algo: int) -> str:
    all_in = all(h[Header.IN_OFF] >= 0 for h in hdrs)
    all_out = all(h[Header.OUT_OFF] >= 0 for h in hdrs)
    if all_in and all_out:
        return "push" if algo == PUSH else "pull"
    if all_in:
        return "pull"
    return "push" if all_out else "stage"


def _stage_inputs(ch: OpChannel, hdrs, input: torch.Tensor, in_off: int, *, op: str) -> int | None:
    """Ranks with a private input copy it into the heap and publish the offset (-1: out of heap)."""
    block = None
    if in_off < 0:
        nbytes = input.numel() * input.element_size()
        block = ch.ctx.sma.try_malloc(max(nbytes, 1), kind="staging")
        if block is not None and nbytes:
            src = input.contiguous()
            ch.prims.copy(ch.my_base + block, src.data_ptr(), nbytes, nthreads())
            ch.ctx.sma.record_staged(nbytes)
        ch.vectors[ch.rank][-1] = -1 if block is None else block
    ch.phase(op=op)
    staged = [h[Header.IN_OFF] if h[Header.IN_OFF] >= 0 else int(ch.vectors[r][-1]) for r, h in enumerate(hdrs)]
    full = [r for r, off in enumerate(staged) if off < 0]
    if full:
        ch.end(op=op)
        if block is not None:
            ch.ctx.sma.free(block)
        raise ZbcclOutOfMemoryError(
            f"{op}: ranks {full} could not stage their input through the heap (heap too small); "
            "allocate the tensors in the heap or raise heap_size", ranks=tuple(full))
    for r, h in enumerate(hdrs):
        hdrs[r] = h[: Header.IN_OFF] + (staged[r],) + h[Header.IN_OFF + 1:]
    return block


def _move(ch: OpChannel, hdrs, blocks: np.ndarray, mode: str, private_in, out_t, *, op: str) -> None:
    W, me = ch.world_size, ch.rank
    order = [(me + k) % W for k in range(W)]  # start with a different peer on each rank
    rows = []
    if mode == "pull":
        extent = [int((blocks[q, :, 0] + blocks[q, :, 2]).max(initial=0)) for q in range(W)]
        ins = ch.check_span(hdrs, Header.IN_OFF, extent, op=op)
        out = out_t.data_ptr()
        for q in order:
            s, d, n = blocks[q, me]
            if n and not (q == me and ins[q] + s == out + d):
                rows.append((out + d, ins[q] + s, n))
    else:
        outs = ch.check_span(hdrs, Header.OUT_OFF, [hdrs[r][Header.OUT_NUMEL] * out_t.element_size()
                                                    for r in range(W)], op=op)
        keep = private_in.contiguous() if private_in is not None else None  # alive until the copies ran
        src = keep.data_ptr() if keep is not None else ch.my_base + hdrs[me][Header.IN_OFF]
        for r in order:
            s, d, n = blocks[me, r]
            if n:
                rows.append((outs[r] + d, src + s, n))
    if rows:
        table = np.asarray(rows, dtype=np.int64)
        ch.prims.copy_many(int(table.ctypes.data), len(rows), nthreads())
    ch.end(op=op)
