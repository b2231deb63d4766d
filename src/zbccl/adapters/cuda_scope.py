"""``heap_scope`` on CUDA: this thread's CUDA allocations go to the job's CUDA heap through a ``torch.cuda.MemPool``.

One pool per CUDA heap, made on first use: ``torch.cuda.MemPool`` over a
pluggable allocator (``torch._C._cuda_customAllocator``) whose ``alloc`` and
``free`` are ctypes callbacks into the heap's SMA (no shared library, as
torch's own ``_use_uvm``). While a scope is open, ``torch.cuda.use_mem_pool``
routes every CUDA allocation of the thread to the pool: torch's caching
allocator asks the callbacks for *segments* (a request rounded to torch's
segment sizes: 2 MiB, 20 MiB, or the request rounded to 2 MiB) and carves
tensors from them, caching freed blocks inside the pool for the next scope; a
segment goes back to the SMA only when torch releases the pool's free segments,
which it does once the pool has ended (``zbccl.finalize`` ends it, then empties
torch's cache). Every tensor made in the scope therefore
lies in the heap: ``zbccl.export`` works on it, a collective uses it in place
(``staged_bytes`` does not move).

When the heap is full, a non-strict scope falls back to ordinary device memory
(``cuMemAlloc``, counted as ``fallback_*`` in the SMA and ``scope_fallback_*``);
a strict one makes the allocation fail (torch raises its CUDA out-of-memory
error, and the log says why). The CFUNCTYPE objects live as long as the
process: torch may call them until it exits.

Callbacks run on the allocating thread with torch's allocator lock held and take
the GIL (as with any Python allocator hook): a thread that holds the GIL while
it waits for that lock would deadlock, which torch's ops avoid by releasing the
GIL around allocation.

Works with torch 2.11 and later (``MemPool(allocator=)``, ``use_mem_pool``,
``_cuda_customAllocator``, all feature-detected: a clear error names what is missing).
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from ..errors import ZbcclSystemError

__all__ = ["POOL_COUNTERS", "enter", "exit_scope", "pool_stats", "detach_all", "ALLOC_FN", "FREE_FN"]

_log = logging.getLogger(__name__)

#: ``void* alloc(size_t size, int device, cudaStream_t stream)``, as torch's pluggable allocator calls it.
ALLOC_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
#: ``void free(void* ptr, size_t size, int device, cudaStream_t stream)``.
FREE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
#: Counters of a CUDA heap's pool (``memory_stats(device="cuda")`` shows them prefixed ``scope_``).
POOL_COUNTERS = ("segments", "segment_bytes", "live_segments", "fallback_segments", "fallback_bytes", "refused")

_KEEP: list = []  # every callback pair ever handed to torch: never collected
_lock = threading.Lock()
_strict = threading.local()  # this thread's open CUDA scopes' strict flags, innermost last


@dataclass(eq=False)
class _Pool:
    """One CUDA heap's pool and the state its callbacks share."""

    sma: Any
    base: int
    device: int
    pool: Any = None
    retired: bool = False
    live: dict[int, int] = field(default_factory=dict)  # heap segment address -> bytes
    foreign: dict[int, int] = field(default_factory=dict)  # fallback address -> bytes
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(POOL_COUNTERS, 0))
    mutex: threading.Lock = field(default_factory=threading.Lock)


_pools: dict[int, _Pool] = {}  # id(sma) -> its pool
_atexit_done = False


def _thread_strict() -> bool:
    stack = getattr(_strict, "stack", None)
    return bool(stack and stack[-1][0])


def callbacks(p: _Pool, *, fallback_alloc=None, fallback_free=None) -> tuple[Any, Any]:
    """The ctypes ``(alloc, free)`` pair over ``p`` (kept alive for the process). The fallbacks default to
    ``cuMemAlloc``/``cuMemFree``."""
    if fallback_alloc is None or fallback_free is None:
        from ..heap.transports.cuda import vmm

        fallback_alloc, fallback_free = vmm.mem_alloc, vmm.mem_free

    def alloc(size: int, device: int, stream: int | None) -> int:
        try:  # nothing may propagate into C: 0 is "out of memory" to torch
            if p.retired or device != p.device:  # after finalize (or another device): ordinary memory
                ptr = fallback_alloc(size)
                with p.mutex:
                    p.foreign[ptr] = size
                    p.counts["fallback_segments"] += 1
                    p.counts["fallback_bytes"] += size
                return ptr
            offset = p.sma.try_malloc(size, kind="heap_scope")
            if offset is not None:
                with p.mutex:
                    p.live[p.base + offset] = size
                    p.counts["segments"] += 1
                    p.counts["segment_bytes"] += size
                return p.base + offset
            if _thread_strict():
                p.counts["refused"] += 1
                _log.error("heap_scope: heap out of memory (strict=True): no block of %d bytes in the cuda heap "
                           "(%s); torch raises its CUDA out-of-memory error", size, p.sma.stats()["free_bytes"])
                return 0
            ptr = fallback_alloc(size)
            with p.mutex:
                p.foreign[ptr] = size
                p.counts["fallback_segments"] += 1
                p.counts["fallback_bytes"] += size
            p.sma.record_fallback(size)
            return ptr
        except BaseException:  # noqa: BLE001
            _log.exception("heap_scope: cuda segment of %d bytes failed; treating it as out of memory", size)
            return 0

    def free(ptr: int | None, size: int, device: int, stream: int | None) -> None:
        try:
            if not ptr:
                return
            with p.mutex:
                foreign = p.foreign.pop(ptr, None)
                mine = p.live.pop(ptr, None)
            if foreign is not None:
                fallback_free(ptr)
            elif mine is not None and not p.retired:
                p.sma.free(ptr - p.base)
        except BaseException:  # noqa: BLE001
            _log.exception("heap_scope: returning cuda segment %#x failed; segment leaked", ptr or 0)

    pair = (ALLOC_FN(alloc), FREE_FN(free))
    _KEEP.append(pair)
    return pair


def _torch_pool_api() -> tuple[Any, Any, Any]:
    import torch

    api = (getattr(torch.cuda, "MemPool", None), getattr(torch.cuda, "use_mem_pool", None),
           getattr(torch._C, "_cuda_customAllocator", None))
    if any(a is None for a in api):
        missing = [n for n, a in zip(("torch.cuda.MemPool", "torch.cuda.use_mem_pool",
                                      "torch._C._cuda_customAllocator"), api) if a is None]
        raise ZbcclSystemError(
            f"heap_scope: CUDA allocations cannot be routed to the heap, expected torch >= 2.6 built with CUDA, "
            f"got torch {torch.__version__} without {missing}")
    return api


def _pool_of(dh: Any) -> _Pool:
    p = _pools.get(id(dh.sma))
    if p is not None and not p.retired:
        return p
    with _lock:
        p = _pools.get(id(dh.sma))
        if p is not None and not p.retired:
            return p
        mem_pool, _, custom = _torch_pool_api()
        p = _Pool(dh.sma, int(dh.heap.heap_base), int(dh.device.index))
        c_alloc, c_free = callbacks(p)
        allocator = custom(ctypes.cast(c_alloc, ctypes.c_void_p).value, ctypes.cast(c_free, ctypes.c_void_p).value)
        _KEEP.append(allocator)
        p.pool = mem_pool(allocator=allocator)
        _pools[id(dh.sma)] = p
        global _atexit_done
        if not _atexit_done:  # end the pools while Python still runs (torch must not call back later)
            atexit.register(detach_all)
            _atexit_done = True
        return p


def enter(dh: Any, strict: bool) -> tuple[Any, Any, list]:
    """Route this thread's CUDA allocations on ``dh``'s device to its heap; returns the token for :func:`exit_scope`."""
    import torch

    p = _pool_of(dh)
    _, use_mem_pool, _ = _torch_pool_api()
    ctx = use_mem_pool(p.pool, device=torch.device("cuda", p.device))
    ctx.__enter__()
    stack = getattr(_strict, "stack", None)
    if stack is None:
        stack = _strict.stack = []
    flag = [bool(strict)]  # removed by identity: scopes may close in any order
    stack.append(flag)
    return ctx, p, flag


def exit_scope(token: tuple[Any, Any, list]) -> None:
    ctx, _, flag = token
    stack = getattr(_strict, "stack", None) or []
    for i in range(len(stack) - 1, -1, -1):
        if stack[i] is flag:
            del stack[i]
            break
    ctx.__exit__(None, None, None)


def pool_stats(sma: Any) -> dict[str, int]:
    """The pool counters of the CUDA heap whose SMA is ``sma`` (zeros if no scope used it)."""
    p = _pools.get(id(sma))
    if p is None:
        return dict.fromkeys(POOL_COUNTERS, 0)
    with p.mutex:
        out = dict(p.counts)
        out["live_segments"] = len(p.live)
    return out


def detach_all() -> None:
    """``zbccl.finalize``: end every pool (torch frees its unused segments back to the SMA now), then stop
    serving the heap: later frees of its segments still alive are dropped, and allocations in a scope still
    open go to ordinary memory (as the CPU hook does)."""
    import torch

    with _lock:
        pools = [p for p in _pools.values() if not p.retired]
        for p in pools:
            p.pool = None  # torch releases the pool once no tensor of it is alive
        if pools and torch.cuda.is_initialized():
            try:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            except Exception as exc:  # noqa: BLE001 - teardown goes on
                _log.warning("heap_scope: releasing the cuda pool's segments failed: %s", exc)
        for p in pools:
            p.retired = True
        _pools.clear()
