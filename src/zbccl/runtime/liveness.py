"""One liveness rule and one meaning of ABORT, for every wait of every protocol.

zbccl waits on peers in three places: the native op channel (``native/csrc/core/chan.c``
``wait_all``: every collective, and the communicator's barrier and EP's tagged barrier, which are
ops of the channel, ``ops/barrier.py``), p2p mailboxes (``adapters/p2p.py``; and the flag waits
of :mod:`.waits`), and the store's waits (``bootstrap/store.py``: the store ops, and init once the
ranks' pids are known). All of them apply this module's rule at each liveness interval
(``ZBCCL_LIVENESS_INTERVAL``); ``chan.c`` ``check_peers`` applies the same rule in C.

**ABORT** means: *this rank left an op half-way* (Ctrl-C, an unexpected exception, a timeout, a
lost peer), in any protocol, including before the op posted anything (the first op's store read).
Its communicators are broken until ``finalize()`` and ``init()`` (its heap memory stays usable). A rank publishes it on its
ABORT line (one per rank: the world slot's ``L_ABORT`` line; words in ``native/abi.py``
``WORDS``): VALUE non-zero, WHY (``ABORT_*``), WHERE (``WHERE_*``, the protocol). After
leaving by its own cause it refuses every later op on every communicator
(``ZbcclInvalidUsageError``, "broken"); a rank that left because a *peer* did (``ABORT_PEER``)
keeps reporting that peer instead. Errors every rank raises together (bad arguments, out of
memory, ranks out of step) break nothing. p2p receives are the one exception to "a timeout
leaves": a timed-out ``recv``/``wait`` is cancelled cleanly, so the group stays usable.

**The rule**, checked by a waiting rank at each liveness interval, in this order:

1. this rank's own ``finalize()`` ran (another thread): ``ZbcclInvalidUsageError``;
2. any member it waits with (not only the late ones) left an op half-way by its own cause (its
   ABORT line, reason other than ``ABORT_PEER``): ``ZbcclRemoteError`` naming it;
3. a member it still waits for failed (``zbccl.abort``), called ``finalize`` or died (the
   transport's dead peers: pidfds): ``ZbcclRemoteError`` naming it;
4. any member left an op because a peer did (``ABORT_PEER``): ``ZbcclRemoteError`` naming it.

**Init** has no heap to hold ABORT lines until its end, so its store waits watch the same rule
through the store (:func:`init_watch`): a rank that leaves init half-way announces it there
(:func:`left_init`, a per-rank counter holding its ``ABORT_*`` reason), and from the moment the
ranks' pids are known (after the hello exchange) the local peers' processes are watched by pidfd
(the transport's ``watch_peers``). A rank that dies before its hello is named at the timeout.

The order names the cause before its followers. Members that already reached what this rank waits
for are not checked for death in 3 (they may finish and exit), but their ABORT is: a rank that left
any op broke the group for everyone.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from ..errors import ZbcclError, ZbcclInvalidUsageError, ZbcclRemoteError, ZbcclTimeoutError
from ..heap import layout
from ..native.abi import (
    ABORT_EXCEPTION,
    ABORT_INTERRUPT,
    ABORT_PEER,
    ABORT_TIMEOUT,
    L_ABORT,
    W_WHERE,
    W_WHY,
    WHERE_BARRIER,
    WHERE_COLLECTIVE,
    WHERE_EP,
    WHERE_P2P,
    WHERE_STORE,
)

if TYPE_CHECKING:
    from .context import Context

__all__ = ["FINALIZED_WHILE_WAITING", "ABORT_LINE", "abort_addr", "aborted", "abort_error", "who_left", "check", "mark_left",
           "reason", "leave", "store_watch", "init_watch", "left_init"]

#: What an op still waiting when ``finalize()`` ran on its rank raises (after the op's name).
FINALIZED_WHILE_WAITING = "finalize() was called on this rank while the op waited"

_WHAT = {ABORT_INTERRUPT: "was interrupted (Ctrl-C)", ABORT_TIMEOUT: "timed out", ABORT_PEER: "lost a peer"}
_WHERE = {WHERE_COLLECTIVE: "a collective", WHERE_BARRIER: "a barrier", WHERE_EP: "an EP op",
          WHERE_P2P: "a send/recv", WHERE_STORE: "a store op (all_gather_object, new_group, destroy)"}


#: Signal-pad byte offset of a rank's own ABORT line (the world slot's ``L_ABORT`` line).
ABORT_LINE = layout.slot_line(0, L_ABORT)


def abort_addr(ctx: Context, rank: int) -> int:
    """Native-core address of global rank ``rank``'s own ABORT line (only for the native channel's table)."""
    return ctx.heap.ctrl_addr(rank, ABORT_LINE)


def aborted(transport, rank: int, line: int) -> tuple[int, int]:
    """``(why, where)`` of global rank ``rank``'s ABORT line at signal-pad byte ``line`` (``ABORT_*``,
    ``WHERE_*``), ``(0, 0)`` if not set."""
    if transport.load(rank, line) == 0:
        return 0, 0
    return (transport.load(rank, line + 8 * W_WHY) or ABORT_EXCEPTION,
            transport.load(rank, line + 8 * W_WHERE))


def abort_error(r: int, why: int, *, op: str, where: int = 0) -> ZbcclRemoteError:
    """What waiting for rank ``r`` raises once it left an op half-way for ``why``."""
    what = _WHAT.get(why, "hit an unexpected error")
    return ZbcclRemoteError(f"{op}: peer lost while waiting: rank {r} {what} in the middle of "
                            f"{_WHERE.get(where, 'a collective')} and left it; this communicator is broken "
                            "(finalize and init again)", ranks=(r,))


def who_left(ctx: Context, ranks: Iterable[int]) -> tuple[int, int, int] | None:
    """``(rank, why, where)`` of a rank among ``ranks`` (global) whose ABORT line is set, preferring one that
    left by its own cause over one that followed a peer; None if none did."""
    heap, found = ctx.heap, None
    for r in ranks:
        if r == ctx.rank or not heap.reachable(r):
            continue
        why, where = aborted(heap.transport, r, ABORT_LINE)
        if why and why != ABORT_PEER:
            return r, why, where
        if why and found is None:
            found = (r, why, where)
    return found


def check(ctx: Context, ranks: Sequence[int], *, op: str, pending: Iterable[int] | None = None,
          labels: dict[int, int] | None = None) -> None:
    """The liveness rule (see the module docstring) for a wait on ``ranks`` (global ranks), of which
    ``pending`` (default: all) have not arrived yet; ``labels`` maps global ranks to the numbers errors use.
    Returns if nothing is wrong."""
    if ctx.finalized:  # another thread of this rank called finalize(): leave before the heap goes
        raise ZbcclInvalidUsageError(f"{op}: {FINALIZED_WHILE_WAITING}", ranks=(ctx.rank,))
    labels = labels or {}
    left = who_left(ctx, ranks)
    if left is not None and left[1] != ABORT_PEER:
        raise abort_error(labels.get(left[0], left[0]), left[1], op=op, where=left[2])
    _check_pending(ctx, ranks if pending is None else pending, op=op, labels=labels)
    if left is not None:
        raise abort_error(labels.get(left[0], left[0]), left[1], op=op, where=left[2])


def _check_pending(ctx: Context, pending: Iterable[int], *, op: str, labels: dict[int, int]) -> None:
    """Step 3 of the rule: the late members' state and death."""
    pending = list(pending)
    if not pending:
        return
    dead = set(ctx.heap.transport.dead_peers())
    gone = []
    for r in pending:
        if r == ctx.rank or not ctx.heap.reachable(r):
            continue
        state = ctx.heap.header(r, layout.H_STATE)
        if state == layout.STATE_FAILED:
            gone.append((r, "failed"))
        elif state == layout.STATE_FINALIZED:
            gone.append((r, "called finalize"))
        elif r in dead:
            gone.append((r, "died (its process exited or was killed)"))
    if gone:
        gone = [(labels.get(r, r), why) for r, why in gone]
        what = "; ".join(f"rank {r} {why}" for r, why in gone)
        raise ZbcclRemoteError(f"{op}: peer lost while waiting: {what}", ranks=tuple(r for r, _ in gone))


def mark_left(ctx: Context, why: int, text: str, *, where: int, seq: int = 1) -> None:
    """Publish on this rank's ABORT line that it left an op half-way (the first reason stays), and, unless
    it only followed a peer (``ABORT_PEER``), break every communicator of this rank: their later ops refuse
    with ``text`` (``registry.check_usable``, the op channels and their native hot entries, p2p); memory
    (``zbccl.empty``, ``export``, ``memory_stats``) stays usable."""
    if ctx.finalized or ctx.forked:  # the heap is going (or is the parent's): nobody waits on it any more
        return
    transport, me = ctx.heap.transport, ctx.rank
    if transport.load(me, ABORT_LINE) == 0:  # the reason first: a peer reads it once it sees the line set
        transport.signal(me, ABORT_LINE + 8 * W_WHY, why)
        transport.signal(me, ABORT_LINE + 8 * W_WHERE, where)
        transport.signal(me, ABORT_LINE, max(1, seq))
    if why == ABORT_PEER or ctx.left is not None:
        return
    ctx.left = text
    for c in list(ctx.comms):
        mark = getattr(c.op_state, "mark_broken", None)
        if mark is not None:
            mark(text)


def reason(exc: BaseException) -> int:
    """The ``ABORT_*`` reason of leaving an op by ``exc``, or 0 when ``exc`` breaks nothing: an error every
    rank raises together (bad arguments, out of memory, out of step) or this rank's own finalize."""
    if isinstance(exc, ZbcclTimeoutError):
        return ABORT_TIMEOUT
    if isinstance(exc, ZbcclRemoteError):
        return ABORT_PEER
    if isinstance(exc, ZbcclError):
        return 0
    return ABORT_INTERRUPT if isinstance(exc, KeyboardInterrupt) else ABORT_EXCEPTION


def leave(ctx: Context, exc: BaseException, *, op: str, where: int, seq: int = 1) -> None:
    """An op is being left by ``exc`` (called from ``except BaseException`` at an op's boundary): mark
    this rank's ABORT line as :func:`reason` says."""
    why = reason(exc)
    if why:
        mark_left(ctx, why, f"op {op} was left half-way by {type(exc).__name__}", where=where, seq=seq)


def store_watch(ctx: Context, members: Sequence[int]):
    """The liveness check of a store wait among ``members`` (global ranks): ``watch(pending, op)``
    (``pending``: the members whose keys are missing) raises as :func:`check` does."""
    peers = [m for m in members if m != ctx.rank]

    def watch(pending: Sequence[int], op: str) -> None:
        check(ctx, peers, op=op, pending=[p for p in pending if p in peers])

    return watch


def left_init(boot, exc: BaseException) -> None:
    """This rank leaves init half-way by ``exc`` (after the hello exchange): tell the peers through the
    store (``left/<rank>`` holds the ``ABORT_*`` reason, ``left`` counts the ranks that left), so that
    their init waits name it within a few liveness intervals. Errors every rank raises together (init
    agrees on every failure it can) announce nothing. Best effort: the store may be gone."""
    why = reason(exc)
    if not why:
        return
    try:
        boot.add(f"left/{boot.rank}", why)
        boot.add("left", 1)
    except BaseException:  # noqa: BLE001 - the store is gone or this is a second Ctrl-C: the timeout remains
        pass


def init_watch(boot, transport):
    """The liveness rule of init's store waits on bootstrap ``boot`` (watch(pending, op), see
    ``bootstrap/store.py``): a member that left init (:func:`left_init`; by its own cause first, then one
    that followed a peer) or a pending member whose process died (``transport.dead_peers()``, after
    ``transport.watch_peers``; None before the hello exchange, when no pid is known) raises
    :class:`ZbcclRemoteError` naming it (the members' numbering)."""
    index = {m: i for i, m in enumerate(boot.members)}

    def watch(pending: Sequence[int], op: str) -> None:
        if boot.add("left", 0) > 0:  # one round trip while nobody left
            left = [(boot.members[r], boot.add(f"left/{r}", 0)) for r in range(boot.world_size) if r != boot.rank]
            left = [(r, why) for r, why in left if why]
            left.sort(key=lambda rw: rw[1] == ABORT_PEER)  # a cause before its followers
            absent = [m for m in pending if m not in {r for r, _ in left}]
            if left and absent and all(why == ABORT_TIMEOUT for _, why in left):
                # The leavers timed out waiting too: the cause is who never came, as this rank's own
                # timeout would say (at about the same moment; said now, naming the same ranks).
                timed = ", ".join(str(r) for r, _ in left)
                raise ZbcclTimeoutError(f"init: {op}: ranks {absent} never arrived (rank {timed} timed out "
                                        "waiting for them and left init)", ranks=tuple(absent))
            if left:
                r, why = left[0]
                what = _WHAT.get(why, "hit an unexpected error")
                raise ZbcclRemoteError(f"init: {op}: peer lost while waiting: rank {r} {what} in the middle of init "
                                       "and left it", ranks=(r,))
        if transport is None:
            return
        dead = set(transport.dead_peers())
        gone = [m for m in pending if index.get(m, -1) in dead]
        if gone:
            what = "; ".join(f"rank {m} died (its process exited or was killed)" for m in gone)
            raise ZbcclRemoteError(f"init: {op}: peer lost while waiting: {what}", ranks=tuple(gone))

    return watch
