"""The device collectives: validate, plan, launch one Triton kernel, and read what the kernels report.

Synchronisation protocol: entirely on the device, in the kernels (``native/triton/sync.py``): each rank
publishes its arguments in its kernel slot's row and signals the peers; every block waits (bounded)
for the same block of every peer, checks their rows, pulls the peers' data straight out of their heaps,
and ends with an exit barrier. Nothing is exchanged on the host, so every op is enqueued on the current
stream without a host sync, and a captured CUDA graph replays in step (the epochs live in the pad).

What the host does: local checks (a call only this rank gets wrong still launches the handshake, as an
ERROR launch, so that the peers report it instead of waiting; then this rank raises), the launch shape
(``_plan``), and :meth:`DeviceOps.check`, which reads the kernels' status words (timeouts with the
missing ranks, mismatches with the rank and the field). Under ``TRITON_INTERPRET=1`` over the shm heap
the kernels run on the calling thread, and every op checks the status before it returns.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..errors import ZbcclError, ZbcclInvalidUsageError, ZbcclRemoteError, ZbcclTimeoutError
from ..heap import layout
from ..heap.transports.base import Transport
from ..native import triton as ktriton
from ..native.triton import geometry as g
from .args import overlap_error, timeout_error
from .device_args import (
    check_local,
    exchange_shape,
    fail,
    field_name,
    gather_shape,
    plan,
    scatter_shape,
    sizes_table,
)
from .dtypes import CODE_DTYPES, MAX, MIN, PROD, SUM, dtype_code, op_name, reduce_op_code

__all__ = ["DeviceOps"]

_F = {name: 1 << i for i, name in enumerate(g.A_FIELDS)}
_CHECK = {
    "all_reduce": _F["OP"] | _F["DTYPE"] | _F["REDOP"] | _F["ALGO"] | _F["GRID"] | _F["NUMEL"],
    "gather": _F["OP"] | _F["DTYPE"] | _F["GRID"] | _F["OUTER"] | _F["INNER"] | _F["VARIANT"],
    "scatter": _F["OP"] | _F["DTYPE"] | _F["REDOP"] | _F["GRID"] | _F["OUTER"] | _F["INNER"] | _F["VARIANT"],
    "exchange": _F["OP"] | _F["DTYPE"] | _F["GRID"] | _F["INNER"] | _F["VARIANT"],
    "broadcast": _F["OP"] | _F["DTYPE"] | _F["GRID"] | _F["ROOT"] | _F["NUMEL"],
    "barrier": _F["OP"] | _F["GRID"],
}
#: Above this many bytes ``algo="auto"`` all-reduces in two shots (when the output is in the heap).
TWO_SHOT_BYTES = 512 << 10
#: all_to_all_v's launch shape is planned as if every rank moved this many bytes (no size is agreed on).
_V_ELEMS = 1 << 20
_ALGOS = {"auto": None, "one_shot": False, "oneshot": False, "two_shot": True, "twoshot": True}


class DeviceOps:
    """The device collectives of one communicator over one device heap (one kernel slot).

    ``rank_in_group``: this rank's index in ``ranks`` (the group's global ranks, in group order);
    ``transport``: the heap's transport (``pointer_tables``, ``offset_of``, the pad); ``slot``: the
    communicator's comm slot (its kernel slot); ``timeout_s``: every device wait's bound; ``barrier``:
    a host barrier over the group. Creating one is collective: each rank zeroes its kernel slot, then
    ``barrier()`` (omit it only when the slot is known to be fresh on every rank).

    Every op is a collective, enqueued on the current stream (on CUDA) without syncing the host, and
    can be captured in a CUDA graph (replays stay in step: the epochs live in device memory). Tensors
    the peers read must be contiguous tensors of this heap (``zbccl.empty(..., device=...)``). The ops of
    one DeviceOps share its kernel slot: they must be stream-ordered (one stream at a time, or streams
    that wait on each other) and called from one thread at a time.
    """

    def __init__(self, rank_in_group: int, ranks: Sequence[int], transport: Transport, *, slot: int,
                 timeout_s: float = 60.0, barrier: Callable[[], None] | None = None) -> None:
        self.ranks = tuple(ranks)
        self.world = len(self.ranks)
        if not 1 <= self.world <= g.KMAX_WORLD:
            raise ZbcclInvalidUsageError(
                f"device ops: group too large, expected at most {g.KMAX_WORLD} ranks, got {self.world}")
        if not 0 <= rank_in_group < self.world:
            raise ZbcclInvalidUsageError(
                f"device ops: rank_in_group out of range, expected [0, {self.world}), got {rank_in_group}")
        self.me = rank_in_group
        self.rank = self.ranks[rank_in_group]
        self.transport = transport
        self.device = transport.device
        self._k = ktriton.load()
        if self.device.type == "cpu" and not self._k.INTERPRET:
            raise ZbcclInvalidUsageError(
                "device ops: the kernels need a GPU, expected a cuda heap (or TRITON_INTERPRET=1 set before "
                "triton is imported, to run them on the cpu heap), got a cpu heap")
        seconds, error = timeout_error(timeout_s, 60.0, op="device ops")
        fail(error)
        self.timeout_ns = int(seconds * 1e9)
        self.data, self.pads = transport.pointer_tables(self.ranks)
        if self.data.data_ptr() % 16:  # the kernels build every data pointer from it: it must be 16-byte aligned
            self.data = self.data.clone()
        self.slot_off = layout.kernel_slot_offset(slot)
        line = transport.KERNEL_LINE + self.slot_off
        transport.clear_pad(self.rank, line, g.KSLOT_BYTES)
        self._status = transport.pad_view(self.rank, line + g.K_STATUS, g.ST_WORDS * 8,
                                          op="device ops").view(torch.int64)
        self._sync = self.device.type == "cpu"  # the interpreter runs each kernel to completion at launch
        self._epoch = 0  # launches so far: the kernels' epoch, counted on the host too (for error messages)
        #: The last 256 launches' names, ``(epoch, name)`` at ``epoch % 256`` (a ring: a dict's inserts and evictions
        #: cost more per op).
        self._names: list[tuple[int, str] | None] = [None] * 256
        self._broken: ZbcclError | None = None
        self._snap: torch.Tensor | None = None
        self._snap_event = None
        #: (op, each operand's address, shape, dtype and contiguity, the other arguments) -> the direct launch
        #: that call made (``launch.fire``): a repeat skips every check and plan (see ``_repeat``).
        self._launched: dict[tuple, tuple] = {}
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # zeroed before any peer may signal into it
        if barrier is not None:
            barrier()

    # ------------------------------------------------------------------ ops
    def barrier(self) -> None:
        """Collective: returns (in stream order) once every rank of the group has entered it."""
        self._run("barrier", lambda: self._k.barrier(self.data, self.pads, slot_off=self.slot_off, me=self.me,
                                                      world=self.world, timeout_ns=self.timeout_ns,
                                                      check=_CHECK["barrier"]))

    def all_reduce(self, t: torch.Tensor, op="sum", *, out: torch.Tensor | None = None, algo: str = "auto") -> None:
        """Collective: ``out`` (default: ``t``, in place) = the reduction of every rank's ``t``, reduced in
        rank order (every rank's result bit-identical; floats accumulate in float32/float64).

        ``t`` [any shape], a heap tensor; ``out`` [``t``'s shape], same dtype, anywhere on the device
        (two-shot needs it in the heap). ``algo``: ``"one_shot"`` (every rank reads every input),
        ``"two_shot"`` (each rank reduces 1/W, then gathers) or ``"auto"``.
        """
        name = "all_reduce"
        key = self._key(name, t, out, op, algo)
        if key is not None and self._repeat(name, key):
            return
        try:
            dt, red = self._dtype(t, name), reduce_op_code(op, t.dtype, op=name)
            in_off = self._heap_offset(t, "input", name)
            out = t if out is None else out
            self._local(out, "output", name)
            if out.shape != t.shape or out.dtype != t.dtype:
                raise ZbcclInvalidUsageError(
                    f"{name}: output differs from the input, expected shape {list(t.shape)} {t.dtype}, got "
                    f"{list(out.shape)} {out.dtype}")
            inplace = out.data_ptr() == t.data_ptr()
            if not inplace:
                fail(overlap_error(out, t, op=name))
            if algo not in _ALGOS:
                raise ZbcclInvalidUsageError(f"{name}: unknown algo, expected one of {sorted(_ALGOS)}, got {algo!r}")
            out_off = in_off if inplace else self.transport.offset_of(self.rank, out)
            two = _ALGOS[algo]
            if two is None:
                two = t.numel() * t.element_size() > TWO_SHOT_BYTES and out_off >= 0 and self.world > 1
            if two and out_off < 0:
                raise ZbcclInvalidUsageError(
                    f"{name}: two_shot writes its output where the peers read it, expected an output in the "
                    "heap (or in place), got one outside it")
            red = _bool_op(t.dtype, red)
        except ZbcclError as exc:
            self.refuse(name, exc)
        n = t.numel()
        grid, block, warps = self._plan(-(-n // self.world) if two else n, t.element_size(), copy=False)
        self._run(name, lambda: self._k.all_reduce(
            self.data, self.pads, slot_off=self.slot_off, me=self.me, world=self.world, in_off=in_off,
            out_addr=self._addr(out), out_off=out_off, numel=n, dtype=dt, red=red, two_shot=two, inplace=inplace,
            check=_CHECK["all_reduce"], timeout_ns=self.timeout_ns, grid=grid, block=block, num_warps=warps), key)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, *, dim: int = 0) -> None:
        """Collective: ``out`` = every rank's ``inp`` concatenated along ``dim`` in rank order.

        ``inp`` [..., n, ...] a heap tensor (or this rank's part of ``out``, when ``dim``'s outer size is 1);
        ``out`` [..., W * n, ...] anywhere on the device.
        """
        self._gather("all_gather", out, inp, None, dim)

    def all_gather_v(self, out: torch.Tensor, inp: torch.Tensor, sizes, *, dim: int = 0) -> None:
        """:meth:`all_gather` with per-rank sizes along ``dim``: ``sizes`` [W] (every rank passes all of
        them; a list, or an int64 tensor on the device, checked by the kernels only)."""
        self._gather("all_gather_v", out, inp, sizes, dim)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op="sum", *, dim: int = 0) -> None:
        """Collective: ``out`` = this rank's part (the ``me``-th of W equal parts along ``dim``) of the
        rank-order reduction of every rank's ``inp``. ``inp`` [..., W * n, ...] a heap tensor; ``out``
        [..., n, ...] anywhere on the device (or, when ``dim``'s outer size is 1, this rank's part of ``inp``)."""
        self._scatter("reduce_scatter", out, inp, None, op, dim)

    def reduce_scatter_v(self, out: torch.Tensor, inp: torch.Tensor, sizes, op="sum", *, dim: int = 0) -> None:
        """:meth:`reduce_scatter` with per-rank sizes along ``dim`` (``sizes`` [W], every rank passes all)."""
        self._scatter("reduce_scatter_v", out, inp, sizes, op, dim)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """Collective: rank r's ``out`` rows ``[q * n, (q + 1) * n)`` = rank q's ``inp`` rows ``[r * n, (r + 1) * n)``
        (dim 0 split in W equal parts). ``inp`` [W * n, ...] a heap tensor; ``out`` [W * n, ...] elsewhere."""
        self._exchange("all_to_all", out, inp, None, None)

    def all_to_all_v(self, out: torch.Tensor, inp: torch.Tensor, out_splits, in_splits, *,
                     partial: bool = False, rows: torch.Tensor | None = None, name: str = "all_to_all_v") -> None:
        """:meth:`all_to_all` with rows per rank: this rank sends ``in_splits[q]`` rows to rank q and receives
        ``out_splits[q]`` from it (lists, or int64 [W] device tensors: checked by the kernels only; rank q's
        ``in_splits[r]`` must equal rank r's ``out_splits[q]``, or every rank reports the mismatch). Host
        splits must cover ``inp`` and ``out`` exactly, or with ``partial`` a prefix of each (the rows past it
        untouched: for a caller whose sizes are device quantities, as EP's low-latency mode on CUDA).

        ``rows``: an int64 heap tensor listing, destination by destination (as ``in_splits`` cut it), which rows
        of ``inp`` each peer pulls: in any order, repeated or not, so nothing is packed first (EP's dispatch);
        the in_splits then count the list's entries. Every rank of the call passes one or none.

        ``name``: what this call's errors begin with, ``all_to_all_v`` and the caller's words for it (EP's
        dispatch says which output its splits may overrun)."""
        self._exchange(name, out, inp, out_splits, in_splits, partial, rows)

    def broadcast(self, t: torch.Tensor, src: int) -> None:
        """Collective: every rank's ``t`` = group rank ``src``'s ``t`` (there a heap tensor; elsewhere anywhere
        on the device, same shape and dtype)."""
        name = "broadcast"
        key = self._key(name, t, None, src)
        if key is not None and self._repeat(name, key):
            return
        try:
            dt = self._dtype(t, name)
            if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < self.world:
                raise ZbcclInvalidUsageError(f"{name}: src out of range, expected a rank in [0, {self.world}), got {src!r}")
            in_off = self._heap_offset(t, "tensor", name) if src == self.me else -1
        except ZbcclError as exc:
            self.refuse(name, exc)
        n, isz = t.numel(), t.element_size()
        grid, block, warps = self._plan(n, isz)
        self._run(name, lambda: self._k.broadcast(
            self.data, self.pads, slot_off=self.slot_off, me=self.me, world=self.world, in_off=in_off,
            out_addr=self._addr(t), dtype=dt, itemsize=isz, root=src, numel=n, check=_CHECK["broadcast"],
            timeout_ns=self.timeout_ns, grid=grid, block=block, num_warps=warps), key)

    # ------------------------------------------------------------------ errors
    def check(self, *, wait: bool = False) -> None:
        """Raise what the kernels reported since the last check: :class:`ZbcclTimeoutError` naming the ranks
        that never arrived (this object is unusable afterwards), :class:`ZbcclInvalidUsageError` for
        arguments that differ across ranks (naming the rank and the field), :class:`ZbcclRemoteError` for a
        peer whose call failed its own checks. Never syncs the host on CUDA unless ``wait`` (it reads
        the status words as of the last completed snapshot, and enqueues the next)."""
        if self._broken is not None:
            raise type(self._broken)(str(self._broken), ranks=self._broken.ranks)
        if not self._sync and torch.cuda.is_current_stream_capturing():
            return  # nothing may touch the stream outside the captured ops; check after replaying
        vals = self._read_status(wait)
        if vals is None or vals[g.ST_CODE] == 0:
            return
        self._status.zero_()
        raise self._error(vals)

    def _error(self, st: list[int]) -> ZbcclError:
        # The host's name for that launch (it says which variant), unless graph replays moved the device's
        # epochs past the host's count: then the kernel's own op code.
        ent = self._names[st[g.ST_EPOCH] & 255]
        name = ent[1] if ent is not None and ent[0] == st[g.ST_EPOCH] else ""
        kop = g.KOP_NAMES.get(st[g.ST_OP], "device op")
        if kop != "error" and not name.startswith(kop):
            name = kop
        if st[g.ST_CODE] & g.S_TIMEOUT:
            late = [q for q in range(self.world) if st[g.ST_MISSING] >> q & 1]
            glob = [self.ranks[q] for q in late]
            dead = sorted(set(glob) & set(getattr(self.transport, "dead_peers", list)()))
            if dead:  # the wait ran out because they are gone: say so
                self._broken = ZbcclRemoteError(
                    f"{name}: peer lost while the device kernel waited: global rank(s) {dead} died (process "
                    f"exited); this communicator's device ops are out of step now", ranks=tuple(dead))
                return self._broken
            self._broken = ZbcclTimeoutError(
                f"{name}: timed out after {self.timeout_ns / 1e9:.1f}s in the device kernel waiting for group "
                f"rank(s) {late} (global {glob}), expected every rank of the group to join, got no signal from "
                "them; this communicator's device ops are out of step now", ranks=tuple(glob))
            return self._broken
        q = st[g.ST_BAD] - 1
        if st[g.ST_FIELD] in (g.F_ROWS_IN, g.F_ROWS_OUT):  # device splits past a tensor: nothing moved there
            whose = "the output" if st[g.ST_FIELD] == g.F_ROWS_OUT else (
                f"the input of group rank {q} (global {self.ranks[q]}), by its in_splits")
            return ZbcclInvalidUsageError(
                f"{name}: splits reach past {whose}, expected at most {st[g.ST_THEIRS]} rows, got splits up to row "
                f"{st[g.ST_MINE]} (the rows past the end were neither read nor written)", ranks=(self.ranks[q],))
        field = field_name(st[g.ST_FIELD])
        if st[g.ST_CODE] & g.S_PEER_ERROR:
            return ZbcclRemoteError(
                f"{name}: group rank {q} (global {self.ranks[q]}) failed its own checks of this call, expected a "
                f"valid call on every rank, got an error raised on rank {q}", ranks=(self.ranks[q],))
        mine, theirs = st[g.ST_MINE], st[g.ST_THEIRS]
        if field.startswith("out_splits"):
            return ZbcclInvalidUsageError(
                f"{name}: splits do not pair, expected group rank {q} (global {self.ranks[q]}) to send {mine} rows "
                f"here (this rank's {field}), got {theirs} (its in_splits[{self.me}])", ranks=(self.ranks[q],))
        if field == "dtype":
            mine, theirs = CODE_DTYPES.get(mine, mine), CODE_DTYPES.get(theirs, theirs)
        if field == "reduce op":
            mine, theirs = op_name(mine), op_name(theirs)
        if field == "op":
            mine, theirs = g.KOP_NAMES.get(mine, mine), g.KOP_NAMES.get(theirs, theirs)
        return ZbcclInvalidUsageError(
            f"{name}: arguments differ across ranks, expected {field} {mine} (this rank's) on every rank, got "
            f"{theirs} on group rank {q} (global {self.ranks[q]})", ranks=(self.ranks[q],))

    def _read_status(self, wait: bool) -> list[int] | None:
        """The status words: directly under the interpreter; on CUDA from a pinned snapshot copied on the
        current stream (``wait``: a fresh one, waited for; else the last one if it has landed, and the
        next is enqueued unless this one carries an error, which check() clears first)."""
        if self._sync:
            return self._status.tolist()
        if self._snap is None:
            self._snap = torch.zeros(g.ST_WORDS, dtype=torch.int64, pin_memory=True)
        if wait:
            self._snapshot()
            self._snap_event.synchronize()
            self._snap_event = None
            return self._snap.tolist()
        vals = None
        if self._snap_event is not None and self._snap_event.query():
            vals, self._snap_event = self._snap.tolist(), None
        if self._snap_event is None and (vals is None or vals[g.ST_CODE] == 0):
            self._snapshot()
        return vals

    def _snapshot(self) -> None:
        self._snap.copy_(self._status, non_blocking=True)
        self._snap_event = torch.cuda.Event()
        self._snap_event.record()

    # ------------------------------------------------------------------ plumbing
    def _run(self, name: str, launch: Callable[[], tuple | None], key: tuple | None = None) -> None:
        if self._sync:
            self.check()
        elif self._broken is not None:
            self.check()  # raises it; on CUDA the status words are read by check() alone (no copy per op)
        launched = launch()
        self._count(name)
        if key is not None and launched is not None:
            if len(self._launched) >= 256:
                self._launched.clear()
            try:
                self._launched[key] = launched
            except TypeError:  # an unhashable argument: no repeats of this call
                pass
        if self._sync:
            self.check()

    def _count(self, name: str) -> None:
        e = self._epoch = self._epoch + 1
        self._names[e & 255] = (e, name)

    def _key(self, name: str, t, out, *extra) -> tuple | None:
        """The repeat key of a call on ``t`` (and ``out``): each operand's address, shape, dtype and
        contiguity, the other arguments, and the launch-shape settings. None when an operand is not a tensor
        (the call's checks say what is wrong); an unhashable argument is found where the key is looked up."""
        try:
            key = (name, t.data_ptr(), t.shape, t.dtype, t.is_contiguous(), *extra, self.max_blocks, self.gpu_plan)
            if out is not None:
                key += (out.data_ptr(), out.shape, out.dtype, out.is_contiguous())
        except (AttributeError, TypeError, RuntimeError):
            return None
        return key

    def _repeat(self, name: str, key: tuple) -> bool:
        """Launch again what the same call launched before (``_launched``), without its checks and plan: an
        operand at the same address with the same shape, dtype and contiguity passed them then (heap tensors
        never move and the heap never shrinks while this object lives, and under UVA an address names one
        device), and the launch's arguments are functions of the key. False: take the long way."""
        try:
            launched = self._launched.get(key)
        except TypeError:  # an unhashable argument: the long way, whose checks say what is wrong
            return False
        if launched is None or self._broken is not None or not self._k.fire(launched):
            return False
        self._count(name)
        if self._sync:
            self.check()
        return True

    def refuse(self, name: str, exc: ZbcclError, launches: int = 1) -> None:
        """This rank's call of collective ``name`` is wrong: run the handshake as ERROR (the peers, in their own
        call, report it), then raise ``exc``. Also for callers built on these ops (``ep/device.py``), whose call
        is ``launches`` kernels on the peers: on CUDA the peers enqueue all of them before any check, so this
        rank pairs each with an ERROR handshake and the epochs stay in step; under the interpreter a peer raises
        at its first (it checks after every launch), so one is run."""
        if self._broken is None:
            for _ in range(1 if self._sync else max(launches, 1)):
                self._k.barrier(self.data, self.pads, slot_off=self.slot_off, me=self.me, world=self.world,
                                timeout_ns=self.timeout_ns, op=g.KOP["ERROR"], check=0)
                self._count(name)
        raise exc

    #: Under the interpreter, plan launches as on a GPU (many 8 KiB tiles) instead of a few wide programs:
    #: slower, but it runs the GPU's multi-block geometry (``python -m zbccl.bench.gpu --interpret``).
    gpu_plan = False
    #: Most blocks of one launch (every rank of a group must use the same). Each block b waits for block b
    #: of every peer, so where the ranks share one GPU and run concurrently (MPS), the W launches must fit
    #: on it together: the GPU check sets about SMs / W there (``bench/gpu_cases.py``).
    max_blocks: int = g.MAX_BLOCKS

    def _plan(self, n: int, itemsize: int, *, copy: bool = True) -> tuple[int, int, int]:
        grid, block, warps = plan(n, itemsize, self._k.INTERPRET and not self.gpu_plan, copy=copy)
        return min(grid, self.max_blocks), block, warps

    def _addr(self, t: torch.Tensor) -> int:
        """``t``'s address for a kernel; an empty tensor's (0, never dereferenced) becomes a valid 64-bit one,
        so that the kernel sees a pointer-sized argument."""
        return t.data_ptr() or self.pads.data_ptr()

    def _dtype(self, t, name: str) -> int:
        self._local(t, "input", name)
        return dtype_code(t.dtype, op=name)

    def _local(self, t, role: str, name: str) -> None:
        check_local(t, self.device, role, name)

    def _heap_offset(self, t: torch.Tensor, role: str, name: str) -> int:
        if t.numel() == 0:
            return 0  # nothing for a peer to read
        off = self.transport.offset_of(self.rank, t)
        if off < 0:
            raise ZbcclInvalidUsageError(
                f"{name}: the peers read the {role} where it is, expected a tensor of this rank's "
                f"{self.device.type} heap (zbccl.empty(..., device=...)), got one outside it")
        return off

    def _gather(self, name: str, out, inp, sizes, dim) -> None:
        key = self._key(name, inp, out, dim) if sizes is None else None
        if key is not None and self._repeat(name, key):
            return
        try:
            dt = self._dtype(inp, name)
            self._local(out, "output", name)
            splits, vals = (None, None) if sizes is None else sizes_table(sizes, self.world, self.device, "sizes",
                                                                          name)
            outer, inner, cnt, total, skip = gather_shape(out, inp, vals, sizes is not None, dim, self.world,
                                                          self.me, name)
            in_off = self._heap_offset(inp, "input", name)
        except ZbcclError as exc:
            self.refuse(name, exc)
        isz = inp.element_size()
        grid, block, warps = self._plan(outer * total * inner // self.world, isz)  # the same on every rank
        self._run(name, lambda: self._k.all_gather(
            self.data, self.pads, splits, slot_off=self.slot_off, me=self.me, world=self.world, in_off=in_off,
            out_addr=self._addr(out), dtype=dt, itemsize=isz, outer=outer, inner=inner, cnt=cnt, total=total,
            skip_self=skip, check=_CHECK["gather"] | (0 if sizes is not None else _F["NUMEL"]),
            timeout_ns=self.timeout_ns, grid=grid, block=block, num_warps=warps), key)

    def _scatter(self, name: str, out, inp, sizes, op, dim) -> None:
        key = self._key(name, inp, out, op, dim) if sizes is None else None
        if key is not None and self._repeat(name, key):
            return
        try:
            dt, red = self._dtype(inp, name), reduce_op_code(op, inp.dtype, op=name)
            self._local(out, "output", name)
            splits, vals = (None, None) if sizes is None else sizes_table(sizes, self.world, self.device, "sizes",
                                                                          name)
            outer, inner, cnt, total = scatter_shape(out, inp, vals, sizes is not None, dim, self.world, self.me,
                                                     name)
            in_off = self._heap_offset(inp, "input", name)
            red = _bool_op(inp.dtype, red)
        except ZbcclError as exc:
            self.refuse(name, exc)
        isz = inp.element_size()
        grid, block, warps = self._plan(inp.numel() // self.world, isz, copy=False)  # every rank agrees on it
        self._run(name, lambda: self._k.reduce_scatter(
            self.data, self.pads, splits, slot_off=self.slot_off, me=self.me, world=self.world, in_off=in_off,
            out_addr=self._addr(out), dtype=dt, red=red, outer=outer, inner=inner, cnt=cnt, total=total,
            check=_CHECK["scatter"] | (0 if sizes is not None else _F["NUMEL"]), timeout_ns=self.timeout_ns,
            grid=grid, block=block, num_warps=warps), key)

    def _exchange(self, name: str, out, inp, out_splits, in_splits, partial: bool = False, listed=None) -> None:
        key = self._key(name, inp, out) if out_splits is None and listed is None else None
        if key is not None and self._repeat(name, key):
            return
        try:
            dt = self._dtype(inp, name)
            self._local(out, "output", name)
            splits = in_vals = out_vals = None
            if out_splits is not None:
                ins, in_vals = sizes_table(in_splits, self.world, self.device, "in_splits", name)
                outs, out_vals = sizes_table(out_splits, self.world, self.device, "out_splits", name)
                splits = torch.cat([ins, outs])
            idx_off, idx_len = -1, 0
            if listed is not None:
                self._local(listed, "row list", name)
                if splits is None or listed.dtype != torch.int64 or listed.dim() != 1:
                    raise ZbcclInvalidUsageError(
                        f"{name}: rows must be an int64 [n] heap tensor with splits, got {listed.dtype} "
                        f"{list(listed.shape)}" + ("" if splits is not None else " without splits"))
                idx_off, idx_len = self._heap_offset(listed, "row list", name), listed.numel()
            rows, inner = exchange_shape(out, inp, in_vals, out_vals, splits is not None, self.world, name,
                                         partial=partial, in_rows=None if listed is None else idx_len)
            in_off = self._heap_offset(inp, "input", name)
        except ZbcclError as exc:
            self.refuse(name, exc)
        isz = inp.element_size()
        # The launch shape must agree across ranks: all_to_all_v's sizes differ per rank, so it takes a fixed one.
        grid, block, warps = self._plan(inp.numel() // self.world if splits is None else _V_ELEMS // isz, isz)
        self._run(name, lambda: self._k.all_to_all(
            self.data, self.pads, splits, slot_off=self.slot_off, me=self.me, world=self.world, in_off=in_off,
            out_addr=self._addr(out), dtype=dt, itemsize=isz, inner=inner, cnt=rows // self.world,
            numel=inp.numel(), out_rows=out.shape[0], check=_CHECK["exchange"] | (0 if splits is not None else _F["NUMEL"]),
            timeout_ns=self.timeout_ns, grid=grid, block=block, num_warps=warps, idx_off=idx_off, idx_len=idx_len),
            key)


def _bool_op(dtype: torch.dtype, red: int) -> int:
    """bool is moved as bytes 0/1: sum/max reduce as max (any), product/min as min (all)."""
    if dtype != torch.bool:
        return red
    return MAX if red in (SUM, MAX) else MIN if red in (PROD, MIN) else red
