"""Explicit heap tensors and global handles (the torch side of the heap).

``zbccl.empty`` carves a block from this rank's SMA and wraps it zero-copy
as a view the heap's transport makes of the block. The transport's view owns
the storage: when the last tensor (or view) using it dies, the block returns
to the SMA. No explicit free exists.

A :class:`~zbccl.heap.views.HeapHandle` is the picklable global address of a
tensor; ``Communicator.peer_tensor`` turns it back into a bounds-checked view.
"""

from __future__ import annotations

import math

import torch

from ..errors import ZbcclInvalidUsageError
from ..heap.views import HeapHandle
from ..runtime.communicator import Communicator
from ..runtime.state import get_default, resolve_comm

__all__ = [
    "HeapHandle", "empty", "zeros", "empty_like", "is_heap_tensor", "export", "memory_stats", "memory_snapshot",
]

def _shape(size: tuple) -> tuple[int, ...]:
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    shape = tuple(int(s) for s in size)
    if any(s < 0 for s in shape):
        raise ZbcclInvalidUsageError(f"empty: negative dimension, got shape {shape}")
    return shape


def _check_device(device: torch.device | str | None, op: str) -> None:
    if device is None:
        return
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError) as exc:
        raise ZbcclInvalidUsageError(f"{op}: bad device, expected 'cpu', got {device!r} ({exc})") from None
    if kind != "cpu":
        raise ZbcclInvalidUsageError(
            f"{op}: the heap holds CPU tensors only (a CUDA heap is planned), expected device 'cpu', got {device!r}")


def empty(*size, dtype: torch.dtype | None = None, device: torch.device | str | None = None,
          comm: Communicator | None = None) -> torch.Tensor:
    """A contiguous, uninitialised CPU tensor in this rank's heap.

    Not collective. Its memory returns to the SMA when the last reference
    dies. ``device``: ``"cpu"`` or None (the heap is CPU memory; any other device is refused).
    Raises :class:`~zbccl.errors.ZbcclOutOfMemoryError` when the heap is full.
    """
    _check_device(device, "empty")
    comm = resolve_comm(comm, op="empty")
    shape = _shape(size)
    dtype = dtype or torch.get_default_dtype()
    nbytes = math.prod(shape) * dtype.itemsize
    sma = comm.sma
    offset = sma.malloc(max(nbytes, 1), kind="explicit")
    heap = comm.heap
    return heap.view(heap.rank, offset, shape, dtype, release=lambda: sma.free(offset), op="empty")


def zeros(*size, dtype: torch.dtype | None = None, device: torch.device | str | None = None,
          comm: Communicator | None = None) -> torch.Tensor:
    """Like :func:`empty`, filled with zeros (cached blocks are reused dirty)."""
    return empty(*size, dtype=dtype, device=device, comm=comm).zero_()


def empty_like(t: torch.Tensor, *, dtype: torch.dtype | None = None, device: torch.device | str | None = None,
               comm: Communicator | None = None) -> torch.Tensor:
    """A contiguous heap tensor with ``t``'s shape and dtype (or ``dtype``); always on the CPU."""
    return empty(tuple(t.shape), dtype=dtype or t.dtype, device=device, comm=comm)


def is_heap_tensor(t: torch.Tensor, comm: Communicator | None = None) -> bool:
    """True if ``t``'s whole storage lies in this rank's heap (False if zbccl is not initialized)."""
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
        return False
    if comm is None and get_default() is None:
        return False
    return resolve_comm(comm).heap.offset_of(t) >= 0


def export(t: torch.Tensor, comm: Communicator | None = None) -> HeapHandle:
    """The :class:`HeapHandle` of a tensor in this rank's heap. Not collective.

    Raises :class:`~zbccl.errors.ZbcclInvalidUsageError` for a tensor outside the heap.
    """
    c = resolve_comm(comm)
    offset = c.heap.offset_of(t) if isinstance(t, torch.Tensor) else -1
    if offset < 0:
        raise ZbcclInvalidUsageError(
            "export: tensor is not in this rank's heap, expected one from zbccl.empty()/zeros() or "
            f"heap_scope(), got a {t.device.type} tensor at {t.data_ptr():#x}")
    return HeapHandle(rank=c.global_rank, offset=offset, shape=tuple(t.shape),
                      stride=tuple(t.stride()), dtype=str(t.dtype).removeprefix("torch."))


def memory_stats(comm: Communicator | None = None) -> dict:
    """This rank's heap statistics. Not collective.

    The SMA's keys (documented in ``zbccl.sma.STAT_KEYS``), plus the ``heap_scope`` allocator
    hook's native counters prefixed ``scope_`` (``scope_hits``: allocations its native cache
    served without entering Python or the SMA, ``scope_misses``, ... see
    ``zbccl.adapters.scope.HOOK_COUNTERS``).
    """
    from .scope import hook_stats

    c = resolve_comm(comm)
    stats = c.sma.stats()
    stats.update({f"scope_{k}": v for k, v in hook_stats(c).items()})
    return stats


def memory_snapshot(comm: Communicator | None = None) -> list[dict]:
    """Live and cached heap blocks of this rank, sorted by offset, for debugging."""
    return resolve_comm(comm).sma.snapshot()
