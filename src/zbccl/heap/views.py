"""Global handles and zero-copy views of any reachable rank's heap.

A :class:`HeapHandle` is the picklable global address of a tensor:
``(rank, offset, shape, stride, dtype)``, the offset counted from the start
of the owner's heap. :func:`view_heap` applies a handle to a rank's heap and
returns a tensor aliasing that memory (the transport's view), after checking
the whole span against that rank's real heap size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ZbcclInvalidUsageError
from .heap import GlobalHeap

__all__ = ["HeapHandle", "view_heap", "live_views"]


@dataclass(frozen=True)
class HeapHandle:
    """Global address of a heap tensor: owner rank (global), byte offset in its heap, layout, and which
    heap (``device``: ``"cpu"``, or ``"cuda"`` for the job's CUDA heap)."""

    rank: int
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str
    device: str = "cpu"

    @property
    def torch_dtype(self) -> torch.dtype:
        dt = getattr(torch, self.dtype, None)
        if not isinstance(dt, torch.dtype):
            raise ZbcclInvalidUsageError(f"peer_tensor: unknown dtype in handle, got {self.dtype!r}")
        return dt

    def span_bytes(self) -> int:
        """Bytes from the first to one past the last element the view can touch."""
        itemsize = self.torch_dtype.itemsize
        if any(s == 0 for s in self.shape):
            return 0
        return (sum((n - 1) * st for n, st in zip(self.shape, self.stride)) + 1) * itemsize


def view_heap(heap: GlobalHeap, rank: int, handle: HeapHandle) -> torch.Tensor:
    """Zero-copy view of ``handle`` applied to global rank ``rank``'s heap (bounds-checked)."""
    if not isinstance(handle, HeapHandle):
        raise ZbcclInvalidUsageError(f"peer_tensor: expected a HeapHandle, got {type(handle).__name__}")
    dtype = handle.torch_dtype
    if len(handle.shape) != len(handle.stride) or any(s < 0 for s in handle.stride + handle.shape):
        raise ZbcclInvalidUsageError(
            f"peer_tensor: malformed handle, expected matching non-negative shape/stride, got {handle}")
    if handle.offset % dtype.itemsize:
        raise ZbcclInvalidUsageError(
            f"peer_tensor: offset not aligned to {dtype}, expected a multiple of {dtype.itemsize}, "
            f"got {handle.offset}")
    if handle.span_bytes() == 0:
        heap.check(rank, handle.offset, 0, op="peer_tensor")
        return torch.empty(handle.shape, dtype=dtype, device=heap.transport.device)
    return heap.view(rank, handle.offset, handle.shape, dtype, stride=handle.stride, op="peer_tensor")


def live_views(heap: GlobalHeap) -> int:
    """How many views of ``heap``'s memory are still alive."""
    return heap.transport.live_views()
