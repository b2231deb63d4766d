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

import math

import numpy as np
import torch

from ..errors import ZbcclInvalidUsageError
from ..native.abi import OP_REDUCE_SCATTER
from ..runtime.communicator import Communicator
from ..runtime.registry import collective
from . import hosts, null, route
from .args import dim_index, index_list, overlap_error, tensor_error
from .channel import OpChannel
from .dtypes import dtype_code, reduce_op_code
from .entry import run_op
from .operands import Operand
from .route import device_of
from .tuner import choose

__all__ = ["reduce_scatter_tensor", "reduce_scatter_v"]

_RS = "reduce_scatter"


@collective("reduce_scatter_tensor")
def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op="sum", *, dim: int = 0,
                          comm: Communicator | None = None, timeout: float | None = None) -> torch.Tensor:
    """Collective: ``output`` (``input.numel() / world_size`` elements) gets slice ``rank`` of the
    element-wise reduction of every rank's ``input``. ``op`` as in :func:`all_reduce`.
    ``output`` may be exactly slice ``rank`` of ``input`` (in place); any other overlap is refused.
    ``timeout``: seconds this op may wait (default: the communicator's).
    Blocks the host until no peer reads this rank's ``input`` any more.

    ``dim``: scatter along that dimension instead: ``output``'s shape is ``input``'s with ``dim``
    ``world_size`` times shorter, and gets the reduction of every input's r-th chunk along ``dim``
    (what vLLM's ``reduce_scatter(input, dim)`` returns), reduced straight from the peers' columns
    with no reordering copy before or after. Every rank must pass the same ``dim``; no in-place form
    (``output`` and ``input`` may not overlap unless every size before ``dim`` is 1: dim 0's layout).
    """
    W = comm.world_size
    error = tensor_error(output, "output", op=_RS, written=True) or tensor_error(input, "input", op=_RS)
    if error is not None and (device := device_of(_RS, output, input)) is not None:  # CUDA: the device ops
        return route.reduce_scatter(comm, device, output, input, op, dim, timeout)
    if error is None and dim:
        return _along(comm, _RS, output, input, op, dim, None, timeout)
    counts = [0] * W if error else [output.numel()] * W
    return _run(comm, _RS, output, input, op, counts, 1, error, timeout)


@collective("reduce_scatter_v")
def reduce_scatter_v(output: torch.Tensor, input: torch.Tensor, sizes: list[int], op="sum", *, dim: int = 0,
                     comm: Communicator | None = None, timeout: float | None = None) -> torch.Tensor:
    """Collective: reduce-scatter with per-rank sizes along ``dim`` (default 0).

    ``input`` is ``[sum(sizes), *rest]`` on every rank; ``output`` is ``[sizes[rank], *rest]``
    (with ``dim``: those sizes along ``dim``, every other dimension equal). Every rank must pass the
    same ``sizes`` (integers). Aliasing and ``timeout`` as in :func:`reduce_scatter_tensor`.
    """
    op_name = "reduce_scatter_v"
    error = tensor_error(output, "output", op=op_name, written=True) or tensor_error(input, "input", op=op_name)
    if error is not None and (device := device_of(op_name, output, input)) is not None:  # CUDA: the device ops
        return route.reduce_scatter_v(comm, device, output, input, sizes, op, dim, timeout)  # a list or a tensor
    rows, size_error = index_list(sizes, "sizes", op=op_name)
    error = error or size_error
    if error is None and dim:
        return _along(comm, op_name, output, input, op, dim, rows, timeout)
    row = int(np.prod(input.shape[1:])) if error is None and input.dim() > 1 else 1
    counts = [0] * comm.world_size if error else [s * row for s in rows]
    return _run(comm, op_name, output, input, op, counts, row, error, timeout)


def _along(comm, op: str, output, input, red_op, dim, sizes: list[int] | None, timeout) -> torch.Tensor:
    """reduce-scatter along ``dim`` != 0 (``sizes`` None: even): rank r reduces columns block r of each of
    the ``blocks`` rows before ``dim`` (the header's AUX), straight into its output."""
    W = comm.world_size
    blocks, row, counts = 1, 1, [0] * W
    d, error = dim_index(dim, input.dim(), op=op)
    if error is None:
        if sizes is None and input.shape[d] % W:
            error = f"{op}: dim {dim} does not split evenly, expected a multiple of {W}, got {input.shape[d]}"
        elif sizes is not None and (len(sizes) != W or sum(sizes) != input.shape[d]):
            error = (f"{op}: sizes disagree with the input, expected {W} sizes summing to {input.shape[d]} "
                     f"(dim {dim}), got {list(sizes)}")
        else:
            sizes = [input.shape[d] // W] * W if sizes is None else sizes
            want = (*input.shape[:d], sizes[comm.rank], *input.shape[d + 1:])
            if tuple(output.shape) != want:  # (overlap: _local_error, no in-place form when blocks > 1)
                error = (f"{op}: wrong output shape for a reduce-scatter along dim {dim}, expected {list(want)} "
                         f"(input {list(input.shape)}), got {list(output.shape)}")
            blocks = math.prod(input.shape[:d])
            row = blocks * math.prod(input.shape[d + 1:])
            if error is None:
                counts = [s * row for s in sizes]
    return _run(comm, op, output, input, red_op, counts, row, error, timeout, blocks=blocks if blocks > 1 else 0,
                dim=d)


def _local_error(op: str, output, input, red_op, counts, rank: int, world: int,
                 aux: int = 0) -> tuple[int, int, str | None]:
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
    exact = (not aux and input.is_contiguous() and output.is_contiguous()
             and output.data_ptr() == input.data_ptr() + sum(counts[:rank]) * input.element_size())
    return dt, red, overlap_error(output, input, op=op, allowed=exact)


def _run(comm, op: str, output, input, red_op, counts: list[int], row: int, error: str | None,
         timeout, *, blocks: int = 0, dim: int = 0) -> torch.Tensor:
    """``blocks`` (> 1): along an inner dimension, posted as the header's AUX (0 and 1 are dim 0's layout)."""
    dt = red = 0
    if error is None:
        dt, red, error = _local_error(op, output, input, red_op, counts, comm.rank, comm.world_size, blocks)
    if not comm._single_host:  # a communicator across hosts
        return hosts.reduce_scatter(comm, op, output, input, dt, red, counts, dim, error, timeout)
    run_op(comm, OP_REDUCE_SCATTER, error, _native, null.copy_into,
           (output, input, op, counts, row, dt, red, blocks), op=op, timeout=timeout, t=input)
    return output


def _native(ch: OpChannel, output: torch.Tensor, input: torch.Tensor, op: str, counts: list[int], row: int,
            dt: int, red: int, aux: int) -> None:
    """One native call: prefilled for repeated calls on contiguous tensors with a heap input; else a
    private input is staged (peers read their slice of it) and the output filled through a buffer."""
    if input.is_contiguous() and output.is_contiguous():
        key = (op, input.data_ptr(), output.data_ptr(), input.numel(), dt, red, row, tuple(counts), aux)
        plan = ch.choices.get(key)
        if plan is None:
            plan = _plan(ch, key, output, input, counts, row, dt, red, aux)
        if plan is not None:
            ch.submit(plan, op=op)
            return
    isz, n_in = input.element_size(), input.numel()
    algo, _ = choose(ch, OP_REDUCE_SCATTER, input.dtype, n_in * isz)
    counts_addr = ch.sizes(counts)
    out_t = output if output.is_contiguous() else torch.empty_like(output, memory_format=torch.contiguous_format)
    src = Operand(ch, input, op=op, role="input", read=True, write=False)
    try:
        if src.error is not None:
            ch.fail(OP_REDUCE_SCATTER, src.error, src.kind, op=op)
        ch.run(op, op=OP_REDUCE_SCATTER, dtype=dt, redop=red, in_numel=n_in, out_numel=output.numel(),
               in_off=src.offset, out_off=-1, algo=algo, row=row, aux=aux, in_addr=src.addr, out_addr=out_t.data_ptr(),
               itemsize=isz, counts=counts_addr, nvec=ch.world_size)
    finally:
        src.finish()
    _copy_back(ch, output, out_t)


def _plan(ch: OpChannel, key: tuple, output: torch.Tensor, input: torch.Tensor, counts: list[int], row: int,
          dt: int, red: int, aux: int) -> tuple | None:
    """The prefilled call when the input is a contiguous heap tensor (zero-copy), or None."""
    isz, n_in = input.element_size(), input.numel()
    in_off = ch.offset_of(input)
    if in_off < 0:
        return None
    algo, _ = choose(ch, OP_REDUCE_SCATTER, input.dtype, n_in * isz)
    return ch.plan(key, op=OP_REDUCE_SCATTER, dtype=dt, redop=red, in_numel=n_in, out_numel=output.numel(),
                   in_off=in_off, out_off=-1, algo=algo, row=row, aux=aux, in_addr=input.data_ptr(),
                   out_addr=output.data_ptr(), itemsize=isz, counts=ch.sizes(counts), nvec=ch.world_size)


def _copy_back(ch: OpChannel, output: torch.Tensor, out_t: torch.Tensor) -> None:
    if out_t is not output:
        output.copy_(out_t)
        ch.ctx.sma.record_staged(output.numel() * output.element_size())
