"""The native fast path of the collectives: one C call per op, same protocol.

:func:`native_channel` builds the C-side mirror of an :class:`OpChannel`
(addresses of every rank's flags, header, state word and heap, and the
liveness socket of each peer). An op posts the same 16-field header as the
Python path, so ranks on either path interoperate. A non-zero result code is
turned here into the same errors the Python path raises.
"""

from __future__ import annotations

import ctypes
import weakref

import numpy as np

from .. import env
from ..errors import ZbcclInvalidUsageError, ZbcclRemoteError, ZbcclTimeoutError
from ..heap import layout
from ..runtime.registry import FINALIZED_WHILE_WAITING
from ..runtime.threads import nthreads
from .channel import (
    ERR_NOMEM,
    ERR_USAGE,
    L_ABORT,
    L_ARRIVE,
    L_DONE,
    L_HEADER,
    L_PHASE,
    VECTOR_CAPACITY,
    Header,
    OpChannel,
    peer_error,
    sizes_message,
    text_of,
)
from .diagnose import late_message

__all__ = ["NativeChannel", "native_channel", "RC_FALLBACK"]

# Result codes of the native ops (chan.h).
(RC_OK, RC_TIMEOUT, RC_DEAD, RC_GONE, RC_MISMATCH, RC_STEP, RC_SPAN, RC_PEER_ERROR, RC_SPLITS, RC_FALLBACK,
 RC_INTERRUPTED, RC_NOMEM, RC_SIZES, RC_ABORTED) = range(14)


class NativeChannel:
    """Owns the C channel of one communicator and this rank's header staging buffer."""

    def __init__(self, ch: OpChannel) -> None:
        comm, ctx, heap = ch.comm, ch.ctx, ch.ctx.heap
        self.core = ctx.prims
        self.ch = ch
        rows = []
        for r, g in enumerate(comm.ranks):
            def line(i: int, g: int = g) -> int:
                return heap.ctrl_addr(g, layout.slot_line(comm.slot, i))

            fd = -1 if g == ctx.rank else heap.transport.liveness_fd(g)
            rows.append([line(L_ARRIVE), line(L_PHASE), line(L_DONE), line(L_HEADER),
                         heap.ctrl_addr(g, layout.H_STATE), ch.heap_base[r],
                         heap.ctrl_addr(g, layout.H_HEAP_BYTES), fd,  # the live size word: heaps grow
                         int(ch.vectors[r].ctypes.data), line(L_ABORT)])
        table = np.asarray(rows, dtype=np.int64)
        self.handle = self.core.chan_new(ch.world_size, ch.rank, ctx.spin, ctx.liveness_ns,
                                         int(ctx.timeout * 1e9), nthreads(), int(table.ctypes.data))
        self._finalizer = weakref.finalize(self, self.core.chan_free, self.handle)
        self._timeout = ctx.timeout
        self.stores = StoreKind(self)
        # The native ops (signatures in native/csrc/chan_ops.c); each returns a result code.
        self.all_reduce = self.core.chan_all_reduce
        self.all_gather = self.core.chan_all_gather
        self.all_to_all = self.core.chan_all_to_all
        self.reduce_scatter = self.core.chan_reduce_scatter
        self.broadcast = self.core.chan_broadcast

    def set_timeout(self, seconds: float) -> None:
        """The next ops' wait budget (the op's ``timeout=``; set only when it changes)."""
        if seconds != self._timeout:
            self.core.chan_timeout(self.handle, max(1, int(seconds * 1e9)))
            self._timeout = seconds

    def headers(self) -> list[tuple[int, ...]]:
        """Every rank's header as copied by the last op (before its DONE handshake)."""
        return [tuple(int(x) for x in row) for row in self._header_copies()]

    def _header_copies(self) -> np.ndarray:
        hdrs_ptr = self.core.chan_result(self.handle)[3]
        W = self.ch.world_size
        return np.frombuffer((ctypes.c_int64 * (16 * W)).from_address(hdrs_ptr), dtype=np.int64).reshape(W, 16)

    def _vector_copies(self, addr: int) -> np.ndarray:
        """The two size-vector areas the last failed op copied before its DONE handshake."""
        buf = (ctypes.c_int64 * (2 * VECTOR_CAPACITY)).from_address(addr)
        return np.frombuffer(buf, dtype=np.int64).reshape(2, VECTOR_CAPACITY).copy()

    def raise_for(self, rc: int, *, op: str, show) -> None:
        """Raise the error of the last op's result code ``rc`` (the Python path's wording)."""
        ch = self.ch
        _, rank, field, _, late, vec_addr = self.core.chan_result(self.handle)
        hdrs = self._header_copies()
        if rc == RC_TIMEOUT:
            late = late or [rank]
            raise ZbcclTimeoutError(late_message(ch, late, op=op), ranks=tuple(late))
        if rc == RC_GONE and rank == ch.rank:  # chan.c check_peers: our own STATE is FINALIZED
            raise ZbcclInvalidUsageError(f"{op}: {FINALIZED_WHILE_WAITING}", ranks=(ch.comm.global_rank,))
        if rc == RC_ABORTED:
            raise ch.abort_error(rank, op=op)
        if rc in (RC_DEAD, RC_GONE):
            g = ch.comm.ranks[rank]
            state = ch.ctx.heap.header(g, layout.H_STATE)
            why = {layout.STATE_FINALIZED: "called finalize", layout.STATE_FAILED: "failed"}.get(
                state, "died (its process exited or was killed)")
            raise ZbcclRemoteError(f"{op}: peer lost while waiting: rank {rank} {why}", ranks=(rank,))
        if rc == RC_MISMATCH:
            got = ", ".join(f"rank {r} {show(field, int(v))}" for r, v in enumerate(hdrs[:, field]))
            raise ZbcclInvalidUsageError(f"{op}: ranks disagree on {Header.NAMES.get(field, field)}, got {got}",
                                         ranks=tuple(range(ch.world_size)))
        vecs = self._vector_copies(vec_addr)
        if rc in (RC_PEER_ERROR, RC_NOMEM):
            raise peer_error(op, rank, ERR_NOMEM if rc == RC_NOMEM else ERR_USAGE, text_of(vecs[0]), ranks=(rank,))
        W = ch.world_size
        if rc == RC_SIZES:
            row = max(1, int(hdrs[0, Header.ROW]))
            raise ZbcclInvalidUsageError(sizes_message(op, vecs[0][:W], rank, vecs[1][:W], row), ranks=(0, rank))
        if rc == RC_SPLITS:
            q, r = rank, field
            raise ZbcclInvalidUsageError(
                f"{op}: split sizes disagree, rank {q} sends {int(vecs[0][r]) // max(1, int(hdrs[q, Header.ROW]))} "
                f"rows to rank {r} but rank {r} expects {int(vecs[1][W + q]) // max(1, int(hdrs[r, Header.ROW]))}",
                ranks=(q, r))
        if rc == RC_STEP:
            raise ZbcclInvalidUsageError(
                f"{op}: ranks out of step, expected op #{ch.seq} everywhere, got rank {rank} at "
                f"#{int(hdrs[rank, Header.SEQ])}", ranks=(rank,))
        raise ZbcclInvalidUsageError(
            f"{op}: rank {rank}'s operand is outside its heap (offset {int(hdrs[rank, Header.IN_OFF])})",
            ranks=(rank,))


class StoreKind:
    """Per rank: cached or streaming stores for the gathers of large twoshot all_reduces.

    The gather writes slices of this rank's tensor that the peer has just read. What that
    costs depends on the host and changes over time (docs/benchmarks.md: on the test VM cached
    stores win by 15-20% in one state and streaming stores by 2x in the other). So each rank
    keeps, per power-of-two size bucket, an average of the whole op's ns/byte under both
    kinds, uses the faster one, and tries the other every ``EXPLORE``-th op of that bucket.
    Every rank sees the same op sizes in the same order, so ranks explore in step. The choice is local: it changes no byte of
    the protocol, so ranks may differ. ``ZBCCL_STREAM_STORES=on/off`` fixes it.
    """

    EXPLORE = 32
    MARGIN = 0.05  # switch only for a clear win: timing noise must not flip the choice
    MIN_BYTES = 1 << 20  # ops from this size on are timed and adapt
    SLICE_BYTES = 256 << 10  # gather slices from this size on stream when streaming is chosen

    def __init__(self, nat: NativeChannel) -> None:
        self.nat = nat
        #: log2 size bucket -> [avg ns/byte cached, avg ns/byte streaming, ops, ops cached, ops streaming]
        self.stats: dict[int, list] = {}
        self.current = 0
        mode = env.STREAM_STORES.get().lower()
        self.fixed = {"on": 1, "off": 0}.get(mode)
        if self.fixed is None and mode != "auto":
            raise ZbcclInvalidUsageError(f"ZBCCL_STREAM_STORES: expected auto, on or off, got {mode!r}")
        self._use(self.fixed or 0)

    def _use(self, kind: int) -> None:
        self.nat.core.chan_configure(self.nat.handle, self.SLICE_BYTES if kind else 0)
        self.current = kind

    def before(self, nbytes: int) -> None:
        """Pick the store kind for an all_reduce of ``nbytes`` (per size bucket)."""
        if self.fixed is not None or nbytes < self.MIN_BYTES:
            return
        st = self.stats.setdefault(nbytes.bit_length(), [None, None, 0, 0, 0])
        if st[0] is None or st[1] is None:
            kind = st[2] % 2  # alternate until both kinds have a warmed-up sample
        else:
            close = abs(st[1] - st[0]) < self.MARGIN * min(st[0], st[1])
            best = self.current if close else int(st[1] < st[0])
            kind = 1 - best if st[2] % self.EXPLORE == self.EXPLORE - 1 else best
        if kind != self.current:
            self._use(kind)

    def after(self, nbytes: int, elapsed_ns: int) -> None:
        """Learn from an all_reduce of ``nbytes`` that took ``elapsed_ns`` with the current kind.

        The first op of each kind in a bucket only warms up (cold caches, first use of the
        tensor) and is not averaged.
        """
        if self.fixed is not None or nbytes < self.MIN_BYTES:
            return
        st = self.stats[nbytes.bit_length()]
        kind = self.current
        st[2] += 1
        st[3 + kind] += 1
        if st[3 + kind] == 1:
            return
        rate = elapsed_ns / nbytes
        st[kind] = rate if st[kind] is None else 0.75 * st[kind] + 0.25 * rate


def native_channel(ch: OpChannel) -> NativeChannel | None:
    """The channel's native mirror, or None when the native core is unavailable."""
    nat = ch.__dict__.get("native")
    if nat is False:  # switched off (tests of the Python path)
        return None
    if nat is None:
        if not hasattr(ch.prims, "chan_new") or ch.world_size > 256:  # chan.c's ZB_MAXW
            ch.__dict__["native"] = False
            return None
        nat = ch.__dict__["native"] = NativeChannel(ch)
    return nat
