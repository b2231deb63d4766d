"""Local argument checks of the collectives, as error strings rather than exceptions.

Every check here returns ``None`` or a message instead of raising, because an
argument only one rank gets wrong must fail on *every* rank: the op posts the
message in its header (``OpChannel.fail_together``) and all ranks raise after
the handshake. A rank that raised alone would leave its peers waiting for it
(or pairing their next op with this one).
"""

from __future__ import annotations

import math
import operator

import torch

from .. import env
from ..errors import ZbcclInvalidUsageError
from .dtypes import DTYPE_CODES, dtype_code

__all__ = ["tensor_error", "written_error", "index_list", "rank_error", "timeout_error", "span", "overlap_error", "splits",
           "check_exchange", "even_gather_code", "dim_index", "gather_dim_error"]


_CUDA = "a CUDA tensor: the device ops run this op (ops/route.py)"


def tensor_error(t, role: str, *, op: str, written: bool = False) -> str | None:
    """Why ``t`` cannot be an operand (not a tensor, not strided, not on the CPU, or, when the op
    writes it, elements sharing memory as in an expanded view), or None."""
    if not isinstance(t, torch.Tensor):
        return f"{op}: {role} must be a torch.Tensor, got {type(t).__name__}"
    if t.layout != torch.strided:
        return f"{op}: {role} must be a dense (strided) tensor, got layout {t.layout}"
    if not t.is_cpu:
        # CUDA tensors leave here for the device ops (ops/route.py: every caller routes an op with a CUDA operand
        # there, whose checks report the rest); any other device has no backend.
        if t.is_cuda:
            return _CUDA  # unformatted: the message is never shown, and formatting it costs a microsecond per op
        return f"{op}: {role} must be a CPU tensor or a CUDA heap tensor, got device {t.device}"
    return written_error(t, role, op=op) if written else None


def written_error(t: torch.Tensor, role: str, *, op: str) -> str | None:
    """An error if the op would write ``t`` but two of its elements share memory (caught here, not
    when the result is copied back into it after the op, on this rank only)."""
    if t.is_contiguous() or not _self_overlapping(t):
        return None
    return (f"{op}: {role} is written but has elements sharing memory, expected distinct elements, "
            f"got shape {tuple(t.shape)} with strides {t.stride()}")


def _self_overlapping(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` share memory (an expanded view, a hand-made as_strided)."""
    dims = sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz > 1)
    reach = 0  # elements spanned by the dimensions of smaller stride
    for stride, size in dims:
        if stride == 0:
            return True
        if stride <= reach:  # maybe interleaved rather than overlapping: decide exactly
            return _positions(t, t.data_ptr()).unique().numel() != t.numel()
        reach += (size - 1) * stride
    return False


def _positions(t: torch.Tensor, base: int) -> torch.Tensor:
    """Element index (from byte address ``base``) of every element of ``t``."""
    idx = torch.zeros(t.shape, dtype=torch.int64)
    for d, (size, stride) in enumerate(zip(t.shape, t.stride())):
        shape = [1] * t.dim()
        shape[d] = size
        idx = idx + torch.arange(size, dtype=torch.int64).view(shape) * stride
    return idx.reshape(-1) + (t.data_ptr() - base) // t.element_size()


def index_list(values, what: str, *, op: str) -> tuple[list[int] | None, str | None]:
    """``values`` as a list of Python ints (each ``operator.index``-able, not bool), or an error."""
    try:
        items = list(values)
    except TypeError:
        return None, f"{op}: {what} must be a sequence of integers, got {type(values).__name__}"
    out = []
    for v in items:
        if isinstance(v, bool):
            return None, f"{op}: {what} must be integers, got {v!r}"
        try:
            out.append(operator.index(v))
        except TypeError:
            return None, f"{op}: {what} must be integers, got {v!r} ({type(v).__name__})"
    return out, None


def rank_error(src, world: int, *, op: str) -> tuple[int, str | None]:
    """``(rank, None)`` for an integral rank of the communicator in ``[0, world)``, else ``(0, error)``."""
    if isinstance(src, bool):
        return 0, f"{op}: src must be an integer rank, got {src!r}"
    try:
        value = operator.index(src)
    except TypeError:
        return 0, f"{op}: src must be an integer rank, got {src!r} ({type(src).__name__})"
    if not 0 <= value < world:
        return 0, f"{op}: src out of range, expected [0, {world}), got {value}"
    return value, None


def timeout_error(timeout, default: float, *, op: str) -> tuple[float, str | None]:
    """``(seconds, None)`` for ``None`` (``default``) or a positive finite number, else ``(default, error)``."""
    if timeout is None:
        return default, None
    try:
        value = float(timeout)
    except (TypeError, ValueError):
        return default, f"{op}: timeout must be a number of seconds, got {timeout!r}"
    if isinstance(timeout, bool) or not math.isfinite(value) or not 0 < value <= env.MAX_SECONDS:
        return default, (f"{op}: timeout must be a positive finite number of seconds, at most {env.MAX_SECONDS:.0f} "
                         f"(what a wait can represent), got {timeout!r}")
    return value, None


def span(t: torch.Tensor) -> tuple[int, int]:
    """``[start, end)`` byte addresses that ``t`` can touch (empty for zero elements)."""
    if t.numel() == 0:
        return 0, 0
    isz = t.element_size()
    lo = hi = t.data_ptr()
    for size, stride in zip(t.shape, t.stride()):
        if stride >= 0:
            hi += (size - 1) * stride * isz
        else:
            lo += (size - 1) * stride * isz
    return lo, hi + isz


def _elements_intersect(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Exact test for strided views of one storage whose spans intersect (rare, so O(n) is fine)."""
    isz = a.element_size()
    if b.element_size() != isz or (a.data_ptr() - b.data_ptr()) % isz:
        return True  # differently typed views: the span answer stands
    base = min(a.data_ptr(), b.data_ptr())
    return bool(torch.isin(_positions(a, base), _positions(b, base)).any())


def overlap_error(a: torch.Tensor, b: torch.Tensor, *, op: str, allowed: bool = False) -> str | None:
    """An error if ``a`` (output) and ``b`` (input) share any byte, unless ``allowed`` (exact aliasing
    the algorithm supports, decided by the caller)."""
    if allowed:
        return None
    contiguous = a.is_contiguous() and b.is_contiguous()
    if contiguous:  # the hot case, without the per-dimension walk of span()
        a0, b0 = a.data_ptr(), b.data_ptr()
        a1, b1 = a0 + a.numel() * a.element_size(), b0 + b.numel() * b.element_size()
        if a0 >= b1 or b0 >= a1 or a0 == a1 or b0 == b1:
            return None
    else:
        a0, a1 = span(a)
        b0, b1 = span(b)
        if a0 >= b1 or b0 >= a1:
            return None
    if not contiguous and not _elements_intersect(a, b):
        return None  # interleaved views (x[::2] and x[1::2]) do not overlap
    return (f"{op}: output and input overlap, expected separate memory (or the exact in-place aliasing the op "
            f"supports), got output bytes [{a0:#x}, {a1:#x}) and input bytes [{b0:#x}, {b1:#x})")


def splits(t: torch.Tensor, values, world: int, what: str, *, op: str) -> tuple[list[int], str | None]:
    """Rows per rank along dim 0: ``values`` as ints, or equal splits for ``None``."""
    if values is None:
        rows = t.shape[0] if t.dim() else 1
        if rows % world:
            return [0] * world, f"{op}: dim 0 must divide by {world} for equal splits, got {rows} rows"
        return [rows // world] * world, None
    out, error = index_list(values, what, op=op)
    return (out, None) if error is None else ([0] * world, error)


def check_exchange(op: str, output: torch.Tensor, input: torch.Tensor, counts: list[int],
                   out_counts: list[int] | None, world: int, rank: int, blocks: int = 1) -> tuple[int, str | None]:
    """``(dtype code, error)`` for all_gather (``out_counts`` None) and all_to_all arguments.
    ``blocks`` > 1: an all_gather along an inner dimension, whose slices are strided (no in-place form).

    On every op's hot path: each tensor attribute is read once.
    """
    try:
        dt = dtype_code(input.dtype, op=op)
    except ZbcclInvalidUsageError as exc:
        return 0, str(exc)
    if input.dtype != output.dtype:
        return dt, f"{op}: input and output dtypes differ, expected one dtype, got {input.dtype} and {output.dtype}"
    n_in, n_out = input.numel(), output.numel()
    if len(counts) != world or (out_counts is not None and len(out_counts) != world):
        return dt, f"{op}: expected {world} sizes, got {len(counts)}"
    if min(counts) < 0 or (out_counts is not None and min(out_counts) < 0):
        return dt, f"{op}: sizes must be non-negative, got {counts if min(counts) < 0 else out_counts}"
    if out_counts is None:
        if n_in != counts[rank] or n_out != sum(counts):
            return dt, (f"{op}: wrong sizes, expected input {counts[rank]} and output {sum(counts)} elements, "
                        f"got {n_in} and {n_out}")
    elif n_in != sum(counts) or n_out != sum(out_counts):
        return dt, (f"{op}: splits do not cover the tensors, expected input {sum(counts)} and output "
                    f"{sum(out_counts)} elements, got {n_in} and {n_out}")
    if not (n_in and n_out):
        return dt, None
    if input.is_contiguous() and output.is_contiguous():
        isz = input.element_size()
        a0, b0 = output.data_ptr(), input.data_ptr()
        if b0 + n_in * isz <= a0 or a0 + n_out * isz <= b0:
            return dt, None
        # all_gather supports exactly one aliasing: the input is this rank's slice of the output
        # (peers read it while this rank writes the other slices). all_to_all has no in-place form.
        exact = out_counts is None and blocks <= 1 and b0 == a0 + sum(counts[:rank]) * isz
        return dt, None if exact else overlap_error(output, input, op=op)
    return dt, overlap_error(output, input, op=op)


def dim_index(dim, nd: int, *, op: str) -> tuple[int, str | None]:
    """``(d, error)``: ``dim`` as an index in ``[0, nd)`` (negative counts from the end; ``bool`` refused)."""
    try:
        d = operator.index(dim) if not isinstance(dim, bool) else None
    except TypeError:
        d = None
    if d is None or not -nd <= d < nd:
        return 0, f"{op}: dim out of range, expected an int in [{-nd}, {nd}) for a {nd}-d input, got {dim!r}"
    return d + nd if d < 0 else d, None


def gather_dim_error(output: torch.Tensor, input: torch.Tensor, dim: int, world: int, *, op: str,
                     sizes: list[int] | None = None, rank: int = 0) -> tuple[int, str | None]:
    """``(blocks, error)`` for an all_gather along ``dim``: ``output``'s shape must be ``input``'s with
    ``dim`` ``world`` times longer (with per-rank ``sizes``: ``input`` has ``sizes[rank]`` there and
    ``output`` their sum). ``blocks``: the product of the sizes before ``dim`` (overlap is
    :func:`check_exchange`'s, which allows no in-place form when ``blocks`` > 1)."""
    d, error = dim_index(dim, input.dim(), op=op)
    if error:
        return 1, error
    if sizes is not None and input.shape[d] != sizes[rank]:
        return 1, (f"{op}: the input disagrees with sizes, expected {sizes[rank]} along dim {dim} (sizes[{rank}]), "
                   f"got input {list(input.shape)}")
    want = (*input.shape[:d], world * input.shape[d] if sizes is None else sum(sizes), *input.shape[d + 1:])
    if tuple(output.shape) != want:
        return 1, (f"{op}: wrong output shape for a gather along dim {dim}, expected {list(want)} "
                   f"(input {list(input.shape)}), got {list(output.shape)}")
    return math.prod(input.shape[:d]), None


def even_gather_code(output, input, world: int, rank: int) -> int | None:
    """all_gather_into_tensor's common case, checked in a fraction of the general checks' time.

    The dtype code when both operands are contiguous, dense CPU tensors of one supported dtype,
    ``output`` holds ``world`` inputs and the two do not overlap (or ``input`` is exactly this
    rank's slice of ``output``); None for anything else, which the caller then runs through
    :func:`tensor_error` and :func:`check_exchange` for the exact message. Same verdicts, fewer
    tensor attribute reads: this sits on every small all_gather's path.
    """
    if type(output) is not torch.Tensor or type(input) is not torch.Tensor:
        return None
    dtype = input.dtype
    dt = DTYPE_CODES.get(dtype)
    if dt is None or output.dtype is not dtype or not (input.is_cpu and output.is_cpu):
        return None
    if input.layout is not torch.strided or output.layout is not torch.strided:
        return None
    if not (input.is_contiguous() and output.is_contiguous()):
        return None
    n = input.numel()
    if n == 0 or output.numel() != n * world:
        return None
    nbytes = n * input.element_size()
    a0, b0 = output.data_ptr(), input.data_ptr()
    if b0 + nbytes <= a0 or a0 + nbytes * world <= b0 or b0 == a0 + rank * nbytes:
        return dt
    return None
