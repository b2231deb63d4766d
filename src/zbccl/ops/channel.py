"""The op channel: one communicator's native protocol, driven by one call per op.

Synchronisation protocol (run by ``native/csrc/core/chan.c``; all flags live in
the *owner's* comm slot, one 64-byte line each, and only grow, so they are
never reset; line numbers and header fields come from ``native/abi.py``):

* ``ARRIVE`` (slot line 1): a rank writes its op header (line 4-5: sequence
  number, op, dtype, reduce op, sizes, the heap offsets of its operands, the
  algorithm, an error flag) and, for ops with per-rank sizes, its size vectors
  (lines 8+), then release-stores ``ARRIVE = seq``. Peers acquire-load
  ``ARRIVE >= seq`` before reading the header, so they see it complete.
* Every rank reads every header and checks that the group agrees (same op,
  dtype, reduce op, sizes, algorithm). All ranks read the same headers, so
  all reach the same verdict: either every rank proceeds or every rank raises
  :class:`~zbccl.errors.ZbcclInvalidUsageError` naming the disagreement.
* ``PHASE`` (line 2): mid-op points of multi-phase algorithms (two-shot
  allreduce). Each rank posts its current PHASE value in its header
  (``PHASE_BASE``); step ``k`` of the op is ``max(all posted values) + k``,
  so the counter only grows and no encoding can overflow.
* ``DONE`` (line 3): ``DONE = seq`` says "I no longer read your operands and
  mine are final". A rank returns only after every peer's ``DONE >= seq``,
  so the caller may reuse its tensors at once, and no peer can overwrite a
  header another rank has not read yet.
* ``ABORT`` (line 6): non-zero once this rank left an op half-way (Ctrl-C,
  an unexpected exception, a timeout, a lost peer): the communicator is
  broken. This rank's own ABORT line (the world slot's, :mod:`zbccl.runtime.liveness`)
  is marked too, and every wait of every peer, in any communicator, reads it
  at each liveness check and raises :class:`~zbccl.errors.ZbcclRemoteError`
  naming this rank (the one meaning of ABORT, ``runtime/liveness.py``).

Python's part (this module): the op's arguments go, by field name, into a
``zb_op`` struct (``abi.ZbOp``, filled by ``abi.fill_op``; the core reports its
layout when it loads and ``native/abi.py`` checks it), and :meth:`OpChannel.submit`
makes the one native call. ``submit`` is the only way an op runs: it takes the
channel's lock, numbers the op, applies its timeout, marks ABORT if the op is
left half-way, and raises on a result. :meth:`OpChannel.plan` caches a filled
struct for a call that repeats; the native hot entry (``OpChannel.hot``) is a
cache of such plans in front of ``submit``, keyed by the tensor: it takes the
same lock and sequence number and returns -1 for anything it does not hold. An error a rank finds locally (bad arguments,
staging out of memory) is posted through the same call (:meth:`OpChannel.fail`:
the text in this rank's size-vector area, the kind in the header's ``ERROR``
field), so every rank raises together. A result code becomes the error here;
what the message needs (a peer's text, its sizes) was copied by C before the
``DONE`` handshake, as a peer may overwrite it with its next op right after.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import numpy as np
import torch

from .. import env, native
from ..errors import ZbcclError, ZbcclInvalidUsageError, ZbcclSystemError
from ..heap import layout
from ..native import abi
from ..native.abi import (
    ABORT_PEER,
    CHAN_ROW,
    ERR_NOMEM,
    ERR_USAGE,
    L_ABORT,
    L_ARRIVE,
    L_DONE,
    L_ELECT,
    L_HEADER,
    L_PHASE,
    L_VECTORS,
    VEC_CAP,
    WHERE_COLLECTIVE,
    ZbOp,
    fill_op,
)
from ..runtime import liveness
from ..runtime.threads import nthreads
from ..runtime.waits import FlagSet
from .args import timeout_error
from .diagnose import error_for

if TYPE_CHECKING:
    from ..runtime.communicator import Communicator

__all__ = ["OpChannel", "channel_of", "L_ARRIVE", "L_PHASE", "L_DONE", "L_ABORT", "ERR_USAGE", "ERR_NOMEM"]



class OpChannel:
    """One communicator's native channel: addresses, the argument struct, the op's state."""

    #: ``entry(tensor) -> 0 | -1 | result code``: a repeated sum all_reduce of a registered heap tensor in one
    #: native call (-1: not served, take the Python path); None without the native hot module (set in _open).
    hot = None
    #: The same for a repeated even ``all_gather_into_tensor``: ``entry(output, input)``.
    hot_gather = None

    def __init__(self, comm: Communicator) -> None:
        ctx = comm._ctx
        heap = ctx.heap
        if not all(heap.reachable(g) for g in comm.ranks):
            raise ZbcclInvalidUsageError(
                "collective: this communicator spans hosts, expected one whose ranks all share this host (the op "
                "channel views every rank's memory), got ranks reached through put/get and signals only; the public "
                "collectives run such a communicator through zbccl.ops.hosts")
        if comm.world_size > abi.MAX_WORLD:
            raise ZbcclInvalidUsageError(
                f"collective: communicator too large, expected at most {abi.MAX_WORLD} ranks, got {comm.world_size}")
        self.comm, self.ctx, self.prims = comm, ctx, ctx.prims
        self.world_size, self.rank = comm.world_size, comm.rank
        #: The op sequence number without a native hot table (with one, the table holds it: :attr:`seq`).
        self._seq = 0

        def line(g: int, i: int) -> int:  # native-core address of line i of g's comm slot (for native waits)
            return heap.ctrl_addr(g, layout.slot_line(comm.slot, i))

        me = ctx.rank
        peers = [g for g in comm.ranks if g != me]
        self.my_flags = {i: line(me, i) for i in (L_ARRIVE, L_PHASE, L_DONE, L_ABORT)}
        group = [comm.ranks.index(g) for g in peers]
        self.peer_flags = {i: FlagSet(peers, [line(g, i) for g in peers], group) for i in (L_ARRIVE, L_PHASE, L_DONE)}
        #: Each group rank's size-vector area in its signal pad (an int64 view through the transport).
        pad = heap.transport.pad_view
        self.vectors = [pad(g, layout.slot_line(comm.slot, L_VECTORS), VEC_CAP * 8).numpy().view(np.int64)
                        for g in comm.ranks]
        #: What this communicator decided per op shape, cleared together when the tuning table changes:
        #: (op, dtype, bytes) -> (algorithm, chunk) from ``tuner.choose``, and per heap-operand key the
        #: prefilled ``zb_op`` of that call (:meth:`plan`), so a repeated op only writes its sequence number.
        self.choices: dict = {}
        self.tuning = None  # the communicator's TuningTable, shared on first use (tuner.table_for)
        self._sizes: dict = {}
        #: Seconds the current op's waits may take (its ``timeout=``, else the communicator's).
        self.timeout = self.default_timeout = ctx.timeout
        self.timeout_ns = self.default_timeout_ns = int(self.timeout * 1e9)
        #: Why this communicator is unusable on this rank (an op was left half-way), or None.
        self.broken: str | None = ctx.left
        #: True while nothing per-op needs checking at entry (not broken, the default timeout).
        self.plain = self.broken is None
        #: The protocol (``ABORT_WHERE``) of the op running now, for the ABORT lines if it is left half-way:
        #: 0 (a collective, or the communicator's role) but while a barrier runs (``ops/barrier.py``).
        self.where = 0
        self._open(comm)

    def _open(self, comm: Communicator) -> None:
        """Create the C channel: per group rank its flag lines, state word, heap base, published heap
        size word, liveness descriptor, size-vector area, ABORT and ELECT lines, and the rank's own
        ABORT line (the world slot's: every wait reads it, see runtime/liveness.py)."""
        from .tuner import store_kind_mode

        ctx, heap = self.ctx, self.ctx.heap
        self._store_mode = store_kind_mode()  # a bad ZBCCL_STREAM_STORES fails before anything is built
        rows = []
        for g in comm.ranks:
            def line(i: int, g: int = g) -> int:
                return heap.ctrl_addr(g, layout.slot_line(comm.slot, i))

            row = {"ARRIVE": line(L_ARRIVE), "PHASE": line(L_PHASE), "DONE": line(L_DONE), "HEADER": line(L_HEADER),
                   "STATE": heap.ctrl_addr(g, layout.H_STATE), "BASE": heap.addr(g, 0),
                   "SIZE": heap.ctrl_addr(g, layout.H_HEAP_BYTES),
                   "FD": -1 if g == ctx.rank else heap.native.liveness_fd(g),
                   "VEC": line(L_VECTORS), "ABORT": line(L_ABORT), "ELECT": line(L_ELECT),
                   "RABORT": liveness.abort_addr(ctx, g), "RANK": g}
            rows.append([row[c] for c in CHAN_ROW])  # the columns in abi.CHAN_ROW's order
        table = np.asarray(rows, dtype=np.int64)
        self.handle = self.prims.chan_new(self.world_size, self.rank, ctx.spin, ctx.liveness_ns, self.timeout_ns,
                                          nthreads(), int(table.ctypes.data), ctx.poll_ns)
        self._args = ZbOp()  # the struct of ops that run once (run); repeated ops have their own (plan)
        self._scratch = (self._args, ctypes.addressof(self._args), 0)
        self._chan_run = self.prims.chan_run
        self.configure_stores()
        # The native hot entry (native/csrc/py/hot.cpp): its table holds the channel's lock and sequence
        # number, so every op, hot or not, takes that lock and counts there: submit's one native call
        # (hot_submit) takes the lock, numbers the op and runs it.
        which = env.HOT_ENTRY.get()
        hot = native.hot() if which != "off" and hasattr(self.prims, "chan_call_addr") else None
        self._hot_mod, self._hot_plans = hot, {}
        self.hot_table = hot.hot_new(self.handle, self.prims.chan_call_addr()) if hot is not None else 0
        if self.hot_table:
            self._acquire, self._release, self._hot_submit = hot.hot_acquire, hot.hot_release, hot.hot_submit
            self.hot = hot.hot_entry(self.hot_table, False)
            self.hot_gather = hot.hot_entry(self.hot_table, True) if which == "all" else None

    @property
    def seq(self) -> int:
        """Sequence number of the last op this rank started on the channel."""
        return self._hot_mod.hot_seq(self.hot_table) if self.hot_table else self._seq

    @seq.setter
    def seq(self, value: int) -> None:
        if self.hot_table:
            self._hot_mod.hot_seq(self.hot_table, value)
        else:
            self._seq = value

    def _lock(self) -> None:
        """Take the channel's native lock (held by a hot call of another thread at most for its op)."""
        if self.hot_table and not self._acquire(self.hot_table, self.timeout_ns + 15_000_000_000):
            raise self._busy_error()

    def _busy_error(self) -> ZbcclInvalidUsageError:
        return ZbcclInvalidUsageError(f"collective: another thread's op on this communicator did not finish "
                                      f"within {self.timeout + 15:.0f}s", ranks=(self.rank,))

    def _unlock(self) -> None:
        if self.hot_table:
            self._release(self.hot_table)

    def hot_register(self, tensor: torch.Tensor, plan: tuple, output: torch.Tensor | None = None,
                     blocks: int = 1) -> None:
        """Let :attr:`hot` serve ``tensor`` (a contiguous heap tensor) with ``plan``'s prefilled op, or with
        ``output``, :attr:`hot_gather` serve the pair (``blocks`` > 1: gathered along an inner dimension,
        as many rows as that; the entry is then called with the dimension)."""
        if not self.hot_table or self.broken is not None:
            return
        self._lock()
        try:
            slot = self._hot_mod.hot_register(self.hot_table, tensor, plan[1], output, blocks)
            if slot >= 0:
                self._hot_plans[slot] = plan  # the native table points into it
        finally:
            self._unlock()

    def forget_plans(self) -> None:
        """Drop every cached plan (the tuning table changed, or too many): the hot table's too."""
        if self.hot_table:
            self._lock()
            try:
                self._hot_mod.hot_clear(self.hot_table)
                self._hot_plans.clear()
            finally:
                self._unlock()
        self.choices.clear()

    def disable(self, timeout: float) -> bool:
        """No more hot calls; wait up to ``timeout`` seconds until none runs (False if one still does)."""
        if not self.hot_table:
            return True
        return bool(self._hot_mod.hot_disable(self.hot_table, max(0, int(timeout * 1e9))))

    def configure_stores(self) -> None:
        """Apply ``ZBCCL_STREAM_STORES`` to the native store-kind policy; forgets what it learnt."""
        self.prims.chan_configure(self.handle, self._store_mode)

    def close(self) -> None:
        """Free the C channel (``Communicator.destroy`` calls it; the handle is unusable afterwards)."""
        handle, self.handle = self.handle, 0
        if handle:
            if not self.disable(self.timeout + 15):
                return  # a hot call still runs on it: leave the channel allocated rather than free it under the op
            self.prims.chan_free(handle)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass

    # ------------------------------------------------------------- the op
    def enter(self, timeout, *, op: str) -> str | None:
        """Start an op: refuse a broken communicator, set the op's timeout; a bad ``timeout`` is
        returned as an error for the handshake (the op then runs with the communicator's)."""
        if self.broken is not None:
            raise ZbcclInvalidUsageError(f"{op}: this communicator is broken on rank {self.rank}: {self.broken}; "
                                         "finalize and init again", ranks=(self.rank,))
        self.timeout, error = timeout_error(timeout, self.default_timeout, op=op)
        self.timeout_ns = max(1, int(self.timeout * 1e9))
        self.plain = self.timeout == self.default_timeout
        return error

    def run(self, name: str, /, **fields: int) -> None:
        """An op that runs once: its ``zb_op`` fields by name (``abi.ARGS``; ``seq`` and ``timeout_ns`` are
        the channel's) into the channel's own struct, then :meth:`submit`. ``name``: the op, for errors."""
        fill_op(self._args, timeout_ns=self.default_timeout_ns, **fields)
        self.submit(self._scratch, op=name)

    def staged(self) -> int:
        """Bytes the last op staged in C (an exchange's private input, when no algorithm did without)."""
        return self._args.staged

    def plan(self, key: tuple, **fields: int) -> tuple:
        """A ``zb_op`` filled by field name (as :meth:`run` takes them) for a call that repeats (heap
        operands at fixed addresses), cached under ``key``: ``(struct, its address, input bytes)``;
        :meth:`submit` runs it. It holds the communicator's default timeout (the hot entry's)."""
        args = ZbOp()
        fill_op(args, timeout_ns=self.default_timeout_ns, **fields)
        if len(self.choices) > 4096:
            self.forget_plans()
        plan = self.choices[key] = (args, ctypes.addressof(args), fields.get("in_numel", 0) * fields.get("itemsize", 0))
        return plan

    def submit(self, plan: tuple, *, op: str) -> None:
        """Run ``plan``'s ``zb_op`` (from :meth:`plan`, or :meth:`run`'s) as this channel's next op: the one
        way into the native channel but the hot entry (which takes the same lock and sequence number).
        Called with the communicator's op lock held (ops from Python run one at a time). One native call
        (``hot_submit``) holds the channel's lock against a hot call of another thread, gives the op its
        sequence number and this op's timeout and runs it; without a hot table no other door exists and
        Python numbers the op. Marks this rank's ABORT line if the op is left half-way (:meth:`left`),
        raises on a result code. The plan keeps the default timeout (a cached plan is the hot entry's)."""
        args = plan[0]
        try:
            if self.hot_table:
                rc = self._hot_submit(self.hot_table, plan[1], self.timeout_ns)
                if rc < 0:
                    raise self._busy_error()
            elif self.plain:  # the struct holds the default timeout (plan, run)
                self._seq = args.seq = self._seq + 1
                rc = self._chan_run(self.handle, plan[1])
            else:
                self._seq = args.seq = self._seq + 1
                args.timeout_ns = self.timeout_ns
                try:
                    rc = self._chan_run(self.handle, plan[1])
                finally:
                    args.timeout_ns = self.default_timeout_ns
        except BaseException as exc:  # Ctrl-C in a wait: the peers must learn this rank left
            self.left(args.seq - 1, exc, op=op)
            raise
        if rc:
            self.raise_for(rc, op=op)

    def run_hot(self, entry, *tensors: torch.Tensor, op: str) -> bool:
        """Offer the op to a native hot entry (:attr:`hot`: the tensor; :attr:`hot_gather`: output, input):
        True if it ran it, False if it did not serve it (the caller takes the Python path). Raises the op's
        error; an interrupted op marks this rank's ABORT line, as :meth:`submit` does."""
        try:
            rc = entry(*tensors)
        except BaseException as exc:  # Ctrl-C in the op's wait: the peers must learn this rank left
            self.left(self.seq - 1, exc, op=op)
            raise
        if rc > 0:
            self.raise_for(rc, op=op)
        return rc == 0

    def fail(self, opcode: int, text: str, kind: int = ERR_USAGE, *, op: str) -> None:
        """This rank cannot run the op (``text`` says why): run the handshake with the error posted so
        every rank raises (instead of this one raising alone and the others waiting for it)."""
        raw = text.encode()[: (VEC_CAP - 2) * 8]
        vec = self.vectors[self.rank]
        vec[0] = len(raw)
        vec.view(np.uint8)[8:8 + len(raw)] = memoryview(raw)
        self.run(op, op=opcode, in_off=0, out_off=-1, error=kind, itemsize=1)
        raise AssertionError("unreachable: an op whose header carries an error fails")  # pragma: no cover

    def left(self, seq: int, exc: BaseException, *, op: str) -> None:
        """An op that started at sequence number ``seq`` is being left by ``exc``, at any point (before it
        posted anything too): mark the communicator broken (ABORT lines) unless ``exc`` is a ZbcclError
        (C marked the native leaves; errors every rank raises together break nothing). Ops call it from
        ``except BaseException`` (free when nothing is raised)."""
        if not isinstance(exc, ZbcclError):
            self.abort(liveness.reason(exc), f"op #{seq + 1} ({op}) was left half-way by {type(exc).__name__}")

    def abort(self, why: int, text: str) -> None:
        """Publish that this rank left an op half-way: this channel's ABORT line (its in-op handshake reads
        it) and the rank's own (:func:`.liveness.mark_left`: every communicator of this rank refuses later
        ops, unless ``why`` is ``ABORT_PEER``)."""
        if why != ABORT_PEER:
            self.mark_broken(text)
        where = self.where or self.comm.role or WHERE_COLLECTIVE
        line = layout.slot_line(self.comm.slot, L_ABORT)
        liveness.mark_line(self.ctx, line, why, where=where, seq=self.seq)
        liveness.mark_left(self.ctx, why, text, where=where, seq=self.seq)

    def mark_broken(self, text: str) -> None:
        """Every later op on this rank refuses (:meth:`enter`), the hot entry's included."""
        self.broken = self.broken or text
        self.plain = False
        self.disable(0)

    def aborted(self, r: int) -> tuple[int, int]:
        """``(why, where)`` group rank ``r`` broke this communicator for (``ABORT_*``, ``WHERE_*``): its own
        ABORT line, else this channel's; ``(0, 0)`` if neither is set."""
        transport, g = self.ctx.heap.transport, self.comm.ranks[r]
        got = liveness.aborted(transport, g, liveness.ABORT_LINE)
        return got if got[0] else liveness.aborted(transport, g, layout.slot_line(self.comm.slot, L_ABORT))

    # --------------------------------------------------------- memory
    def offset_of(self, t: torch.Tensor) -> int:
        """Heap offset of a contiguous, non-empty tensor's data in this rank's heap (as large as it is now), or
        -1: the transport's answer (:meth:`~zbccl.heap.transports.base.Transport.offset_of`), no address here."""
        if not t.is_contiguous() or not t.numel():
            return -1
        return self.ctx.heap.offset_of(t)

    def block_addr(self, offset: int, nbytes: int) -> int:
        """Native-core address of ``[offset, offset+nbytes)`` of this rank's heap (bounds-checked), for an op's
        ``zb_op`` (a staged operand's block): the transport's native handle makes it."""
        return self.ctx.heap.addr(self.ctx.rank, offset, nbytes, op="collective")

    def sizes(self, counts: list[int]) -> int:
        """Address of an int64 copy of a size vector, cached per vector (alive as long as the plans
        that use it)."""
        key = tuple(counts)
        hit = self._sizes.get(key)
        if hit is None:
            if len(self._sizes) > 1024:  # the plans point into these arrays: they go too
                self._sizes.clear()
                self.forget_plans()
            arr = np.asarray(counts, dtype=np.int64)
            hit = self._sizes[key] = (int(arr.ctypes.data), arr)
        return hit[0]

    # --------------------------------------------------------- errors
    def raise_for(self, rc: int, *, op: str) -> None:
        """Raise the error of the last op's result code ``rc`` (see :func:`.diagnose.error_for`)."""
        raise error_for(self, rc, op=op)


def channel_of(comm: Communicator) -> OpChannel:
    """The communicator's op channel (its ``op_state``, which the ops layer owns), created on first use."""
    ch = comm.op_state
    if ch is None:
        if not hasattr(comm._ctx.prims, "chan_new"):
            raise ZbcclSystemError(
                "collective: the native core is not available (no C compiler?); see 'zbccl info' and the README")
        ch = comm.op_state = OpChannel(comm)
    return ch
