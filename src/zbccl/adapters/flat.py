"""Tensor lists as one flat buffer: the process group's list forms ride on zbccl's flat ops.

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
from ..ops.dtypes import DTYPE_CODES

__all__ = ["flat_view", "pack", "Unpacked", "as_bytes", "check_dtypes"]


def check_dtypes(tensors: Sequence[torch.Tensor], dtype: torch.dtype, *, op: str, role: str) -> None:
    """Raise on every rank alike when a list mixes dtypes (the flat buffer has one dtype)."""
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise ZbcclInvalidUsageError(f"{op}: {role}[{i}] must be a tensor, got {type(t).__name__}")
        if t.dtype != dtype:
            raise ZbcclInvalidUsageError(f"{op}: {role}[{i}] has the wrong dtype, expected {dtype}, got {t.dtype}")
        if t.device.type != "cpu":
            raise ZbcclInvalidUsageError(f"{op}: {role}[{i}] must be a CPU tensor, got device {t.device}")


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
    return torch.empty(0, dtype=first.dtype).set_(storage, first.storage_offset(), (total,))


def pack(tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The tensors as one flat buffer: a view when possible, else one copy."""
    view = flat_view(tensors)
    if view is not None:
        return view
    if not tensors:
        return torch.empty(0, dtype=dtype)
    return torch.cat([t.reshape(-1) for t in tensors])


class Unpacked:
    """A flat output buffer for ``tensors``; :meth:`finish` copies it back unless it was a view."""

    def __init__(self, tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> None:
        self.tensors = list(tensors)
        view = flat_view(self.tensors)
        self.is_view = view is not None
        self.flat = view if view is not None else torch.empty(sum(t.numel() for t in self.tensors), dtype=dtype)

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
