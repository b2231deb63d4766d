"""Launchers: one function per kernel, over int64 pointer tables, offsets and plain tensors.

No zbccl runtime knowledge here (the ops layer validates and plans; see ``ops/device.py``). Every
launcher enqueues one kernel on the current stream (on CUDA) and returns at once; under
``TRITON_INTERPRET=1`` the kernel runs to completion on the calling thread.

Common arguments: ``data``/``pads``: int64 tensors ``[world]`` on the kernels' device, each rank's data
base and kernel-area base (``Transport.pointer_tables``); ``slot_off``: this communicator's kernel slot
inside the kernel area; ``me``: this rank's index in the tables; ``timeout_ns``: the bound of every wait;
``check``: the argument-row fields the ranks must agree on (bit i: ``geometry.A_FIELDS[i]``); ``grid``,
``block`` (elements per tile), ``num_warps``: the launch shape (the ops layer's plan; every rank must
pass the same, which the kernels check).

The launch itself (:class:`Kernel`): the first launch of each specialisation goes through triton's JIT,
which compiles (or loads from its cache) the binary; the next ones call that binary's launcher directly,
with the pointer tables as ints. triton's JIT path binds and hashes every argument, checks the kernel's
globals and asks the driver about each pointer on every call: tens of microseconds on the host, per op.
A direct launch returns what it launched (its binary and arguments): :func:`fire` repeats it on the
current stream without building anything again (the ops layer's repeat of a call it checked before).
With triton 3.6 a direct launch calls the binary's C launch function itself (:func:`_entry`): the Python
``CudaLauncher.__call__`` around it only adds scratch buffers, which these kernels never ask for.
"""

from __future__ import annotations

import torch
import triton
from triton import knobs

from . import geometry as g
from . import kernels as k
from .prims import INTERPRET

__all__ = ["INTERPRET", "Kernel", "fire", "barrier", "all_reduce", "all_gather", "reduce_scatter", "all_to_all",
           "broadcast"]

_KW = g.KMAX_WORLD
#: itemsize -> the dtype code (``native/abi.py``) of the unsigned word the copies move.
_RAW = {1: 5, 2: 6, 4: 7, 8: 8}
_SIZES = {0: 4, 1: 2, 2: 2, 3: 8, 4: 1, 5: 1, 6: 2, 7: 4, 8: 8, 9: 1}
_I32 = (-(1 << 31), (1 << 31) - 1)
_POINTERS = ("data", "pads", "splits")


def _width(v) -> int:
    """triton's type of a non-constexpr scalar argument, as it specialises the binary on it: i32 (0), i64 (1),
    u64 (2) by value, a bool u1 (3)."""
    if v.__class__ is bool:
        return 3
    return 0 if _I32[0] <= v <= _I32[1] else 2 if v >= 1 << 63 else 1


def _device_stream() -> tuple[int, int]:
    """The current CUDA device and its current stream's handle (what triton's JIT launches on)."""
    dev = torch._C._cuda_getDevice()
    return dev, torch._C._cuda_getCurrentRawStream(dev)


def _hooked() -> bool:
    """Whether a launch hook is set (a profiler such as proton): then every launch takes triton's path.
    triton 3.6's hooks are ``HookChain`` objects, never None: set means holding a call."""
    rt = knobs.runtime
    return _set(rt.launch_enter_hook) or _set(rt.launch_exit_hook)


def _set(hook) -> bool:
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return calls is None or bool(calls)


#: The triton whose ``CudaLauncher.__call__`` :func:`_entry` knows (any other: the launcher's own ``__call__``).
_ENTRY_TRITON = "3.6."


def _entry(ck) -> tuple:
    """``(fn, head)`` such that ``fn(grid, 1, 1, stream, *head, *kernel_args)`` launches the compiled kernel ``ck``.

    Normally ``ck.run`` (triton's ``CudaLauncher``) with the arguments triton's JIT passes it. For triton 3.6,
    whose ``CudaLauncher.__call__`` only allocates the global and profile scratch buffers (when the kernel
    asks for them) and calls its C ``launch`` with the cooperative-grid and PDL flags: that C function, with
    those flags and no scratch, when the kernel asks for none (a Python frame, a closure and two calls less
    per launch; the equivalence with ``__call__`` is tested against triton's own class)."""
    run = ck.run
    head = (ck.function, ck.packed_metadata, None, None, None)
    if not triton.__version__.startswith(_ENTRY_TRITON) or type(run).__name__ != "CudaLauncher":
        return run, head
    try:
        if run.global_scratch_size or run.profile_scratch_size or not callable(run.launch):
            return run, head
        return run.launch, (ck.function, run.launch_cooperative_grid, run.launch_pdl, None, None, *head[1:])
    except AttributeError:
        return run, head


class Kernel:
    """One ``@triton.jit`` kernel's launches, with every argument positional, in the kernel's order.

    A launch's binary is fixed by the constexpr arguments, ``num_warps``, the device, each scalar's type
    (``_width``) and each pointer table's 16-byte alignment: that tuple keys :attr:`compiled`. The first
    launch of a key goes through triton's JIT (it compiles, or loads triton's on-disk cache) and its
    :class:`CompiledKernel` is kept; later launches call that binary's launcher straight away. Under the
    interpreter, with a launch hook set, or with a triton whose compiled kernels lack the launcher, every
    launch takes triton's JIT path."""

    __slots__ = ("jit", "compiled", "_entries", "_ptrs", "_consts", "_scalars")

    def __init__(self, jit) -> None:
        self.jit = jit
        #: key -> the compiled kernel (None: this triton's objects cannot be launched directly).
        self.compiled: dict = {}
        self._entries: dict = {}  # key -> _entry(its compiled kernel)
        self._ptrs: tuple[int, ...] | None = None

    def _positions(self) -> None:
        params = self.jit.params
        self._ptrs = tuple(i for i, p in enumerate(params) if p.name in _POINTERS)
        self._consts = tuple(i for i, p in enumerate(params) if p.is_constexpr)
        self._scalars = tuple(i for i, p in enumerate(params) if not p.is_constexpr and p.name not in _POINTERS)

    def __call__(self, grid: int, num_warps: int, *args) -> tuple | None:
        """Launch; returns ``(device, fn, grid, tail)`` when it launched the binary directly
        (``fn(grid, 1, 1, stream, *tail)``: see :func:`_entry`; for :func:`fire`), None when it went through
        triton's JIT."""
        if INTERPRET or _hooked():
            self.jit[(grid,)](*args, num_warps=num_warps)
            return None
        if self._ptrs is None:
            self._positions()
        dev, stream = _device_stream()
        ptrs = [args[i].data_ptr() for i in self._ptrs]
        key = (dev, num_warps, *[args[i] for i in self._consts], *[_width(args[i]) for i in self._scalars],
               *[p & 15 == 0 for p in ptrs])
        ck = self.compiled.get(key, False)
        if ck is False:
            ck = self.jit[(grid,)](*args, num_warps=num_warps)
            if hasattr(ck, "result"):  # triton's asynchronous compile mode
                ck = ck.result()
            ok = all(hasattr(ck, a) for a in ("run", "function", "packed_metadata"))
            self.compiled[key] = ck if ok else None
            if ok:
                self._entries[key] = _entry(ck)
            return None
        if ck is None:
            self.jit[(grid,)](*args, num_warps=num_warps)
            return None
        fn, head = self._entries[key]
        full = list(args)
        for i, p in zip(self._ptrs, ptrs):
            full[i] = p
        tail = (*head, *full)
        fn(grid, 1, 1, stream, *tail)
        return dev, fn, grid, tail


def fire(launched: tuple) -> bool:
    """Launch again, on the current stream, what a direct launch returned (``Kernel.__call__``): the same
    binary with the same arguments. False (nothing launched) when the current device is another one or a
    launch hook is set: the caller then launches the long way."""
    dev, fn, grid, tail = launched
    cur, stream = _device_stream()
    if cur != dev or _hooked():
        return False
    fn(grid, 1, 1, stream, *tail)
    return True


_barrier = Kernel(k.barrier_kernel)
_all_reduce = Kernel(k.all_reduce_kernel)
_all_gather = Kernel(k.all_gather_kernel)
_reduce_scatter = Kernel(k.reduce_scatter_kernel)
_all_to_all = Kernel(k.all_to_all_kernel)
_broadcast = Kernel(k.broadcast_kernel)


def barrier(data: torch.Tensor, pads: torch.Tensor, *, slot_off: int, me: int, world: int, timeout_ns: int,
            op: int = g.KOP["BARRIER"], check: int = 0) -> tuple | None:
    """Entry handshake of every rank (``op`` ERROR: this rank's call failed validation; it takes part in
    the handshake so that the peers hear of it)."""
    return _barrier(1, 1, pads, pads, slot_off, me, world, op, check, timeout_ns, _KW)


def all_reduce(data: torch.Tensor, pads: torch.Tensor, *, slot_off: int, me: int, world: int, in_off: int,
               out_addr: int, out_off: int, numel: int, dtype: int, red: int, two_shot: bool, inplace: bool,
               check: int, timeout_ns: int, grid: int, block: int, num_warps: int) -> tuple | None:
    return _all_reduce(grid, num_warps, data, pads, pads, slot_off, me, world, in_off, out_addr, out_off, numel,
                       check, timeout_ns, dtype, _SIZES[dtype], red, bool(two_shot), bool(inplace), block, _KW,
                       INTERPRET)


def all_gather(data: torch.Tensor, pads: torch.Tensor, splits: torch.Tensor | None, *, slot_off: int, me: int,
               world: int, in_off: int, out_addr: int, dtype: int, itemsize: int, outer: int, inner: int, cnt: int,
               total: int, skip_self: bool, check: int, timeout_ns: int, grid: int, block: int,
               num_warps: int) -> tuple | None:
    """``splits``: None (every rank gives ``cnt``) or int64 ``[KMAX_WORLD]`` every rank's size along dim."""
    return _all_gather(grid, num_warps, data, pads, pads if splits is None else splits, slot_off, me, world, in_off,
                       out_addr, dtype, outer, inner, cnt, total, check, timeout_ns, _RAW[itemsize], itemsize,
                       splits is not None, outer > 1, bool(skip_self), block, _KW, INTERPRET)


def reduce_scatter(data: torch.Tensor, pads: torch.Tensor, splits: torch.Tensor | None, *, slot_off: int, me: int,
                   world: int, in_off: int, out_addr: int, dtype: int, red: int, outer: int, inner: int, cnt: int,
                   total: int, check: int, timeout_ns: int, grid: int, block: int, num_warps: int) -> tuple | None:
    """``splits``: None (every rank's part is ``cnt``) or int64 ``[KMAX_WORLD]`` every rank's size along dim."""
    return _reduce_scatter(grid, num_warps, data, pads, pads if splits is None else splits, slot_off, me, world,
                           in_off, out_addr, outer, inner, cnt, total, check, timeout_ns, dtype, _SIZES[dtype], red,
                           splits is not None, outer > 1, block, _KW, INTERPRET)


def all_to_all(data: torch.Tensor, pads: torch.Tensor, splits: torch.Tensor | None, *, slot_off: int, me: int,
               world: int, in_off: int, out_addr: int, dtype: int, itemsize: int, inner: int, cnt: int, numel: int,
               out_rows: int, check: int, timeout_ns: int, grid: int, block: int, num_warps: int,
               idx_off: int = -1, idx_len: int = 0) -> tuple | None:
    """Rows of ``inner`` elements. ``splits``: None (``cnt`` rows to and from every rank) or int64
    ``[2 * KMAX_WORLD]``: this rank's in_splits, then its out_splits; ``out_rows``: the output's rows (with
    splits, no pull writes past them, nor reads past a peer's ``numel``). ``idx_off`` (with splits): the heap
    offset of this rank's int64 row list of ``idx_len`` entries, by destination (the peers pull the listed rows)."""
    return _all_to_all(grid, num_warps, data, pads, pads if splits is None else splits, slot_off, me, world, in_off,
                       out_addr, dtype, inner, cnt, numel, out_rows, idx_off, idx_len, check, timeout_ns,
                       _RAW[itemsize], itemsize, splits is not None, idx_off >= 0, block, _KW, INTERPRET)


def broadcast(data: torch.Tensor, pads: torch.Tensor, *, slot_off: int, me: int, world: int, in_off: int,
              out_addr: int, dtype: int, itemsize: int, root: int, numel: int, check: int, timeout_ns: int,
              grid: int, block: int, num_warps: int) -> tuple | None:
    return _broadcast(grid, num_warps, data, pads, pads, slot_off, me, world, in_off, out_addr, dtype, root, numel,
                      check, timeout_ns, _RAW[itemsize], itemsize, block, _KW, INTERPRET)
