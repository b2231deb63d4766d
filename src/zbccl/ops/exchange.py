"""all_gather (even and per-rank sizes) and all_to_all_single: block exchanges.

Both ops move one block from every rank q to every rank r: all_gather sends
q's whole input to row offset ``disp[q]`` of every output; all_to_all sends
rows ``in_disp_q[r]..`` of q's input to rows ``out_disp_r[q]..`` of r's output.

Heap placement and algorithms (decided in C after ``ARRIVE`` from every
rank's header, so all ranks decide alike):

* ``pull`` (preferred): every input is in the heap; rank r copies each
  peer's block into its own output. Writes stay local (lines other cores do
  not hold), and the output may be private memory.
* ``push``: every output is in the heap; rank q copies its input blocks into
  the peers' outputs. Used when inputs are private but outputs are in the heap.
* neither: ranks whose input is private copy it into the heap block Python
  reserved for it (counted in ``staged_bytes``), publish the offset,
  ``PHASE``, then ``pull``.

The tuner may prefer ``push`` when both are possible.
``DONE`` ends the op: for pull it means nobody reads my input any more; for
push, that my output is complete.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.autograd.profiler as _profiler

from ..native.abi import OP_ALL_GATHER, OP_ALL_TO_ALL
from ..runtime.communicator import Communicator
from ..runtime.registry import collective
from . import hosts, null, route
from .args import (
    check_exchange,
    dim_index,
    even_gather_code,
    gather_dim_error,
    index_list,
    splits,
    tensor_error,
)
from .channel import ERR_NOMEM, ERR_USAGE, OpChannel
from .entry import run_op
from .operands import is_strict
from .route import device_of
from .tuner import choose

__all__ = ["all_gather_into_tensor", "all_gather_v", "all_to_all_single"]

_HOT_AG = "all_gather/hot"  # key prefix of all_gather_into_tensor's hot-path plans in OpChannel.choices


def _row_elems(t: torch.Tensor) -> int:
    return int(np.prod(t.shape[1:])) if t.dim() > 1 else 1


@collective("all_gather_into_tensor")
def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, *, dim: int = 0,
                           comm: Communicator | None = None, timeout: float | None = None) -> torch.Tensor:
    """Collective: ``output`` (``world_size * input.numel()`` elements) gets every rank's ``input``
    in rank order. Pull-based when inputs are heap tensors (the output may be private); an
    ``input`` that is exactly this rank's slice of a contiguous ``output`` costs no copy for that
    slice; any other overlap of the two is refused on every rank. ``timeout``: seconds this op may
    wait (default: the communicator's). Blocks the host until the op is complete on this rank and
    no peer reads ``input`` any more.

    ``dim``: gather along that dimension instead. ``output``'s shape must be ``input``'s with
    ``dim`` ``world_size`` times longer, and rank r's input becomes its r-th slice along ``dim``
    (``torch.cat`` of the inputs along ``dim``; what vLLM's ``all_gather(input, dim)`` returns).
    Each rank's rows are copied straight into their columns of ``output``: no gather into a
    staging order and no reordering copy afterwards. Every rank must pass the same ``dim``.
    Rank r's slice is then strided, so there is no in-place form: ``output`` and ``input`` may not
    overlap (unless every size before ``dim`` is 1, which is dim 0's layout).
    """
    ch = comm.op_state
    if dim:
        return _gather_along(comm, ch, output, input, dim, timeout)
    if timeout is None and ch is not None and ch.plain and type(input) is torch.Tensor and type(output) is torch.Tensor:
        if ch.hot_gather is not None and ch.run_hot(ch.hot_gather, output, input, op="all_gather"):
            return output  # the native hot entry
        # the hot path of a repeated call on the tensors a plan was made for (every check passed then)
        try:
            plan = ch.choices.get((_HOT_AG, input.data_ptr(), output.data_ptr(), input.numel(), output.numel(),
                                   input.dtype, output.dtype, 1))
        except RuntimeError:  # no storage (a meta tensor): the checks below say why
            plan = None
        if plan is not None and input.is_contiguous() and output.is_contiguous() and not _profiler._is_profiler_enabled:
            ch.submit(plan, op="all_gather")
            if ch.hot_gather is not None:  # the hot entry did not serve it: its table lost the pair
                ch.hot_register(input, plan, output)
            return output
    W = comm.world_size
    dt = even_gather_code(output, input, W, comm.rank)
    if dt is not None:  # the common case, already checked
        return _start(comm, "all_gather", output, input, None, None, 1, None, timeout, dt=dt)
    error = tensor_error(output, "output", op="all_gather", written=True) or tensor_error(input, "input", op="all_gather")
    if error is not None and (device := device_of("all_gather", output, input)) is not None:  # CUDA: device ops
        return route.all_gather(comm, device, output, input, 0, timeout)
    counts = [0] * W if error else [input.numel()] * W
    return _start(comm, "all_gather", output, input, counts, None, 1, error, timeout)


def _gather_along(comm, ch: OpChannel | None, output, input, dim: int, timeout) -> torch.Tensor:
    """all_gather_into_tensor along ``dim`` != 0: the native op writes rank r's rows at column block r
    of each of ``blocks`` output rows (``blocks``: the product of the sizes before ``dim``)."""
    op = "all_gather"
    if (timeout is None and ch is not None and ch.plain and ch.hot_gather is not None and type(input) is torch.Tensor
            and type(output) is torch.Tensor and ch.run_hot(ch.hot_gather, output, input, dim, op=op)):
        return output  # the native hot entry (it checked the shapes)
    W = comm.world_size
    error = tensor_error(output, "output", op=op, written=True) or tensor_error(input, "input", op=op)
    if error is not None and (device := device_of(op, output, input)) is not None:  # CUDA: the device ops
        return route.all_gather(comm, device, output, input, dim, timeout)
    blocks = 1
    if error is None:
        blocks, error = gather_dim_error(output, input, dim, W, op=op)
    counts = [0] * W if error else [input.numel()] * W
    return _start(comm, op, output, input, counts, None, 1, error, timeout, blocks=blocks, dim=dim)


def _start(comm, op: str, output, input, counts, out_counts, row: int, error: str | None, timeout, *,
           dt: int | None = None, blocks: int = 1, dim: int = 0) -> torch.Tensor:
    """Check locally (unless ``dt`` says the caller did), then run the op (or fail it on every rank).
    ``counts`` None: an even all_gather, already checked. ``blocks`` > 1: a gather along an inner
    dimension (posted as the header's AUX; the layouts of ``blocks`` 0 and 1 are the same)."""
    W = comm.world_size
    if dt is None:
        dt = 0
        if error is None:
            dt, error = check_exchange(op, output, input, counts, out_counts, W, comm.rank, blocks)
    if not comm._single_host:  # a communicator across hosts
        if out_counts is not None:
            return hosts.all_to_all(comm, output, input, dt, counts, out_counts, error, timeout)
        return hosts.gather(comm, op, output, input, dt, counts, dim, error, timeout)
    opcode = OP_ALL_GATHER if out_counts is None else OP_ALL_TO_ALL
    run_op(comm, opcode, error, _native, null.copy_into,
           (output, input, op, counts, out_counts, row, dt, blocks if blocks > 1 else 0), op=op, timeout=timeout,
           t=input)
    return output


def _native(ch: OpChannel, output: torch.Tensor, input: torch.Tensor, op: str, counts: list[int] | None,
            out_counts: list[int] | None, row: int, dt: int, aux: int) -> None:
    """One native call: prefilled for repeated calls on contiguous heap inputs, else :func:`_general`."""
    if input.is_contiguous() and output.is_contiguous():
        key = (op, input.data_ptr(), output.data_ptr(), input.numel(), output.numel(), dt, row,
               None if counts is None else tuple(counts), None if out_counts is None else tuple(out_counts), aux)
        plan = ch.choices.get(key)
        if plan is None:
            plan = _plan(ch, key, output, input, counts, out_counts, row, dt, aux)
            if plan is not None and op == "all_gather" and ch.plain:  # even: the hot entries may serve it
                if counts is None:  # the Python hot path of all_gather_into_tensor (dim 0)
                    ch.choices[(_HOT_AG, key[1], key[2], key[3], key[4], input.dtype, output.dtype, 1)] = plan
                ch.hot_register(input, plan, output, max(aux, 1))
        if plan is not None:
            ch.submit(plan, op=op)
            return
    _general(ch, output, input, op, counts, out_counts, row, dt, aux)


def _shape(ch: OpChannel, input: torch.Tensor, n_out: int, counts: list[int] | None,
           out_counts: list[int] | None) -> tuple[int, int, int, int]:
    """``(opcode, algorithm, address of the posted size vector, its length)``."""
    W, n_in, isz = ch.world_size, input.numel(), input.element_size()
    if out_counts is None:
        opcode, sizes, nvec = OP_ALL_GATHER, [n_in] * W if counts is None else counts, W
    else:
        opcode, sizes, nvec = OP_ALL_TO_ALL, counts + out_counts, 2 * W
    algo, _ = choose(ch, opcode, input.dtype, (n_out if out_counts is None else n_in) * isz)
    return opcode, algo, ch.sizes(sizes), nvec


def _out_offset(ch: OpChannel, out: torch.Tensor) -> int:
    """Heap offset of a contiguous output, -1 outside the heap (the op then cannot push)."""
    return ch.offset_of(out)


def _plan(ch: OpChannel, key: tuple, output: torch.Tensor, input: torch.Tensor, counts, out_counts, row: int,
          dt: int, aux: int) -> tuple | None:
    """The prefilled call for contiguous tensors whose input is in the heap (zero-copy), or None."""
    n_in, n_out, isz = input.numel(), output.numel(), input.element_size()
    in_off = ch.offset_of(input)
    if in_off < 0:
        return None
    opcode, algo, counts_addr, nvec = _shape(ch, input, n_out, counts, out_counts)
    return ch.plan(key, op=opcode, dtype=dt, in_numel=n_in, out_numel=n_out, in_off=in_off,
                   out_off=_out_offset(ch, output), algo=algo, row=row, aux=aux, in_addr=input.data_ptr(),
                   out_addr=output.data_ptr(), itemsize=isz, counts=counts_addr, nvec=nvec)


def _general(ch: OpChannel, output: torch.Tensor, input: torch.Tensor, op: str, counts: list[int] | None,
             out_counts: list[int] | None, row: int, dt: int, aux: int) -> None:
    """Any placement: a private input gets a heap block to be staged into, a non-contiguous output is
    filled through a contiguous buffer."""
    isz, n_in, n_out = input.element_size(), input.numel(), output.numel()
    opcode, algo, counts_addr, nvec = _shape(ch, input, n_out, counts, out_counts)
    out_t = output if output.is_contiguous() else torch.empty_like(output, memory_format=torch.contiguous_format)
    out_addr = out_t.data_ptr()
    out_off = _out_offset(ch, out_t) if out_t is output else -1
    in_off = ch.offset_of(input)
    if in_off >= 0:
        ch.run(op, op=opcode, dtype=dt, in_numel=n_in, out_numel=n_out, in_off=in_off, out_off=out_off,
               algo=algo, row=row, aux=aux, in_addr=input.data_ptr(), out_addr=out_addr, itemsize=isz,
               counts=counts_addr, nvec=nvec)
    else:
        _private_input(ch, opcode, op, input, n_out, out_off, out_addr, (algo, row, dt, counts_addr, nvec, aux))
    if out_t is not output:
        output.copy_(out_t)
        ch.ctx.sma.record_staged(n_out * isz)


@collective("all_gather_v")
def all_gather_v(output: torch.Tensor, input: torch.Tensor, sizes: list[int], *, dim: int = 0,
                 comm: Communicator | None = None, timeout: float | None = None) -> torch.Tensor:
    """Collective: all-gather with per-rank sizes along ``dim`` (default 0).

    ``sizes[r]`` rows come from rank r; ``input`` is ``[sizes[rank], *rest]`` and ``output`` is
    ``[sum(sizes), *rest]``. Every rank must pass the same ``sizes`` (integers). Aliasing and
    ``timeout`` as in :func:`all_gather_into_tensor`. With ``dim`` != 0, ``input`` has ``sizes[rank]``
    along ``dim`` and ``output`` is ``torch.cat`` of the inputs along it (each rank's rows written
    straight into their columns, as :func:`all_gather_into_tensor` with ``dim``, and its overlap rule).
    """
    op = "all_gather_v"
    error = tensor_error(output, "output", op=op, written=True) or tensor_error(input, "input", op=op)
    if error is not None and (device := device_of(op, output, input)) is not None:  # CUDA: the device ops
        return route.all_gather_v(comm, device, output, input, sizes, dim, timeout)  # sizes: a list or a tensor
    rows, size_error = index_list(sizes, "sizes", op=op)
    error = error or size_error
    blocks = 1
    if error is None and len(rows) != comm.world_size:
        error = f"{op}: expected {comm.world_size} sizes, got {len(rows)}"
    if error is None and dim:
        blocks, error = gather_dim_error(output, input, dim, comm.world_size, op=op, sizes=rows, rank=comm.rank)
    if error is not None:
        row = 1
    elif dim:  # the elements of one size unit: a column block of every row before dim
        d = dim_index(dim, input.dim(), op=op)[0]
        row = blocks * math.prod(input.shape[d + 1:])
    else:
        row = _row_elems(output)
    counts = [0] * comm.world_size if error else [s * row for s in rows]
    return _start(comm, op, output, input, counts, None, row, error, timeout, blocks=blocks, dim=dim)


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
    if error is not None and (device := device_of(op, output, input)) is not None:  # CUDA: the device ops
        return route.all_to_all(comm, device, output, input, output_split_sizes, input_split_sizes, timeout)
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


def _private_input(ch: OpChannel, opcode: int, op: str, input: torch.Tensor, n_out: int, out_off: int, out_addr: int,
                   rest: tuple[int, int, int, int, int, int]) -> None:
    """An input outside the heap: reserve a heap block the native op copies it into if no algorithm can
    do without (push needs every output in the heap); the copy is counted in ``staged_bytes``."""
    algo, row, dt, counts_addr, nvec, aux = rest
    keep = input.contiguous()  # alive until the op ends
    isz, n_in = input.element_size(), input.numel()
    nbytes = n_in * isz
    error = kind = None
    if out_off < 0 and is_strict():
        error = f"{op}: neither input nor output is a contiguous heap tensor and strict mode is on"
    sma = ch.ctx.sma
    block = sma.try_malloc(max(nbytes, 1), kind="staging") if error is None else None
    if error is None and block is None:
        error, kind = (f"{op}: could not stage the input ({nbytes} bytes) through the heap (heap too small); "
                       "allocate the tensors in the heap or raise heap_size"), ERR_NOMEM
    try:
        if error is not None:
            ch.fail(opcode, error, kind or ERR_USAGE, op=op)
        ch.run(op, op=opcode, dtype=dt, in_numel=n_in, out_numel=n_out, in_off=-1, out_off=out_off, algo=algo, row=row,
               aux=aux, in_addr=keep.data_ptr(), out_addr=out_addr, itemsize=isz, counts=counts_addr, nvec=nvec,
               stage_off=block)
        if ch.staged():
            sma.record_staged(ch.staged())
    finally:
        if block is not None:
            sma.free(block)
