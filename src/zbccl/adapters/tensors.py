"""Explicit heap tensors and global handles (the torch side of the heap).

``zbccl.empty`` carves a block from this rank's SMA and wraps it zero-copy
as a view the heap's transport makes of the block. The transport's view owns
the storage: when the last tensor (or view) using it dies, the block returns
to the SMA. No explicit free exists.

A :class:`~zbccl.heap.views.HeapHandle` is the picklable global address of a
tensor; ``Communicator.peer_tensor`` turns it back into a bounds-checked view.

``device="cuda"`` does the same on the job's CUDA heap (``init(device="cuda")``,
:mod:`zbccl.runtime.device_heap`): the tensor is a CUDA tensor in this rank's
CUDA heap, its handle says ``device="cuda"``, and a peer's view of it is a
CUDA tensor aliasing the peer's device memory.
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


def _heap_of(comm: Communicator, device: torch.device | str | None, op: str):
    """``(heap, sma)`` of ``device``: the CPU heap for None/cpu, the job's CUDA heap for cuda."""
    if device is None:
        return comm.heap, comm.sma
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError) as exc:
        raise ZbcclInvalidUsageError(f"{op}: bad device, expected 'cpu' or 'cuda', got {device!r} ({exc})") from None
    if kind == "cpu":
        return comm.heap, comm.sma
    if kind != "cuda":
        raise ZbcclInvalidUsageError(f"{op}: no heap on that device, expected 'cpu' or 'cuda', got {device!r}")
    dh = comm.device_heap(device, op=op)
    return dh.heap, dh.sma


def empty(*size, dtype: torch.dtype | None = None, device: torch.device | str | None = None,
          comm: Communicator | None = None) -> torch.Tensor:
    """A contiguous, uninitialised tensor in this rank's heap: the CPU heap, or the CUDA heap for ``device="cuda"``.

    Not collective. Its memory returns to the SMA when the last reference
    dies. ``device``: None or ``"cpu"`` (the CPU heap), ``"cuda"``/``"cuda:N"``
    (the job's CUDA heap, on the device it was built on; a clear error when
    init built none). Raises :class:`~zbccl.errors.ZbcclOutOfMemoryError` when the heap is full.
    """
    comm = resolve_comm(comm, op="empty")
    heap, sma = _heap_of(comm, device, "empty")
    shape = _shape(size)
    dtype = dtype or torch.get_default_dtype()
    nbytes = math.prod(shape) * dtype.itemsize
    offset = sma.malloc(max(nbytes, 1), kind="explicit")
    try:
        return heap.view(heap.rank, offset, shape, dtype, release=lambda: sma.free(offset), op="empty")
    except BaseException:
        sma.free(offset)
        raise


def zeros(*size, dtype: torch.dtype | None = None, device: torch.device | str | None = None,
          comm: Communicator | None = None) -> torch.Tensor:
    """Like :func:`empty`, filled with zeros (cached blocks are reused dirty)."""
    return empty(*size, dtype=dtype, device=device, comm=comm).zero_()


def empty_like(t: torch.Tensor, *, dtype: torch.dtype | None = None, device: torch.device | str | None = None,
               comm: Communicator | None = None) -> torch.Tensor:
    """A contiguous heap tensor with ``t``'s shape and dtype (or ``dtype``), on ``device``: by default
    ``t``'s device, as ``torch.empty_like`` (a CUDA ``t``: the job's CUDA heap, a clear error when it has
    none; pass ``device="cpu"`` for a CPU twin)."""
    if device is None and isinstance(t, torch.Tensor) and t.device.type == "cuda":
        device = t.device
    return empty(tuple(t.shape), dtype=dtype or t.dtype, device=device, comm=comm)


def _locate(c: Communicator, t: torch.Tensor) -> tuple[str, int]:
    """``(heap name, offset)`` of the heap of ``c``'s job whose memory holds ``t``'s whole storage, else ``("", -1)``.

    Each heap's transport checks the device itself, so a tensor is found in the heap that really holds it.
    """
    for name, heap in [("cpu", c.heap)] + [(k, dh.heap) for k, dh in c._ctx.device_heaps.items()]:
        offset = heap.offset_of(t)
        if offset >= 0:
            return name, offset
    return "", -1


def is_heap_tensor(t: torch.Tensor, comm: Communicator | None = None) -> bool:
    """True if ``t``'s whole storage lies in one of this rank's heaps (CPU, CUDA) (False if zbccl is not initialized)."""
    if not isinstance(t, torch.Tensor):
        return False
    if comm is None and get_default() is None:
        return False
    return _locate(resolve_comm(comm), t)[1] >= 0


def export(t: torch.Tensor, comm: Communicator | None = None) -> HeapHandle:
    """The :class:`HeapHandle` of a tensor in one of this rank's heaps (``handle.device`` names which). Not collective.

    Raises :class:`~zbccl.errors.ZbcclInvalidUsageError` for a tensor outside the heaps.
    """
    c = resolve_comm(comm)
    if not isinstance(t, torch.Tensor):
        raise ZbcclInvalidUsageError(f"export: expected a torch.Tensor, got {type(t).__name__}")
    kind, offset = _locate(c, t)
    if offset < 0:
        raise ZbcclInvalidUsageError(
            f"export: tensor is not in this rank's heap, expected one from zbccl.empty()/zeros() or "
            f"heap_scope() (device cpu{', cuda' if 'cuda' in c._ctx.device_heaps else ''}), got a "
            f"{t.device} tensor at {t.data_ptr():#x}")
    return HeapHandle(rank=c.global_rank, offset=offset, shape=tuple(t.shape),
                      stride=tuple(t.stride()), dtype=str(t.dtype).removeprefix("torch."), device=kind)


def memory_stats(comm: Communicator | None = None, *, device: torch.device | str | None = None) -> dict:
    """This rank's heap statistics (of the CPU heap, or of the CUDA heap with ``device="cuda"``). Not collective.

    The SMA's keys (documented in ``zbccl.sma.STAT_KEYS``; ``staged_bytes``: what
    collectives still had to copy into that heap), plus the ``heap_scope``
    counters prefixed ``scope_``: for the CPU heap the native hook's
    (``scope_hits``: allocations its native cache served without entering
    Python or the SMA, ``scope_misses``, ... see ``zbccl.adapters.scope.HOOK_COUNTERS``),
    for the CUDA heap the memory pool's (``zbccl.adapters.cuda_scope.POOL_COUNTERS``).
    """
    from .scope import hook_stats

    c = resolve_comm(comm)
    heap, sma = _heap_of(c, device, "memory_stats")
    stats = sma.stats()
    if heap is c.heap:
        stats.update({f"scope_{k}": v for k, v in hook_stats(c).items()})
    else:
        from .cuda_scope import pool_stats

        stats.update({f"scope_{k}": v for k, v in pool_stats(sma).items()})
    return stats


def memory_snapshot(comm: Communicator | None = None, *, device: torch.device | str | None = None) -> list[dict]:
    """Live and cached heap blocks of this rank (CPU heap, or ``device="cuda"``), sorted by offset, for debugging."""
    return _heap_of(resolve_comm(comm), device, "memory_snapshot")[1].snapshot()
