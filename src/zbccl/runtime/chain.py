"""Who a failure goes back to: the lines a rank leaves behind, and the chains read from them.

A rank that leaves an op half-way (:mod:`.liveness`) marks its ABORT line with why (WHY), where (WHERE),
the rank it left because of (VIA) and the first rank of that chain (CAUSE: VIA's own CAUSE when VIA left
an op too, else VIA; the rank itself when it left by its own Ctrl-C or exception). ``chan.c``
``chain_of`` writes them for the native ops, :func:`.liveness.mark_line` for the others. A rank that
waits on a follower, not on the rank that failed first, reads the chain (:func:`chain`) and names that
first rank (:func:`first_cause`): "rank 2 timed out ...; the first cause: rank 0, which never arrived
(chain: rank 0 -> rank 1 -> rank 2)".

A p2p timeout leaves no ABORT (the wait is cancelled cleanly), so p2p waits publish the rank they wait
for on a WAIT line (:data:`WAIT_LINE`, :func:`waiting`), read along a chain of such waits
(:func:`waits_on`). Init has no heap yet: its "left init" records in the store carry VIA
(``leftvia/<rank>``, :func:`.liveness.left_init`), read by :func:`init_chain`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..heap import layout
from ..native.abi import (
    ABORT_EXCEPTION,
    ABORT_INTERRUPT,
    ABORT_PEER,
    ABORT_TIMEOUT,
    L_ABORT,
    L_WAIT,
    W_CAUSE,
    W_VIA,
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

__all__ = ["ABORT_LINE", "WAIT_LINE", "WHAT", "WHERE", "aborted", "words", "chain", "first_cause", "waiting",
           "waits_on", "init_chain"]

WHAT = {ABORT_INTERRUPT: "was interrupted (Ctrl-C)", ABORT_TIMEOUT: "timed out", ABORT_PEER: "lost a peer"}
WHERE = {WHERE_COLLECTIVE: "a collective", WHERE_BARRIER: "a barrier", WHERE_EP: "an EP op",
         WHERE_P2P: "a send/recv", WHERE_STORE: "a store op (all_gather_object, new_group, destroy)"}


#: Signal-pad byte offset of a rank's own ABORT line (the world slot's ``L_ABORT`` line).
ABORT_LINE = layout.slot_line(0, L_ABORT)
#: Signal-pad byte offset of a rank's WAIT line (the world slot's ``L_WAIT``): VALUE the world rank + 1 its
#: p2p wait waits for (0: none), WHY 1 once that wait timed out, 2 once it raised because that rank was
#: lost. A p2p timeout leaves no ABORT (the wait is cancelled cleanly), so this is how a chain of p2p waits
#: (a ring: 0 waits for 2, which waits for 1, which is stopped) is read: the line stays set after a timeout
#: or a lost peer, until the rank's next p2p wait ends.
WAIT_LINE = layout.slot_line(0, L_WAIT)

#: How a WAIT line's wait ended (its WHY word), as errors say it.
_GAVE_UP = {0: "itself waits for", 1: "timed out waiting for", 2: "gave up waiting for"}


def waiting(ctx: Context, on: int | None, *, ended: int = 0) -> None:
    """Publish that this rank's p2p wait waits for world rank ``on`` (None: no wait); ``ended``: 1 it timed
    out, 2 it raised because a rank was lost (the line then stays set)."""
    if ctx.finalized or ctx.forked:
        return
    transport, me = ctx.heap.transport, ctx.rank
    transport.signal(me, WAIT_LINE + 8 * W_WHY, ended)
    transport.signal(me, WAIT_LINE, 0 if on is None else on + 1)


def waits_on(ctx: Context, g: int, label=None) -> tuple[str, object]:
    """``("; rank g itself waits for rank q (...)", q's label)`` when world rank ``g``'s WAIT line names a
    rank it waits for or gave up on (followed along a chain of such waits, :data:`WAIT_LINE`), else
    ``("", None)``."""
    heap, links = ctx.heap, [g]
    timed = []
    while len(links) <= ctx.world_size:
        cur = links[-1]
        if cur == ctx.rank or not heap.reachable(cur):
            break
        q = heap.transport.load(cur, WAIT_LINE) - 1
        if q < 0 or q in links:
            break
        timed.append(heap.transport.load(cur, WAIT_LINE + 8 * W_WHY))
        links.append(q)
    if len(links) < 2:
        return "", None
    name = label or (lambda q: q)
    first = links[-1]
    how = _GAVE_UP.get(timed[0], _GAVE_UP[0])
    who = "this rank" if first == ctx.rank else f"rank {name(first)}"
    state = "" if first == ctx.rank else f", which {_state_of(ctx, first, (ABORT_LINE,))}"
    text = (f"; rank {name(g)} {how} {who} in a send/recv{state} (chain of waits: "
            + " -> ".join(f"rank {name(q)}" for q in links) + ")")
    return text, (None if first == ctx.rank else name(first))


def aborted(transport, rank: int, line: int) -> tuple[int, int]:
    """``(why, where)`` of global rank ``rank``'s ABORT line at signal-pad byte ``line`` (``ABORT_*``,
    ``WHERE_*``), ``(0, 0)`` if not set."""
    if transport.load(rank, line) == 0:
        return 0, 0
    return (transport.load(rank, line + 8 * W_WHY) or ABORT_EXCEPTION,
            transport.load(rank, line + 8 * W_WHERE))


def words(transport, rank: int, line: int) -> tuple[int, int] | None:
    """``(cause, via)`` world ranks (-1: none) of rank ``rank``'s ABORT line at ``line``, None if not set."""
    if transport.load(rank, line) == 0:
        return None
    return transport.load(rank, line + 8 * W_CAUSE) - 1, transport.load(rank, line + 8 * W_VIA) - 1


def chain(ctx: Context, r: int, lines: Sequence[int] = (ABORT_LINE,)) -> list[int]:
    """World ranks from the first cause to ``r`` (``[..., r]``) of why world rank ``r`` left an op: the VIA
    words of the ranks along the way (each one's line among ``lines`` that is set), closed by ``r``'s CAUSE
    when a link cannot be read (a rank whose heap is gone). ``[r]`` when ``r`` left by its own cause."""
    heap = ctx.heap
    out, cause, cur = [r], None, r
    while len(out) <= ctx.world_size:
        got = None
        if cur != ctx.rank and heap.reachable(cur):
            got = next((w for w in (words(heap.transport, cur, ln) for ln in lines) if w is not None), None)
        if got is None:
            break
        if cause is None:
            cause = got[0]
        via = got[1]
        if via < 0 or via in out:
            break
        out.append(via)
        cur = via
    if cause is not None and cause >= 0 and cause not in out:
        out.append(cause)
    return out[::-1]


def _state_of(ctx: Context, g: int, lines: Sequence[int]) -> str:
    """What happened to world rank ``g``, the first of a chain, as this rank sees it now."""
    heap = ctx.heap
    if heap.reachable(g):
        for ln in lines:
            why, where = aborted(heap.transport, g, ln)
            if why:
                return f"{WHAT.get(why, 'hit an unexpected error')} in the middle of {WHERE.get(where, 'a collective')}"
        state = heap.header(g, layout.H_STATE)
        if state == layout.STATE_FAILED:
            return "failed"
        if state == layout.STATE_FINALIZED:
            return "called finalize"
    t = heap.transport
    far = not heap.reachable(g) and t.reachable(g)  # on another host: the transport's verdict, never a read
    if g in set(t.dead_peers()):
        return f"died or called finalize (on {t.where(g)})" if far else "died (its process exited or was killed)"
    if far and g in set(t.unreachable_peers()):
        return f"is unreachable (on {t.where(g)}: no answer)"
    return f"never arrived (on {t.where(g)}: stopped, too slow or not yet judged lost)" if far else \
        "never arrived (stopped or too slow)"


def first_cause(ctx: Context, g: int, lines: Sequence[int] = (ABORT_LINE,), label=None) -> tuple[str, object]:
    """``("; the first cause: rank q, which ... (chain: rank q -> ... -> rank g)", q's label)`` when world
    rank ``g`` left an op because of another rank (its ABORT line's chain, :func:`chain`), else ``("", None)``;
    the label is None too when the first cause is this rank. ``label``: world rank -> the number errors use."""
    links = chain(ctx, g, lines)
    if len(links) < 2 or links[0] == g:
        return "", None
    name = label or (lambda q: q)
    first = links[0]
    who = "this rank" if first == ctx.rank else f"rank {name(first)}, which {_state_of(ctx, first, lines)}"
    text = f"; the first cause: {who} (chain: " + " -> ".join(f"rank {name(q)}" for q in links) + ")"
    return text, (None if first == ctx.rank else name(first))


def init_chain(boot, transport, index: dict[int, int], left: dict[int, int], r: int) -> tuple[str, int | None]:
    """The first cause of member ``r`` leaving init (the ``leftvia`` records of :func:`.liveness.left_init`), as
    :func:`first_cause` says it for ops: ``("; the first cause: ...", that member)``, or ``("", None)``."""
    links, cur = [r], r
    while len(links) <= boot.world_size and cur in index and cur != boot.members[boot.rank]:
        via = boot.add(f"leftvia/{index[cur]}", 0) - 1
        if via < 0 or via in links:
            break
        links.append(via)
        cur = via
    if len(links) < 2:
        return "", None
    first = links[-1]
    if first == boot.members[boot.rank]:
        who = "this rank"
    elif first in left:
        who = f"rank {first}, which {WHAT.get(left[first], 'hit an unexpected error')} in the middle of init"
    elif transport is not None and index.get(first, -1) in set(transport.dead_peers()):
        who = f"rank {first}, which died (its process exited or was killed)"
    else:
        who = f"rank {first}, which never arrived (stopped or too slow)"
    text = f"; the first cause: {who} (chain: " + " -> ".join(f"rank {q}" for q in reversed(links)) + ")"
    return text, (None if first == boot.members[boot.rank] else first)
