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

from ..errors import ZbcclInvalidUsageError, ZbcclRemoteError, ZbcclTimeoutError
from ..heap import layout
from ..runtime.threads import nthreads
from .channel import L_ARRIVE, L_DONE, L_HEADER, L_PHASE, Header, OpChannel

__all__ = ["NativeChannel", "native_channel"]

RC_OK, RC_TIMEOUT, RC_DEAD, RC_GONE, RC_MISMATCH, RC_STEP, RC_SPAN, RC_PEER_ERROR = range(8)


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
                         heap.ctrl_addr(g, layout.H_STATE), ch.heap_base[r], ch.heap_size[r], fd])
        table = np.asarray(rows, dtype=np.int64)
        self.handle = self.core.chan_new(ch.world_size, ch.rank, ctx.spin, ctx.liveness_ns,
                                         int(ctx.timeout * 1e9), nthreads(), int(table.ctypes.data))
        self._finalizer = weakref.finalize(self, self.core.chan_free, self.handle)
        #: ``chan_all_reduce(handle, seq, dst, offset, count, itemsize, dtype, op, algo) -> rc``
        self.all_reduce = self.core.chan_all_reduce

    def raise_for(self, rc: int, *, op: str, show) -> None:
        ch = self.ch
        _, rank, field, hdrs_ptr = self.core.chan_result(self.handle)
        hdrs = np.frombuffer((ctypes.c_int64 * (16 * ch.world_size)).from_address(hdrs_ptr), dtype=np.int64)
        hdrs = hdrs.reshape(ch.world_size, 16)
        if rc == RC_TIMEOUT:
            raise ZbcclTimeoutError(
                f"{op}: timed out after {ch.ctx.timeout:.1f}s waiting for rank {rank}; it never arrived",
                ranks=(rank,))
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
        if rc == RC_PEER_ERROR:
            raise ZbcclInvalidUsageError(f"{op}: rank {rank} passed invalid arguments: {ch.error_text(rank)}",
                                         ranks=(rank,))
        if rc == RC_STEP:
            raise ZbcclInvalidUsageError(
                f"{op}: ranks out of step, expected op #{ch.seq} everywhere, got rank {rank} at "
                f"#{int(hdrs[rank, Header.SEQ])}", ranks=(rank,))
        raise ZbcclInvalidUsageError(
            f"{op}: rank {rank}'s operand is outside its heap (offset {int(hdrs[rank, Header.IN_OFF])})",
            ranks=(rank,))


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
