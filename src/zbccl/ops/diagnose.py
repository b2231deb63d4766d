"""What went wrong in an op, for its error: result codes of the native call, late ranks.

:func:`error_for` turns the native call's result code into the exception every
rank raises, from the header and size-vector copies C took before the op's
DONE handshake. For a timeout, "never arrived" must mean exactly that: each
late rank's flags in its own comm slot tell where it is instead (its
``ARRIVE``: the last op it entered, its ``DONE``: the last op it finished, and
its barrier epoch). These are read after the timeout, without
synchronisation: the rank may move on while we read, so the text is a
diagnosis, never a decision.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..errors import (
    ZbcclError,
    ZbcclInvalidUsageError,
    ZbcclOutOfMemoryError,
    ZbcclRemoteError,
    ZbcclTimeoutError,
)
from ..heap import layout
from ..native import abi
from ..native.abi import (
    ABORT_TIMEOUT,
    ERR_NOMEM,
    ERR_USAGE,
    H_ALGO,
    H_DTYPE,
    H_IN_OFF,
    H_OP,
    H_REDOP,
    H_ROW,
    H_SEQ,
    L_ABORT,
    L_ARRIVE,
    L_DONE,
    L_HEADER,
    OP_NAMES,
    RC_ABORTED,
    RC_DEAD,
    RC_GONE,
    RC_MISMATCH,
    RC_NOMEM,
    RC_PEER_ERROR,
    RC_SIZES,
    RC_SPLITS,
    RC_STEP,
    RC_TIMEOUT,
    VEC_CAP,
)
from ..runtime.liveness import (
    ABORT_LINE,
    FINALIZED_WHILE_WAITING,
    abort_error,
    first_cause,
    waits_on,
    who_left,
)
from .dtypes import CODE_DTYPES, op_name

#: Results after which this rank left the op half-way (C marked its ABORT line, chan.c leave_op; later ops
#: see a peer's ABORT again, and a timed-out rank refuses them itself).
LEAVING = frozenset((RC_TIMEOUT, RC_ABORTED, RC_DEAD, RC_GONE))

if TYPE_CHECKING:
    from .channel import OpChannel

__all__ = ["error_for", "late_message", "describe", "show_field", "barrier_tags", "FIELD_NAMES"]

#: Header fields as error messages name them.
FIELD_NAMES = {abi.H_OP: "op", H_DTYPE: "dtype", H_REDOP: "reduce op", abi.H_IN_NUMEL: "input numel",
               abi.H_OUT_NUMEL: "output numel", H_ALGO: "algorithm", abi.H_ROOT: "root rank",
               H_ROW: "elements per row", abi.H_AUX: "chunk elements", abi.H_DIGEST: "barrier tag"}
#: What AUX carries where it is not all_reduce's chunk, by the header's op code.
AUX_NAMES = {abi.OP_ALL_GATHER: "the gathered dimension (rows before it, 0: dim 0)",
             abi.OP_REDUCE_SCATTER: "the scattered dimension (rows before it, 0: dim 0)"}


def show_field(field: int, value: int) -> str:
    """A header value as error messages print it (dtype and op names, not codes)."""
    if field == H_DTYPE:
        return str(CODE_DTYPES.get(value, value)).removeprefix("torch.")
    if field == H_REDOP:
        return op_name(value)
    if field == H_ALGO:
        return abi.ALGO_NAMES.get(value, str(value))
    if field == abi.H_OP:
        return abi.OP_NAMES.get(value, str(value))
    return str(value)


def barrier_tags(ch: OpChannel) -> list[int] | None:
    """Every group rank's tag if the last op was a tagged barrier that failed on them (``RC_MISMATCH`` on
    ``DIGEST``: every rank read the same headers, so every rank gets the same list), else None."""
    hdrs, _, res = _copies(ch)
    if res[0] != RC_MISMATCH or res[2] != abi.H_DIGEST:
        return None
    return [int(v) for v in hdrs[:, abi.H_DIGEST]]


def _copies(ch: OpChannel) -> tuple[np.ndarray, np.ndarray, tuple]:
    """Every rank's header and the two size-vector areas as the last op copied them (before DONE)."""
    res = ch.prims.chan_result(ch.handle)
    hdrs, vecs = (np.array(memoryview(res[i]).cast("q"), dtype=np.int64) for i in (3, 5))  # bytes C copied
    return hdrs.reshape(ch.world_size, 16), vecs.reshape(2, VEC_CAP), res


def error_for(ch: OpChannel, rc: int, *, op: str) -> ZbcclError:
    """The error of the last op's result code ``rc`` on channel ``ch`` (from the copies C took before
    the op's DONE handshake: a peer may overwrite the originals with its next op right after)."""
    hdrs, vecs, (_, rank, field, _, late, _, writer) = _copies(ch)
    error = _error_for(ch, rc, hdrs, vecs, rank, field, late, op=op)
    if rc == RC_TIMEOUT:  # this rank gave up on the op (C marked its ABORT lines, chan.c leave_op)
        ch.abort(ABORT_TIMEOUT, str(error))
    if rc in LEAVING:
        if writer >= 0:
            error.args = (f"{error.args[0]}; rank {writer} was still inside the op after this rank left and may "
                          "still write into its tensors: do not reuse them",)
    return error


def _error_for(ch: OpChannel, rc: int, hdrs, vecs, rank: int, field: int, late: list, *, op: str) -> ZbcclError:
    W = ch.world_size
    if rc == RC_TIMEOUT:
        late = late or [rank]
        return ZbcclTimeoutError(late_message(ch, late, op=op), ranks=tuple(late))
    if rc == RC_GONE and rank == ch.rank:  # chan.c check_peers: our own STATE is FINALIZED
        return ZbcclInvalidUsageError(f"{op}: {FINALIZED_WHILE_WAITING}", ranks=(ch.comm.global_rank,))
    if rc == RC_ABORTED:  # name a rank that left by its own cause before one that followed a peer
        first = who_left(ch.ctx, ch.comm.ranks)
        if first is not None and first[0] in ch.comm.ranks:
            rank = ch.comm.ranks.index(first[0])
        why, where = ch.aborted(rank)
        if why == ABORT_TIMEOUT:  # a co-waiter gave up first: the ranks that never came are the cause
            late = _not_arrived(ch, skip=rank)
            if late:
                return ZbcclTimeoutError(f"{late_message(ch, late, op=op)} (rank {rank} timed out waiting "
                                         "for them first and left the op)", ranks=tuple(late))
        return abort_error(rank, why, op=op, where=where, ctx=ch.ctx, g=ch.comm.ranks[rank], lines=_abort_lines(ch),
                           label=_label(ch))
    if rc in (RC_DEAD, RC_GONE):
        state = ch.ctx.heap.header(ch.comm.ranks[rank], layout.H_STATE)
        why = {layout.STATE_FINALIZED: "called finalize", layout.STATE_FAILED: "failed"}.get(
            state, "died (its process exited or was killed)")
        # one that finalized or died after it left an op because of another: that one is named first
        more, first = first_cause(ch.ctx, ch.comm.ranks[rank], _abort_lines(ch), _label(ch))
        if not more:  # or after its send/recv gave up on another
            more, first = waits_on(ch.ctx, ch.comm.ranks[rank], _label(ch))
        return ZbcclRemoteError(f"{op}: peer lost while waiting: rank {rank} {why}{more}",
                                ranks=(rank,) if first is None else (first, rank))
    if rc == RC_MISMATCH:
        got = ", ".join(f"rank {r} {show_field(field, int(v))}" for r, v in enumerate(hdrs[:, field]))
        name = FIELD_NAMES.get(field, field)
        if field == abi.H_AUX:  # the ops agree on OP before AUX: rank 0's is every rank's
            name = AUX_NAMES.get(int(hdrs[0, abi.H_OP]), name)
        return ZbcclInvalidUsageError(f"{op}: ranks disagree on {name}, got {got}",
                                     ranks=tuple(range(W)))
    if rc in (RC_PEER_ERROR, RC_NOMEM):
        return _peer_error(op, rank, ERR_NOMEM if rc == RC_NOMEM else ERR_USAGE, _text_of(vecs[0]),
                          ranks=(rank,))
    if rc == RC_SIZES:
        row = max(1, int(hdrs[0, H_ROW]))
        return ZbcclInvalidUsageError(_sizes_message(op, vecs[0][:W], rank, vecs[1][:W], row), ranks=(0, rank))
    if rc == RC_SPLITS:
        q, r = rank, field
        return ZbcclInvalidUsageError(
            f"{op}: split sizes disagree, rank {q} sends {int(vecs[0][r]) // max(1, int(hdrs[q, H_ROW]))} "
            f"rows to rank {r} but rank {r} expects {int(vecs[1][W + q]) // max(1, int(hdrs[r, H_ROW]))}",
            ranks=(q, r))
    if rc == RC_STEP:
        return ZbcclInvalidUsageError(
            f"{op}: ranks out of step, expected op #{ch.seq} everywhere, got rank {rank} at "
            f"#{int(hdrs[rank, H_SEQ])}", ranks=(rank,))
    return ZbcclInvalidUsageError(
        f"{op}: rank {rank}'s operand is outside its heap (offset {int(hdrs[rank, H_IN_OFF])})", ranks=(rank,))


def _abort_lines(ch: OpChannel) -> tuple[int, int]:
    """The ABORT lines a rank of ``ch`` may have marked: its own (the world slot's) and the channel's."""
    return ABORT_LINE, layout.slot_line(ch.comm.slot, L_ABORT)


def _label(ch: OpChannel):
    """World rank -> the number ``ch``'s errors use (its group rank; the world rank, said so, otherwise)."""
    ranks = ch.comm.ranks
    return lambda g: ranks.index(g) if g in ranks else f"{g} (world)"


def _text_of(vec: np.ndarray) -> str:
    """The error text a rank posted in its size-vector area: int64 length, then UTF-8 bytes."""
    n = max(0, min(int(vec[0]), VEC_CAP * 8 - 16))
    return bytes(vec.view(np.uint8)[8:8 + n]).decode(errors="replace")


def _peer_error(op: str, r: int, kind: int, text: str, *, ranks: tuple[int, ...]) -> ZbcclError:
    """The error every rank raises when rank ``r`` posted an error of ``kind`` with ``text``."""
    if kind == ERR_NOMEM:
        return ZbcclOutOfMemoryError(f"{op}: rank {r} ran out of memory: {text}", ranks=ranks)
    return ZbcclInvalidUsageError(f"{op}: rank {r} passed invalid arguments: {text}", ranks=ranks)


def _sizes_message(op: str, ref: np.ndarray, r: int, got: np.ndarray, row: int) -> str:
    unit = "elements" if row == 1 else "rows"
    show = lambda v: str([int(x) // max(1, row) for x in v])  # noqa: E731
    return (f"{op}: ranks disagree on sizes ({unit} per rank), expected {show(ref)} (rank 0) on every rank, "
            f"got {show(got)} on rank {r}")


def describe(ch: OpChannel, r: int) -> str:
    """One late group rank ``r``, as seen from this rank at op ``ch.seq``."""
    g, slot, heap = ch.comm.ranks[r], ch.comm.slot, ch.ctx.heap

    def load(i: int) -> int:
        return heap.header(g, layout.slot_line(slot, i))

    arrive, done = load(L_ARRIVE), load(L_DONE)
    if arrive == ch.seq:
        return f"rank {r} entered this collective (#{ch.seq}) but has not finished it"
    if arrive > done or arrive > ch.seq:
        opcode = heap.header(g, layout.slot_line(slot, L_HEADER) + H_OP * 8)
        name = OP_NAMES.get(opcode, f"op code {opcode}")
        return (f"rank {r} is in a different collective: {name} #{arrive} (this rank is at #{ch.seq}), "
                "so an earlier op did not end on every rank")
    return f"rank {r} never arrived (the last collective it finished here is #{done})"


def _not_arrived(ch: OpChannel, *, skip: int) -> list[int]:
    """Group ranks (other than this one and ``skip``) that have not posted ARRIVE for op ``ch.seq``."""
    heap, slot = ch.ctx.heap, ch.comm.slot
    return [r for r, g in enumerate(ch.comm.ranks) if r not in (ch.rank, skip)
            and heap.header(g, layout.slot_line(slot, L_ARRIVE)) < ch.seq]


def late_message(ch: OpChannel, late: list[int], *, op: str) -> str:
    """The timeout message: the late ranks, and what each of them is doing."""
    what = "; ".join(describe(ch, r) for r in late)
    return f"{op}: timed out after {ch.timeout:.1f}s waiting for ranks {late}: {what}"
