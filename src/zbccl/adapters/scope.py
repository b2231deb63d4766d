"""``with zbccl.heap_scope():`` puts this thread's CPU torch allocations in the rank's heap
(and, when the job has a CUDA heap, its CUDA allocations in that heap: :mod:`.cuda_scope`).

Inside the scope every CPU allocation torch makes *on this thread* (``torch.empty``,
op outputs, ``.clone()``...) is a block of the communicator's shared heap, so a
collective can use it in place. Memory freed anywhere, on any thread, returns to
the heap's SMA. Other threads are not affected.

How it works (``native/csrc/cpu/cpu_alloc_hook.cpp``): a C++ ``c10::Allocator``
replaces torch's CPU allocator once per process and delegates to it outside a
scope. Inside, it serves blocks from a native per-heap front cache (one LIFO
stack per size class), with no Python on a hit. This module owns the policy:

* size classes are the SMA's ``round_size`` values, so a cached block is exactly
  an SMA block; classes above ``_MAX_CACHED_CLASS`` are never cached;
* on a miss the hook calls ``refill`` here (``sma.try_malloc``); 0 means the heap
  is full: non-strict scopes fall back to ordinary memory (counted in the SMA
  with ``record_fallback`` and natively), strict ones raise ``RuntimeError``
  (``torch.OutOfMemoryError``) from the allocating op;
* a free beyond a class's depth or the byte limit calls ``release`` here, which queues
  the offset for ``sma.free`` at the next drain (:mod:`zbccl.heap.releases`: a Ctrl-C is
  never dropped in a callback); callbacks take the GIL themselves and never run under a native lock;
* the native cache is the SMA cache tier ``"heap_scope"``: ``sma.stats()`` counts
  its blocks as cached, and an SMA allocation that would fail drains it first.

Registration is per heap base and idempotent; :func:`unregister_heap` (called by
``zbccl.finalize``) stops the heap being used: later frees of its blocks are
dropped, and allocations in a still-open scope go to ordinary memory.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import threading
from collections import deque
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from .. import env
from ..errors import ZbcclInvalidUsageError, ZbcclSystemError
from ..heap import releases
from ..native import abi

__all__ = ["HOOK_COUNTERS", "TIER_NAME", "HeapScope", "heap_scope", "hook_stats", "unregister_heap"]

_log = logging.getLogger(__name__)

#: Native counters of a registered heap, in ``zbh_stats`` order (defined, with their meanings, in
#: ``native/abi.py``, which also generates the C++ enum).
HOOK_COUNTERS: tuple[str, ...] = tuple(abi.HOOK_COUNTERS)
#: Name of the SMA cache tier the native cache registers as.
TIER_NAME = "heap_scope"

_PRIORITY = 10  # c10 allocator priority; torch's default CPU allocator has 0
_MAX_CACHED_CLASS = 64 << 20  # larger blocks always go back to the SMA on free
_CLASS_BUDGET = 32 << 20  # per-class cached bytes a class aims at: depth = budget // size
_MIN_DEPTH, _MAX_DEPTH = 2, 64
_DRAIN_BATCH = 1024
_KIND = "heap_scope"
_STRICT = 1

_REFILL = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int32)
_RELEASE = ctypes.CFUNCTYPE(None, ctypes.c_uint64)
_u64p = ctypes.POINTER(ctypes.c_uint64)


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    c = ctypes
    sigs = {
        "zbh_install": (c.c_int, [c.c_int]),
        "zbh_register": (c.c_int32, [c.c_uint64, c.c_uint64, _u64p, c.POINTER(c.c_uint32), c.c_uint32,
                                     c.c_uint64, _REFILL, _RELEASE]),
        "zbh_unregister": (c.c_int32, [c.c_int32]),
        "zbh_drain": (c.c_uint64, [c.c_int32, _u64p, c.c_uint64]),
        "zbh_stats": (c.c_int32, [c.c_int32, _u64p, c.c_int32]),
        "zbh_class_size": (c.c_uint64, [c.c_int32, c.c_uint64]),
        "zbh_scope_enter": (c.c_int64, [c.c_int32, c.c_int32]),
        "zbh_scope_exit": (None, [c.c_int64]),
        "zbh_scope_state": (c.c_int64, []),
        "zbh_num_counters": (c.c_int32, []),
    }
    for name, (res, args) in sigs.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    if lib.zbh_num_counters() != len(HOOK_COUNTERS):
        raise ZbcclSystemError(
            f"heap_scope: hook counter table mismatch, expected {len(HOOK_COUNTERS)}, got {lib.zbh_num_counters()}"
        )
    return lib


_lock = threading.Lock()  # guards _lib, _registry, _retired, _atexit_done
_lib: ctypes.CDLL | None = None
_atexit_done = False


def _hook() -> ctypes.CDLL:
    """The hook library, installed as torch's CPU allocator (first call builds it)."""
    global _lib
    if _lib is None:
        from .. import native

        lib = _declare(native.alloc_hook())
        if not lib.zbh_install(_PRIORITY):
            raise ZbcclSystemError(
                "heap_scope: cannot install the CPU allocator hook, expected torch to accept priority "
                f"{_PRIORITY}, got a CPU allocator of higher priority already set"
            )
        _lib = lib
    return _lib


@dataclass(eq=False)
class _Registration:
    """One heap known to the hook; the callbacks must outlive every native use."""

    base: int
    nbytes: int
    heap_id: int
    sma: Any
    refill: Any
    release: Any
    frees: deque  # offsets the native deleter handed back (release is its append), drained with the SMA's

    def counters(self) -> dict[str, int]:
        out = (ctypes.c_uint64 * len(HOOK_COUNTERS))()
        _hook().zbh_stats(self.heap_id, out, len(HOOK_COUNTERS))
        return dict(zip(HOOK_COUNTERS, out))

    def cached(self) -> tuple[int, int]:
        """SMA tier callback: (bytes, blocks) in the native cache."""
        c = self.counters()
        return c["cached_bytes"], c["cached_blocks"]

    def drain(self) -> None:
        """SMA tier callback: hand every cached block back with sma.free."""
        lib, buf = _hook(), (ctypes.c_uint64 * _DRAIN_BATCH)()
        while True:
            k = lib.zbh_drain(self.heap_id, buf, _DRAIN_BATCH)
            for i in range(k):
                self.sma.free(buf[i])  # heap offsets
            if k < _DRAIN_BATCH:
                return


_registry: dict[int, _Registration] = {}  # heap base -> live registration
_retired: list[_Registration] = []  # unregistered: kept so in-flight callbacks stay valid


def _size_classes(sma: Any, heap_bytes: int, max_bytes: int) -> tuple[list[int], list[int], int]:
    """Policy: every SMA size class up to the most the heap may grow to, each class's cache depth, the byte limit."""
    sizes: list[int] = []
    size = sma.round_size(1)
    while size <= max_bytes:
        sizes.append(size)
        size = sma.round_size(size + 1)
    depth = [
        0 if s > _MAX_CACHED_CLASS else max(_MIN_DEPTH, min(_MAX_DEPTH, _CLASS_BUDGET // s)) for s in sizes
    ]
    limit = min(env.SMA_CACHE_LIMIT.get(), heap_bytes // 2)
    return sizes, depth, limit


def _callbacks(sma: Any, frees: deque) -> tuple[Any, Any]:
    """ctypes callbacks the hook calls on a miss (refill) and on an uncached free (release), in heap offsets
    (the hook turns them into addresses).

    Whatever a ctypes callback raises, ctypes prints and drops, a Ctrl-C's ``KeyboardInterrupt`` included.
    So the release runs no Python code: it is ``frees.append`` (C), and the offsets go back to the SMA at
    the next drain (:mod:`zbccl.heap.releases`, SIGINT held meanwhile). The refill must allocate: a
    ``KeyboardInterrupt`` it catches is noted and delivered by the next drain, and the allocation is tried
    again (the interrupt is not a full heap)."""

    def refill(size: int, requested: int, flags: int) -> int:
        for _ in range(2):
            try:  # nothing may propagate into C; a failure is "heap full"
                # round_size(requested) == size: the hook's classes are round_size values.
                with releases.in_callback():
                    offset = sma.try_malloc(requested, kind=_KIND)
                if offset is None and not flags & _STRICT:
                    sma.record_fallback(requested)
            except KeyboardInterrupt:
                releases.note_interrupt()
                continue
            except BaseException:  # noqa: BLE001
                _log.exception("heap_scope: refill of %d bytes failed; treating the heap as full", size)
                return -1
            return -1 if offset is None else offset
        return -1

    return _REFILL(refill), _RELEASE(frees.append)


def _register(comm: Any) -> _Registration:
    """Register ``comm``'s heap with the hook (idempotent per heap base and SMA)."""
    global _atexit_done
    base, nbytes, sma = int(comm.heap_base), int(comm.heap_bytes), comm.sma
    max_bytes = int(getattr(comm, "heap_max_bytes", nbytes))  # the hook's range: the heap may grow to it
    reg = _registry.get(base)
    if reg is not None and reg.sma is sma:
        return reg
    with _lock:
        reg = _registry.get(base)
        if reg is not None and reg.sma is sma:
            return reg
        if reg is not None:  # a new heap at an old heap's address, never unregistered
            _unregister_locked(reg)
        lib = _hook()
        sizes, depth, limit = _size_classes(sma, nbytes, max_bytes)
        frees: deque = deque()
        releases.add_queue(frees, sma.free)
        refill, release = _callbacks(sma, frees)
        hid = lib.zbh_register(base, max_bytes, (ctypes.c_uint64 * len(sizes))(*sizes),
                               (ctypes.c_uint32 * len(depth))(*depth), len(sizes), limit, refill, release)
        if hid <= 0:
            raise ZbcclSystemError(
                f"heap_scope: cannot register heap {base:#x}+{nbytes}, expected a heap id, got error {hid}"
            )
        reg = _Registration(base, max_bytes, hid, sma, refill, release, frees)
        sma.add_cache_tier(TIER_NAME, cached=reg.cached, drain=reg.drain)
        _registry[base] = reg
        if not _atexit_done:  # frees during interpreter teardown must not call into Python
            atexit.register(_unregister_all)
            _atexit_done = True
        from ..runtime.state import add_finalize_hook, add_fork_hook

        add_finalize_hook(_on_finalize)
        add_fork_hook(_on_fork)
        return reg


def _on_finalize(heap: Any) -> None:
    """``zbccl.finalize`` hook: detach the hook from the heap before it goes away."""
    unregister_heap(heap.heap_base)


def _on_finalize_cuda(heap: Any) -> None:
    """``zbccl.finalize`` hook: end the CUDA heaps' pools before the heaps go away."""
    from .cuda_scope import detach_all

    detach_all()


def _on_fork(heap: Any) -> None:
    """Fork hook, in the child: stop serving the parent's heap (its blocks are the parent's too).

    Takes no Python lock (another thread may have held one at fork); scopes open
    across the fork then allocate ordinary memory.
    """
    if _lib is not None:
        for reg in list(_registry.values()):
            _lib.zbh_unregister(reg.heap_id)


def _unregister_locked(reg: _Registration) -> None:
    _registry.pop(reg.base, None)
    _retired.append(reg)
    _hook().zbh_unregister(reg.heap_id)
    try:
        releases.remove_queue(reg.frees)
        reg.drain()
        reg.sma.remove_cache_tier(TIER_NAME)
    except Exception:  # noqa: BLE001 - teardown is best effort
        _log.exception("heap_scope: returning cached blocks of heap %#x failed", reg.base)


def unregister_heap(base: int) -> None:
    """Stop using the heap at ``base`` (idempotent; a no-op if it was never registered).

    Cached blocks go back to the SMA and its cache tier is removed. Afterwards,
    frees of the heap's blocks still alive are dropped (never cached, never
    given to a later heap at the same address), and allocations inside a scope
    still open on it go to ordinary memory. Called by ``zbccl.finalize``.
    """
    with _lock:
        reg = _registry.get(int(base))
        if reg is not None:
            _unregister_locked(reg)


def _unregister_all() -> None:
    from ..runtime.state import in_forked_child

    if in_forked_child():  # the fork hook detached already; _lock may be held by a thread gone at fork
        return
    with _lock:
        for reg in list(_registry.values()):
            _unregister_locked(reg)


def _resolve(comm: Any) -> Any:
    """A Communicator (``None``: the default one), or any object with ``sma``, ``heap_base``, ``heap_bytes``."""
    from ..runtime.communicator import Communicator

    if comm is None or isinstance(comm, Communicator):
        from ..runtime.state import in_forked_child, resolve_comm

        if in_forked_child():
            return None  # a forked child may not use the parent's heap: ordinary memory
        return resolve_comm(comm)
    return comm


# Every thread's open scopes, oldest first: ``[scope object, heap id (0: ordinary memory), strict, cuda token]``
# (the cuda token: :func:`.cuda_scope.enter`'s, None when the job has no CUDA heap).
# The native state is always the top entry's; exiting removes the exiting scope's own entry wherever it is
# (generators and ExitStacks may close scopes in any order), so what stays open stays in force.
_open = threading.local()


def _open_scopes() -> list[list]:
    stack = getattr(_open, "stack", None)
    if stack is None:
        stack = _open.stack = []
    return stack


def _apply(stack: list[list]) -> None:
    """Set this thread's native scope state to the innermost scope still open (none: ordinary memory)."""
    if stack and (stack[-1][1] or _lib is not None):
        _hook().zbh_scope_enter(stack[-1][1], stack[-1][2])
    elif _lib is not None:
        _lib.zbh_scope_exit(0)
    # else: ordinary CPU memory and the hook was never installed (a CUDA-only scope needs no native build)


class HeapScope:
    """Context manager returned by :func:`heap_scope`; reusable, nestable, per thread, closable in any order."""

    def __init__(self, comm: Any = None, *, strict: bool = False, device: str | None = None) -> None:
        if device not in (None, "cpu", "cuda"):
            raise ZbcclInvalidUsageError(f"heap_scope: bad device, expected None (all), 'cpu' or 'cuda', got {device!r}")
        self._comm = comm
        self._strict = bool(strict)
        self._device = device

    def __enter__(self) -> HeapScope:
        comm = _resolve(self._comm)
        cpu = self._device in (None, "cpu")
        heap_id = _register(comm).heap_id if comm is not None and cpu else 0  # 0: ordinary memory
        cuda = None
        dh = getattr(getattr(comm, "_ctx", None), "device_heaps", {}).get("cuda")
        if dh is None and self._device == "cuda" and comm is not None:
            comm.device_heap("cuda", op="heap_scope")  # raises: this job has no CUDA heap
        if dh is not None and self._device in (None, "cuda"):
            from ..runtime.state import add_finalize_hook
            from .cuda_scope import enter

            add_finalize_hook(_on_finalize_cuda)
            cuda = enter(dh, self._strict)
        stack = _open_scopes()
        stack.append([self, heap_id, int(self._strict), cuda])
        _apply(stack)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        stack = _open_scopes()
        for i in range(len(stack) - 1, -1, -1):  # this object's latest entry on this thread
            if stack[i][0] is self:
                cuda = stack.pop(i)[3]
                if cuda is not None:
                    from .cuda_scope import exit_scope

                    exit_scope(cuda)
                break
        else:  # a thread's allocator state is its own: another thread cannot end the scope
            raise ZbcclInvalidUsageError(
                "heap_scope: exit on a thread that did not enter this scope, expected the entering thread to "
                "exit it, got a thread where it is not open")
        _apply(stack)
        releases.drain()  # the frees of the scope's tensors, and a Ctrl-C a refill caught: raised here


def heap_scope(comm: Any = None, *, strict: bool = False, device: str | None = None) -> HeapScope:
    """Within ``with heap_scope(comm):`` this thread's CPU torch allocations live in ``comm``'s heap,
    and its CUDA allocations in the job's CUDA heap when it has one (``init(device="cuda")``; through a
    ``torch.cuda.MemPool``, see :mod:`zbccl.adapters.cuda_scope`).

    Covers every CPU allocation torch makes on the calling thread: factory
    functions, op outputs, clones, resizes. Other threads (and allocations
    torch delegates to its own worker threads) are unaffected; tensors may be
    freed anywhere and their blocks return to the heap's SMA. Scopes nest (the
    innermost wins) and the returned object may be re-entered. Not a
    collective: no peer is involved, nothing blocks. Scopes may close in any
    order (two generators, an ``ExitStack``): the innermost scope still open
    stays in force, and none open means ordinary memory. The first use builds and
    installs a native allocator hook (cached on disk, a few seconds).

    Args:
        comm: a Communicator, or None for the default one (raises
            ZbcclInvalidUsageError if zbccl is not initialized).
        strict: (keyword-only) when the heap is full, raise ``RuntimeError`` (a
            ``torch.OutOfMemoryError`` whose message starts with
            ``heap_scope: heap out of memory (strict=True)``) from the
            allocating op, instead of falling back to ordinary memory
            (counted in ``fallback_allocs`` of the SMA's stats). On CUDA the
            allocation fails with torch's CUDA out-of-memory error instead.
        device: (keyword-only) None (default): CPU allocations, and CUDA ones when
            the job has a CUDA heap; ``"cpu"``: only CPU ones; ``"cuda"``: only CUDA
            ones (no native CPU hook is built; a clear error without a CUDA heap).
    """
    return HeapScope(comm, strict=strict, device=device)


def hook_stats(comm: Any = None) -> dict[str, int]:
    """Native counters (:data:`HOOK_COUNTERS`) of ``comm``'s heap; all zero if never used in a scope."""
    c = _resolve(comm)
    reg = _registry.get(int(c.heap_base)) if c is not None else None
    return reg.counters() if reg is not None else dict.fromkeys(HOOK_COUNTERS, 0)
