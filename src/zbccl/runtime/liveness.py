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

**Members on other hosts** (reached through the transport's verbs, never mapped here) follow the same rule: their
ABORT lines and state words are read through the verbs, and before anything is read the transport's own verdict
(``dead_peers``, ``unreachable_peers``; never blocks) names a pending one that died or called finalize (its host
answers, its engine does not: ``ZbcclRemoteError``) or whose host stopped answering
(``ZbcclTimeoutError``), with its host (``Transport.where``). A read that fails names the member the same way if
this wait still waits for it, and is skipped otherwise.

**Init** has no heap to hold ABORT lines until its end, so its store waits watch the same rule
through the store (:func:`init_watch`): a rank that leaves init half-way announces it there
(:func:`left_init`, a per-rank counter holding its ``ABORT_*`` reason), and from the moment the
ranks' pids are known (after the hello exchange) the local peers' processes are watched by pidfd
(the transport's ``watch_peers``). Members on other hosts, whom no pidfd sees and no transport reaches before
``establish``, are watched by a heartbeat through the store (:class:`InitBeat`, from before each rank's hello
record until init ends): a pending one whose beat stood still for ``BEAT_STALE_S`` seconds is named, with its
host, as stopped answering (``ZbcclTimeoutError``: it died, or its host is down or cut off). A rank that dies
before its hello is named at the timeout.

**The chain.** A rank that leaves because of another records which (VIA) and the first rank of the chain
(CAUSE) on its ABORT line, and errors name that first rank and the chain: :mod:`.chain`.

The order names the cause before its followers. Members that already reached what this rank waits
for are not checked for death in 3 (they may finish and exit), but their ABORT is: a rank that left
any op broke the group for everyone.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from ..errors import ZbcclError, ZbcclInvalidUsageError, ZbcclRemoteError, ZbcclTimeoutError
from ..heap import layout
from ..native.abi import (
    ABORT_EXCEPTION,
    ABORT_INTERRUPT,
    ABORT_PEER,
    ABORT_TIMEOUT,
    W_CAUSE,
    W_VIA,
    W_WHERE,
    W_WHY,
)
from .chain import (
    ABORT_LINE,
    WAIT_LINE,
    WHAT,
    WHERE,
    aborted,
    chain,
    first_cause,
    init_chain,
    waiting,
    waits_on,
    words,
)

if TYPE_CHECKING:
    from .context import Context

__all__ = ["FINALIZED_WHILE_WAITING", "ABORT_LINE", "WAIT_LINE", "waiting", "waits_on", "abort_addr", "aborted", "abort_error", "chain", "first_cause", "who_left", "check",
           "mark_line", "mark_left", "reason", "leave", "far_members", "lost_error", "store_watch", "init_watch", "left_init",
           "InitBeat", "BEAT_S", "BEAT_STALE_S"]

#: What an op still waiting when ``finalize()`` ran on its rank raises (after the op's name).
FINALIZED_WHILE_WAITING = "finalize() was called on this rank while the op waited"
#: Init's heartbeat through the store (:class:`InitBeat`): a beat every ``BEAT_S`` seconds; a member on another
#: host that an init wait still waits for, and whose beat stood still for ``BEAT_STALE_S`` seconds, is named.
#: Generous against what delays a live rank's beat: a store wait holding the store's client (at most four
#: liveness intervals), the GIL, oversubscribed cores.
BEAT_S = 1.0
BEAT_STALE_S = 10.0

def abort_addr(ctx: Context, rank: int) -> int:
    """Native-core address of global rank ``rank``'s own ABORT line (only for the native channel's table)."""
    return ctx.heap.ctrl_addr(rank, ABORT_LINE)


def abort_error(r: int, why: int, *, op: str, where: int = 0, ctx: Context | None = None, g: int | None = None,
                lines: Sequence[int] = (ABORT_LINE,), label=None) -> ZbcclRemoteError:
    """What waiting for rank ``r`` raises once it left an op half-way for ``why``. With ``ctx`` and ``g``
    (``r``'s world rank; ``lines``: the ABORT lines to read, ``label``: world rank -> the number errors use)
    a rank that left because of another also names the first cause and the chain (:func:`chain`)."""
    what = WHAT.get(why, "hit an unexpected error")
    text = f"{op}: peer lost while waiting: rank {r} {what} in the middle of {WHERE.get(where, 'a collective')} and left it"
    ranks: tuple = (r,)
    if ctx is not None and g is not None:
        more, first = first_cause(ctx, g, lines, label)
        text += more
        ranks = (first, r) if first is not None else ranks
    err = ZbcclRemoteError(text + "; this communicator is broken (finalize and init again)", ranks=ranks)
    err.via = g  # the world rank this error is about: a rank leaving by it records it (VIA, :func:`leave`)
    return err


def who_left(ctx: Context, ranks: Iterable[int], far: Iterable[int] = ()) -> tuple[int, int, int] | None:
    """``(rank, why, where)`` of a rank among ``ranks`` (global) whose ABORT line is set, preferring one that
    left by its own cause over one that followed a peer; None if none did. Read: the ranks mapped here, and
    those of ``far`` (on other hosts, through the verbs; one whose read fails is skipped: :func:`check` names it
    if it still waits for it)."""
    heap, found, far = ctx.heap, None, set(far)
    for r in ranks:
        if r == ctx.rank or not (heap.reachable(r) or r in far):
            continue
        try:
            why, where = aborted(heap.transport, r, ABORT_LINE)
        except (ZbcclRemoteError, ZbcclTimeoutError):  # (only across hosts) gone: judged if still awaited
            continue
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
    far, lost = far_members(ctx, ranks, ranks if pending is None else pending)
    left = who_left(ctx, ranks, far)
    if left is not None and left[1] != ABORT_PEER:
        raise _left_error(ctx, left, op=op, labels=labels)
    if lost is not None:
        raise lost_error(ctx, *lost, op=op, labels=labels)
    _check_pending(ctx, ranks if pending is None else pending, op=op, labels=labels, far=far)
    if left is not None:
        raise _left_error(ctx, left, op=op, labels=labels)


def far_members(ctx: Context, ranks: Sequence[int], pending: Iterable[int]) -> tuple[set[int], tuple | None]:
    """The members of ``ranks`` on other hosts (reached through the transport's verbs, not mapped here): those
    whose words can be read now, and the pending ones the transport knows lost, as ``(kind, ranks)`` (None:
    none): "dead" (their host answers, their transport engine does not: they exited, were killed or called
    finalize) before "unreachable" (their host stopped answering; a read would block until the transport gave
    up). Never blocks."""
    heap = ctx.heap
    t = heap.transport
    far = [r for r in ranks if r != ctx.rank and not heap.reachable(r) and t.reachable(r)]
    if not far:
        return set(), None
    dead, cut = set(t.dead_peers()), set(t.unreachable_peers())
    pending = set(pending)
    for kind, group in (("dead", dead), ("unreachable", cut)):
        lost = [r for r in far if r in group and r in pending]
        if lost:
            return set(), (kind, lost)
    return {r for r in far if r not in dead and r not in cut}, None


def _read_far(ctx: Context, read, op: str, labels: dict[int, int]):
    """``read()``; a read of a member on another host that failed (the transport names it: gone, or its host
    unreachable) is raised as this wait's error, in its numbering and in the words of :func:`lost_error`
    (the monitor had not judged it yet)."""
    try:
        return read()
    except (ZbcclRemoteError, ZbcclTimeoutError) as exc:
        kind = "dead" if isinstance(exc, ZbcclRemoteError) else "unreachable"
        raise lost_error(ctx, kind, [r for r in exc.ranks if isinstance(r, int)], op=op, labels=labels) from None


def lost_error(ctx: Context, kind: str, lost: list[int], *, op: str, labels: dict[int, int]) -> ZbcclError:
    where = "; ".join(f"rank {labels.get(r, r)} on {ctx.heap.transport.where(r)}" for r in lost)
    ranks = tuple(labels.get(r, r) for r in lost)
    if kind == "dead":
        err: ZbcclError = ZbcclRemoteError(f"{op}: peer lost while waiting: {where} died or called finalize (its "
                                           "host answers, its transfer engine is gone)", ranks=ranks)
    else:
        err = ZbcclTimeoutError(f"{op}: peer lost while waiting: {where} is unreachable (no answer: a network "
                                "partition or a host down)", ranks=ranks)
    err.via = lost[0]  # (a world rank: a rank leaving by this error records it, and its followers name it)
    return err


def _left_error(ctx: Context, left: tuple[int, int, int], *, op: str, labels: dict[int, int]) -> ZbcclRemoteError:
    def label(q: int) -> int | str:
        return labels.get(q, q) if not labels or q in labels else f"{q} (world)"

    return abort_error(labels.get(left[0], left[0]), left[1], op=op, where=left[2], ctx=ctx, g=left[0], label=label)


def _check_pending(ctx: Context, pending: Iterable[int], *, op: str, labels: dict[int, int],
                   far: Iterable[int] = ()) -> None:
    """Step 3 of the rule: the late members' state and death (those of ``far``, on other hosts, through the
    verbs: :func:`far_members` judged their death)."""
    pending, far = list(pending), set(far)
    if not pending:
        return
    dead = set(ctx.heap.transport.dead_peers())
    gone, first = [], None
    for r in pending:
        if r == ctx.rank or not (ctx.heap.reachable(r) or r in far):
            continue
        state = _read_far(ctx, lambda r=r: ctx.heap.header(r, layout.H_STATE), op, labels)
        if state == layout.STATE_FAILED:
            gone.append((r, "failed"))
        elif state == layout.STATE_FINALIZED:
            gone.append((r, "called finalize"))
        elif r in dead:
            gone.append((r, "died (its process exited or was killed)"))
        if gone and first is None:
            first = r
    if gone:
        def label(q: int) -> int | str:
            return labels.get(q, q) if not labels or q in labels else f"{q} (world)"

        # A rank that finalized or died after it left an op because of another, or after its p2p wait for
        # another timed out: name that one first.
        more, cause = first_cause(ctx, first, (ABORT_LINE,), label)
        if cause is None and not more:
            more, cause = waits_on(ctx, first, label)
        ranks = tuple(labels.get(r, r) for r, _ in gone)
        err = ZbcclRemoteError(f"{op}: peer lost while waiting: "
                               + "; ".join(f"rank {labels.get(r, r)} {why}" for r, why in gone) + more,
                               ranks=ranks if cause is None else (cause, *ranks))
        err.via = first
        raise err


def mark_line(ctx: Context, line: int, why: int, *, where: int, seq: int = 1, via: int | None = None) -> None:
    """Set this rank's ABORT line at signal-pad byte ``line`` (the first reason stays): WHY, WHERE, and the
    chain (CAUSE, VIA: see the module docstring; ``via``, the world rank this rank leaves because of, None
    when it leaves by its own cause), then VALUE."""
    transport, me = ctx.heap.transport, ctx.rank
    if transport.load(me, line) != 0:
        return
    cause = me
    if via is not None and via != me:
        cause = via
        if ctx.heap.reachable(via):
            got = words(transport, via, ABORT_LINE)
            if got is not None and got[0] >= 0:
                cause = got[0]
    # the words first: a peer reads them once it sees the line set
    transport.signal(me, line + 8 * W_WHY, why)
    transport.signal(me, line + 8 * W_WHERE, where)
    transport.signal(me, line + 8 * W_CAUSE, cause + 1)
    transport.signal(me, line + 8 * W_VIA, 0 if via is None or via == me else via + 1)
    transport.signal(me, line, max(1, seq))


def mark_left(ctx: Context, why: int, text: str, *, where: int, seq: int = 1, via: int | None = None) -> None:
    """Publish on this rank's ABORT line that it left an op half-way (the first reason stays), and, unless
    it only followed a peer (``ABORT_PEER``), break every communicator of this rank: their later ops refuse
    with ``text`` (``registry.check_usable``, the op channels and their native hot entries, p2p); memory
    (``zbccl.empty``, ``export``, ``memory_stats``) stays usable."""
    if ctx.finalized or ctx.forked:  # the heap is going (or is the parent's): nobody waits on it any more
        return
    mark_line(ctx, ABORT_LINE, why, where=where, seq=seq, via=via)
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
        via = getattr(exc, "via", None) if why in (ABORT_PEER, ABORT_TIMEOUT) else None
        mark_left(ctx, why, f"op {op} was left half-way by {type(exc).__name__}", where=where, seq=seq,
                  via=via if isinstance(via, int) else None)


def store_watch(ctx: Context, members: Sequence[int]):
    """The liveness check of a store wait among ``members`` (global ranks): ``watch(pending, op)``
    (``pending``: the members whose keys are missing) raises as :func:`check` does."""
    peers = [m for m in members if m != ctx.rank]

    def watch(pending: Sequence[int], op: str) -> None:
        check(ctx, peers, op=op, pending=[p for p in pending if p in peers])

    return watch


def left_init(boot, exc: BaseException) -> None:
    """This rank leaves init half-way by ``exc`` (after the hello exchange): tell the peers through the
    store (``left/<rank>`` holds the ``ABORT_*`` reason, ``leftvia/<rank>`` the member it left because of,
    + 1, as an ABORT line's VIA; ``left`` counts the ranks that left), so that their init waits name it
    within a few liveness intervals. Errors every rank raises together (init agrees on every failure it
    can) announce nothing. Best effort: the store may be gone."""
    why = reason(exc)
    if not why:
        return
    via = getattr(exc, "via", None) if why in (ABORT_PEER, ABORT_TIMEOUT) else None
    try:
        if isinstance(via, int) and via >= 0:  # before the reason: a peer reads it once it sees the reason
            boot.add(f"leftvia/{boot.rank}", via + 1)
        boot.add(f"left/{boot.rank}", why)
        boot.add("left", 1)
    except BaseException:  # noqa: BLE001 - the store is gone or this is a second Ctrl-C: the timeout remains
        pass


class InitBeat:
    """This rank's heartbeat through the store while it is in init: the counter ``beat/<rank>`` of bootstrap
    ``boot`` counts up every ``BEAT_S`` seconds, from its first beat (here, before the rank writes its hello
    record: every member's counter exists once the hello exchange is done) until :meth:`stop`. A daemon thread;
    a store that stopped answering ends it (the waits report that). Counters cannot be sealed: a local user who
    bumps a dead rank's only delays its naming to the timeout."""

    def __init__(self, boot) -> None:
        self._boot, self._stop = boot, threading.Event()
        boot.add(f"beat/{boot.rank}", 1)
        self._thread = threading.Thread(target=self._run, name="zbccl-init-beat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(BEAT_S):
            try:
                self._boot.add(f"beat/{self._boot.rank}", 1)
            except ZbcclError:  # the store stopped answering: the waits name that
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(BEAT_S)


class _Beats:
    """An init wait's view of the heartbeats (:class:`InitBeat`) of the members on other hosts (bootstrap ranks
    ``far``; ``topo``: the hello exchange's topology, for their hosts): read at most once per ``BEAT_S``, together
    (:meth:`~zbccl.bootstrap.base.Bootstrap.counters`); a pending one whose counter did not move for
    ``BEAT_STALE_S`` of this rank's clock raises."""

    def __init__(self, boot, topo, far: Sequence[int]) -> None:
        self._boot, self._topo, self._far = boot, topo, set(far)
        self._seen: dict[int, tuple[int, float]] = {}
        self._next = 0.0

    def check(self, pending: Iterable[int], op: str) -> None:
        now = time.monotonic()
        late = [r for r in pending if r in self._far]
        if not late or now < self._next:
            return
        self._next = now + BEAT_S
        for r, v in zip(late, self._boot.counters([f"beat/{r}" for r in late])):
            if self._seen.get(r, (None,))[0] != v:
                self._seen[r] = (v, now)
        stale = [r for r in late if now - self._seen[r][1] >= BEAT_STALE_S]
        if stale:
            info = self._topo.infos
            where = "; ".join(f"rank {self._boot.members[r]} on host {info[r].hostname} (host id {info[r].host_id})"
                              for r in stale)
            err = ZbcclTimeoutError(f"init: {op}: peer lost while waiting: {where} stopped answering: no heartbeat "
                                    f"through the store for {BEAT_STALE_S:.0f} s (it died or was killed, or its host "
                                    "is down or cut off)", ranks=tuple(self._boot.members[r] for r in stale))
            err.via = self._boot.members[stale[0]]
            raise err


def init_watch(boot, transport, topo=None):
    """The liveness rule of init's store waits on bootstrap ``boot`` (watch(pending, op), see
    ``bootstrap/store.py``): a member that left init (:func:`left_init`; by its own cause first, then one
    that followed a peer) or a pending member whose process died (``transport.dead_peers()``, after
    ``transport.watch_peers``; None before the hello exchange, when no pid is known) raises
    :class:`ZbcclRemoteError` naming it (the members' numbering); with ``topo`` (after the hello exchange), a
    pending member on another host whose heartbeat stopped (:class:`InitBeat`) raises
    :class:`ZbcclTimeoutError` naming it and its host."""
    index = {m: i for i, m in enumerate(boot.members)}
    far = [] if topo is None else [r for r in range(boot.world_size) if not topo.is_local(r)]
    beats = _Beats(boot, topo, far) if far else None

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
                what = WHAT.get(why, "hit an unexpected error")
                more, first = init_chain(boot, transport, index, dict(left), r)
                err = ZbcclRemoteError(f"init: {op}: peer lost while waiting: rank {r} {what} in the middle of init "
                                       f"and left it{more}", ranks=(r,) if first is None else (first, r))
                err.via = r
                raise err
        dead = set(transport.dead_peers()) if transport is not None else set()
        gone = [m for m in pending if index.get(m, -1) in dead]
        if gone:
            what = "; ".join(f"rank {m} died (its process exited or was killed)" for m in gone)
            err = ZbcclRemoteError(f"init: {op}: peer lost while waiting: {what}", ranks=tuple(gone))
            err.via = gone[0]
            raise err
        if beats is not None:
            beats.check([index[m] for m in pending if m in index], op)

    return watch

