"""The process group's list forms (and gather/scatter) on zbccl's flat ops.

torch's list forms (``all_gather(list)``, ``reduce_scatter(list)``,
``all_to_all(list)``, ``gather``, ``scatter``) pass one tensor per rank.
zbccl's ops move one flat buffer with per-rank counts. When the list's
tensors already lie back to back in one storage (``list(t.chunk(n))``, the
common way to build them) the flat buffer is a view and nothing is copied;
otherwise the inputs are packed into one buffer (``torch.cat``: a heap
tensor inside ``zbccl.heap_scope()``) and the outputs unpacked from one,
which costs one extra local copy of that side.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import ZbcclInvalidUsageError
from ..ops import (
    all_gather_into_tensor,
    all_gather_v,
    all_to_all_single,
    reduce_scatter_tensor,
    reduce_scatter_v,
)
from ..ops.dtypes import DTYPE_CODES

__all__ = ["flat_view", "pack", "heap_empty", "Unpacked", "as_bytes", "as_bytes_rows", "as_real", "check_dtypes", "allgather_list",
           "reduce_scatter_list", "alltoall_list", "gather_list", "scatter_list", "reduce_to"]


def check_dtypes(tensors: Sequence[torch.Tensor], dtype: torch.dtype, *, op: str, role: str,
                 device: torch.device | None = None) -> None:
    """Raise on every rank alike when a list mixes dtypes (the flat buffer has one dtype) or devices
    (``device``: the op's other operand's; None: CPU)."""
    device = torch.device("cpu") if device is None else device
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise ZbcclInvalidUsageError(f"{op}: {role}[{i}] must be a tensor, got {type(t).__name__}")
        if t.dtype != dtype:
            raise ZbcclInvalidUsageError(f"{op}: {role}[{i}] has the wrong dtype, expected {dtype}, got {t.dtype}")
        if t.device != device:
            raise ZbcclInvalidUsageError(f"{op}: {role}[{i}] is on another device than the op's other tensors, "
                                         f"expected {device}, got {t.device}")


def flat_view(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """A 1-D view over ``tensors`` when they are contiguous and back to back in one storage, else None."""
    if not tensors:
        return None
    first = tensors[0]
    storage = first.untyped_storage()
    isz = first.element_size()
    addr = first.data_ptr()
    for t in tensors:
        if not t.is_contiguous() or t.dtype != first.dtype or t.data_ptr() != addr or (
                t.numel() and t.untyped_storage().data_ptr() != storage.data_ptr()):
            return None
        addr += t.numel() * isz
    total = sum(t.numel() for t in tensors)
    return torch.empty(0, dtype=first.dtype, device=first.device).set_(storage, first.storage_offset(), (total,))


def pack(tensors: Sequence[torch.Tensor], dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
    """The tensors as one flat buffer: a view when possible, else one copy (on a device: into a heap
    tensor, which peers can read; the CPU ops stage a private one themselves)."""
    view = flat_view(tensors)
    if view is not None:
        return view
    if not tensors:
        return torch.empty(0, dtype=dtype, device=device)
    if tensors[0].device.type == "cpu":
        return torch.cat([t.reshape(-1) for t in tensors])
    flat = heap_empty(sum(t.numel() for t in tensors), dtype, tensors[0].device)
    torch.cat([t.reshape(-1) for t in tensors], out=flat)
    return flat


def heap_empty(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``n`` elements a peer can read: a heap tensor on a device, a private one on the CPU (staged by the op)."""
    if device.type == "cpu":
        return torch.empty(n, dtype=dtype)
    from .tensors import empty

    return empty(n, dtype=dtype, device=device)


class Unpacked:
    """A flat output buffer for ``tensors``; :meth:`finish` copies it back unless it was a view."""

    def __init__(self, tensors: Sequence[torch.Tensor], dtype: torch.dtype, device: torch.device | None = None) -> None:
        self.tensors = list(tensors)
        view = flat_view(self.tensors)
        self.is_view = view is not None
        self.flat = view if view is not None else torch.empty(sum(t.numel() for t in self.tensors), dtype=dtype,
                                                              device=device)

    def finish(self) -> None:
        if self.is_view:
            return
        start = 0
        for t in self.tensors:
            n = t.numel()
            t.copy_(self.flat[start:start + n].view(t.shape))
            start += n


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A dtype zbccl's data-movement ops accept: ``t`` itself, or its bytes when zbccl lacks the dtype.

    Only for ops that move data (no arithmetic): complex, float8 and other
    dtypes travel as uint8. A non-contiguous tensor of such a dtype is
    returned as is (the op then names the dtype in its error).
    """
    if t.dtype in DTYPE_CODES or not t.is_contiguous():
        return t
    return t.view(-1).view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)


def as_real(t: torch.Tensor, red: str, *, op: str) -> torch.Tensor:
    """A complex tensor as its real view (``[..., 2]``) for the reducing ops torch does not convert itself.

    Summing the (real, imag) pairs element-wise is the complex sum, so SUM and
    AVG are exact; the other reduce ops have no complex meaning and raise.
    """
    if not t.is_complex():
        return t
    if red not in ("sum", "avg"):
        raise ZbcclInvalidUsageError(f"{op}: unsupported reduce op for a complex tensor, expected SUM or AVG, "
                                     f"got {red.upper()}")
    return torch.view_as_real(t)


def as_bytes_rows(t: torch.Tensor) -> torch.Tensor:
    """:func:`as_bytes` keeping dim 0 (split sizes count rows of dim 0)."""
    if t.dtype in DTYPE_CODES or not t.is_contiguous() or t.dim() == 0:
        return as_bytes(t)
    if t.numel() == 0:  # no bytes move; view(rows, -1) cannot infer -1 of an empty tensor
        return torch.empty((t.shape[0], 0), dtype=torch.uint8, device=t.device)
    return t.view(t.shape[0], -1).view(torch.uint8)


def _length(items, want: int, *, op: str, role: str) -> None:
    if len(items) != want:
        raise ZbcclInvalidUsageError(f"{op}: wrong {role} length, expected {want}, got {len(items)}")


def allgather_list(comm, outs: list[torch.Tensor], inp: torch.Tensor) -> None:
    """Collective: ``outs[r]`` gets rank r's ``inp`` (sizes may differ per rank)."""
    op = "allgather"
    _length(outs, comm.world_size, op=op, role="output list")
    check_dtypes(outs, inp.dtype, op=op, role="output_tensor_list", device=inp.device)
    if outs[comm.rank].numel() != inp.numel():
        raise ZbcclInvalidUsageError(
            f"{op}: output_tensor_list[{comm.rank}] must match this rank's input, expected "
            f"{inp.numel()} elements, got {outs[comm.rank].numel()}")
    sizes = [t.numel() for t in outs]
    out = Unpacked(outs, inp.dtype, inp.device)
    src = inp.reshape(-1)
    if all(s == sizes[0] for s in sizes):
        all_gather_into_tensor(as_bytes(out.flat), as_bytes(src), comm=comm)
    else:
        all_gather_v(out.flat, src, sizes, comm=comm)
    out.finish()


def reduce_scatter_list(comm, out: torch.Tensor, ins: list[torch.Tensor], red: str) -> None:
    """Collective: ``out`` gets the reduction of every rank's ``ins[rank]`` (sizes may differ per rank)."""
    op = "reduce_scatter"
    _length(ins, comm.world_size, op=op, role="input list")
    check_dtypes(ins, out.dtype, op=op, role="input_list", device=out.device)
    sizes = [t.numel() for t in ins]
    if sizes[comm.rank] != out.numel():
        raise ZbcclInvalidUsageError(
            f"{op}: input_list[{comm.rank}] must match the output, expected {out.numel()} elements, "
            f"got {sizes[comm.rank]}")
    flat = pack(ins, out.dtype, out.device)
    dst = out.view(-1) if out.is_contiguous() else out.reshape(-1).clone()
    if all(s == sizes[0] for s in sizes):
        reduce_scatter_tensor(dst, flat, red, comm=comm)
    else:
        reduce_scatter_v(dst, flat, sizes, red, comm=comm)
    if not out.is_contiguous():
        out.copy_(dst.view(out.shape))


def alltoall_list(comm, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> None:
    """Collective: ``outputs[q]`` gets rank q's ``inputs[rank]`` (sizes may differ per pair)."""
    W = comm.world_size
    _length(outputs, W, op="alltoall", role="output list")
    _length(inputs, W, op="alltoall", role="input list")
    dtype = inputs[0].dtype
    device = inputs[0].device if isinstance(inputs[0], torch.Tensor) else None
    check_dtypes(inputs, dtype, op="alltoall", role="input_tensor_list", device=device)
    check_dtypes(outputs, dtype, op="alltoall", role="output_tensor_list", device=device)
    out = Unpacked(outputs, dtype, device)
    all_to_all_single(as_bytes(out.flat), as_bytes(pack(inputs, dtype, device)), [t.numel() for t in outputs],
                      [t.numel() for t in inputs], comm=comm)
    out.finish()


def gather_list(comm, root: int, outs: list[torch.Tensor], inp: torch.Tensor) -> None:
    """Collective: the root's ``outs[r]`` gets rank r's ``inp``; an all_to_all where only the root receives."""
    W, me = comm.world_size, comm.rank
    if me == root:
        _length(outs, W, op="gather", role="output list on the root")
        check_dtypes(outs, inp.dtype, op="gather", role="gather_list", device=inp.device)
    else:
        outs = []
    out = Unpacked(outs, inp.dtype, inp.device)
    in_splits = [inp.numel() if r == root else 0 for r in range(W)]
    out_splits = [t.numel() for t in outs] if me == root else [0] * W
    all_to_all_single(as_bytes(out.flat), as_bytes(inp.reshape(-1)), out_splits, in_splits, comm=comm)
    out.finish()


def scatter_list(comm, root: int, out: torch.Tensor, ins: list[torch.Tensor]) -> None:
    """Collective: rank r's ``out`` gets the root's ``ins[r]``; an all_to_all where only the root sends."""
    W, me = comm.world_size, comm.rank
    if me == root:
        _length(ins, W, op="scatter", role="input list on the root")
        check_dtypes(ins, out.dtype, op="scatter", role="scatter_list", device=out.device)
    else:
        ins = []
    dst = Unpacked([out], out.dtype, out.device)
    in_splits = [t.numel() for t in ins] if me == root else [0] * W
    out_splits = [out.numel() if r == root else 0 for r in range(W)]
    all_to_all_single(as_bytes(dst.flat), as_bytes(pack(ins, out.dtype, out.device)), out_splits, in_splits, comm=comm)
    dst.finish()


def reduce_to(comm, root: int, t: torch.Tensor, red: str) -> None:
    """Collective: the root's ``t`` gets the reduction of every rank's ``t``; the others' are unchanged.

    A reduce_scatter (rank r reduces slice r into a private ``numel / world`` temporary) and an
    all_to_all in which only the root receives, straight into its tensor: no full copy anywhere.
    A non-contiguous tensor takes a full all_reduce on a contiguous copy instead.
    """
    from ..ops import all_reduce

    W, me = comm.world_size, comm.rank
    if not t.is_contiguous():
        tmp = heap_empty(t.numel(), t.dtype, t.device).view(t.shape) if t.device.type != "cpu" else t.contiguous()
        if tmp.device.type != "cpu":
            tmp.copy_(t)
        all_reduce(tmp, red, comm=comm)
        if me == root:
            t.copy_(tmp)
        return
    flat = t.view(-1)
    n = flat.numel()
    counts = [n // W + (1 if r < n % W else 0) for r in range(W)]
    part = heap_empty(counts[me], t.dtype, t.device)  # the all_to_all's input: peers (the root) read it
    reduce_scatter_v(part, flat, counts, red, comm=comm)
    out = flat if me == root else torch.empty(0, dtype=t.dtype, device=t.device)
    all_to_all_single(out, part, counts if me == root else [0] * W, [counts[me] if r == root else 0 for r in range(W)],
                      comm=comm)
