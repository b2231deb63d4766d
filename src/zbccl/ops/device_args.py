"""Local argument checks and launch plans of the device collectives (``ops/device.py``).

Pure functions over tensor metadata: they raise :class:`~zbccl.errors.ZbcclInvalidUsageError` in the
house form, and ``DeviceOps`` turns a raise into an ERROR launch so that the peers hear of it too.
"""

from __future__ import annotations

import math
import operator

import torch

from ..errors import ZbcclInvalidUsageError
from ..native.triton import geometry as g
from .args import dim_index, overlap_error

__all__ = ["fail", "check_local", "sizes_table", "gather_shape", "scatter_shape", "exchange_shape", "plan",
           "field_name", "TILE_BYTES", "GPU_BLOCKS", "BIG_FROM", "BIG_TILE_BYTES"]

#: GPU launch shape: bytes one block moves per tile, and the most blocks a launch uses.
TILE_BYTES = 8 << 10
GPU_BLOCKS = g.MAX_BLOCKS
#: From this many bytes per rank range, the copies (all_gather, all_to_all, broadcast) take tiles of
#: ``BIG_TILE_BYTES``: a block issues a whole tile's loads before its stores, so a bigger tile keeps more
#: bytes in flight per block (what a copy's bandwidth needs when a launch has about one block per
#: multiprocessor). On an H200, 2 ranks, 64 MiB: all_gather 151 us against 213 us with 8 KiB tiles; the
#: two-shot all_reduce 146 against 139 us, so the reductions keep 8 KiB tiles (docs/benchmarks.md A.22).
#: Small ops keep small tiles: more blocks share the work, and the latency is the handshake's.
BIG_FROM = 8 << 20
BIG_TILE_BYTES = 32 << 10


def fail(error: str | None) -> None:
    if error:
        raise ZbcclInvalidUsageError(error)


def check_local(t, device: torch.device, role: str, op: str) -> None:
    """``t`` must be a contiguous tensor on ``device``."""
    if not isinstance(t, torch.Tensor):
        raise ZbcclInvalidUsageError(f"{op}: {role} must be a torch.Tensor, got {type(t).__name__}")
    if t.device != device:
        raise ZbcclInvalidUsageError(f"{op}: {role} on the wrong device, expected {device}, got {t.device}")
    if not t.is_contiguous():
        raise ZbcclInvalidUsageError(
            f"{op}: {role} must be contiguous, expected a dense row-major tensor, got strides {t.stride()}")


def sizes_table(sizes, world: int, device: torch.device, what: str, op: str) -> tuple[torch.Tensor, list[int] | None]:
    """Per-rank ``sizes`` as int64 ``[KMAX_WORLD]`` on ``device`` (zero-padded), and as ints when they are host
    values. A device tensor is taken as is (copied on the stream, graph-capturable; checked by the kernels)."""
    if isinstance(sizes, torch.Tensor) and sizes.device.type != "cpu":
        if sizes.dtype != torch.int64 or sizes.shape != (world,) or sizes.device != device:
            raise ZbcclInvalidUsageError(
                f"{op}: {what}, expected an int64 [{world}] tensor on {device}, got {sizes.dtype} "
                f"{list(sizes.shape)} on {sizes.device}")
        padded = torch.zeros(g.KMAX_WORLD, dtype=torch.int64, device=device)
        padded[:world].copy_(sizes)
        return padded, None
    try:
        vals = [operator.index(v) for v in (sizes.tolist() if isinstance(sizes, torch.Tensor) else sizes)]
    except TypeError:
        vals = None
    if vals is None or len(vals) != world or any(isinstance(v, bool) or v < 0 for v in vals):
        raise ZbcclInvalidUsageError(f"{op}: {what}, expected {world} non-negative integers, got {sizes!r}")
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise ZbcclInvalidUsageError(
            f"{op}: {what} are host values, expected an int64 [{world}] tensor on {device} while capturing a "
            "CUDA graph (a replay must read them from device memory), got a list")
    t = torch.tensor(vals + [0] * (g.KMAX_WORLD - world), dtype=torch.int64)
    return (t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)), vals


def _dim(inp: torch.Tensor, dim, op: str) -> tuple[int, list[int]]:
    d, error = dim_index(dim, max(inp.dim(), 1), op=op)
    fail(error)
    return d, list(inp.shape) or [1]


def gather_shape(out: torch.Tensor, inp: torch.Tensor, vals: list[int] | None, varied: bool, dim, world: int,
                 me: int, op: str) -> tuple[int, int, int, int, bool]:
    """``(outer, inner, cnt, total, skip_self)`` of a gather along ``dim`` (``varied``: all_gather_v, with
    ``vals`` the sizes when known here). ``skip_self``: ``inp`` is already this rank's part of ``out``."""
    d, shape = _dim(inp, dim, op)
    cnt = shape[d]
    if vals is not None and cnt != vals[me]:
        raise ZbcclInvalidUsageError(
            f"{op}: the input disagrees with sizes, expected {vals[me]} along dim {d}, got {list(inp.shape)}")
    total = cnt * world if not varied else sum(vals) if vals is not None else (list(out.shape) or [1])[d]
    want = shape[:d] + [total] + shape[d + 1:]
    if (list(out.shape) or [1]) != want or out.dtype != inp.dtype:
        raise ZbcclInvalidUsageError(
            f"{op}: wrong output for a gather along dim {d}, expected {want} {inp.dtype}, got "
            f"{list(out.shape)} {out.dtype}")
    outer, inner = math.prod(shape[:d]), math.prod(shape[d + 1:])
    pre = cnt * me if not varied else sum(vals[:me]) if vals is not None else -1
    skip = outer == 1 and pre >= 0 and inp.data_ptr() == out.data_ptr() + pre * inner * inp.element_size()
    if not skip:
        fail(overlap_error(out, inp, op=op))
    return outer, inner, cnt, total, skip


def scatter_shape(out: torch.Tensor, inp: torch.Tensor, vals: list[int] | None, varied: bool, dim, world: int,
                  me: int, op: str) -> tuple[int, int, int, int]:
    """``(outer, inner, cnt, total)`` of a reduce-scatter along ``dim``; ``out`` may be exactly this rank's
    part of ``inp`` (when ``dim``'s outer size is 1)."""
    d, shape = _dim(inp, dim, op)
    total = shape[d]
    if not varied:
        if total % world:
            raise ZbcclInvalidUsageError(
                f"{op}: input not divisible, expected dim {d} a multiple of {world}, got {list(inp.shape)}")
        cnt = total // world
    else:
        cnt = vals[me] if vals is not None else (list(out.shape) or [1])[d]
        if vals is not None and sum(vals) != total:
            raise ZbcclInvalidUsageError(
                f"{op}: sizes do not cover the input, expected them to sum to {total} (dim {d}), got {vals}")
    want = shape[:d] + [cnt] + shape[d + 1:]
    if (list(out.shape) or [1]) != want or out.dtype != inp.dtype:
        raise ZbcclInvalidUsageError(
            f"{op}: wrong output for a scatter along dim {d}, expected {want} {inp.dtype}, got "
            f"{list(out.shape)} {out.dtype}")
    outer, inner = math.prod(shape[:d]), math.prod(shape[d + 1:])
    pre = cnt * me if not varied else sum(vals[:me]) if vals is not None else -1
    if not (outer == 1 and pre >= 0 and out.data_ptr() == inp.data_ptr() + pre * inner * inp.element_size()):
        fail(overlap_error(out, inp, op=op))
    return outer, inner, cnt, total


def exchange_shape(out: torch.Tensor, inp: torch.Tensor, in_vals: list[int] | None, out_vals: list[int] | None,
                   varied: bool, world: int, op: str, *, partial: bool = False,
                   in_rows: int | None = None) -> tuple[int, int]:
    """``(rows, inner)`` of an all_to_all over dim 0 (rows of ``inner`` elements); ``partial``: the splits may
    cover only the first rows of each tensor; ``in_rows``: what the in_splits count instead of ``inp``'s rows
    (the entries of a row list)."""
    if inp.dim() == 0 or out.dim() == 0 or out.shape[1:] != inp.shape[1:] or out.dtype != inp.dtype:
        raise ZbcclInvalidUsageError(
            f"{op}: output and input must be [rows, ...] alike, expected the same trailing shape and dtype, "
            f"got {list(out.shape)} {out.dtype} and {list(inp.shape)} {inp.dtype}")
    rows = inp.shape[0]
    if not varied and (rows % world or out.shape[0] != rows):
        raise ZbcclInvalidUsageError(
            f"{op}: equal splits, expected input and output rows a multiple of {world} and equal, got "
            f"{inp.shape[0]} and {out.shape[0]}")
    for what, vals, n in (("in_splits", in_vals, rows if in_rows is None else in_rows), ("out_splits", out_vals,
                                                                                        out.shape[0])):
        if vals is not None and (sum(vals) > n if partial else sum(vals) != n):
            raise ZbcclInvalidUsageError(
                f"{op}: {what} do not cover the tensor, expected them to sum to {'at most ' if partial else ''}{n} "
                f"rows, got {vals}")
    fail(overlap_error(out, inp, op=op))
    return rows, math.prod(inp.shape[1:])


def plan(n: int, itemsize: int, interpret: bool, *, copy: bool = True) -> tuple[int, int, int]:
    """``(grid, block, num_warps)`` for ``n`` elements per rank range; a function of values every rank
    agrees on (the kernels check the grid), never of this rank's addresses.

    GPU: 8 KiB tiles (a ``copy``'s 32 KiB from ``BIG_FROM`` bytes; 16-byte accesses, 8 warps), one block
    per tile up to GPU_BLOCKS, then each block loops. Interpreter: few, wide programs (it pays per program and per numpy
    call)."""
    if interpret:
        block = 1024
        return max(1, min(4, -(-n // block))), block, 1
    block = max((BIG_TILE_BYTES if copy and n * itemsize >= BIG_FROM else TILE_BYTES) // itemsize, 128)
    return max(1, min(GPU_BLOCKS, -(-n // block))), block, 8


def field_name(i: int) -> str:
    """The name of argument-row word ``i`` in error messages."""
    if i >= g.A_SPLITS + g.KMAX_WORLD:
        return f"out_splits[{i - g.A_SPLITS - g.KMAX_WORLD}]"
    if i >= g.A_SPLITS:
        return f"splits[{i - g.A_SPLITS}]"
    if not 0 <= i < len(g.A_FIELDS):
        return f"field {i}"
    return {"NUMEL": "element count", "GRID": "launch shape (follows the sizes)", "OP": "op",
            "REDOP": "reduce op"}.get(g.A_FIELDS[i], g.A_FIELDS[i].lower())
