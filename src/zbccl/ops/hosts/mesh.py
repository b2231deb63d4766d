"""A mesh: every member writes to every other member through the transport verbs, in steps.

The one data-moving primitive of the collectives across hosts. It uses only the verbs every
transport has (put, signal, load), so a member may sit on another host (mooncake) or on this one
(shm); nothing of a peer is ever viewed.

Memory: each member owns a **region** in its heap (announced through the store at setup and checked
against its heap size): ``2 * n`` slots of ``slot`` bytes, slot ``(parity, i)`` receiving member ``i``'s
bytes of the steps of that parity. Each member owns ``n`` **arrived** words in its signal pad, from
``line_base`` (one line each), in its communicator's comm slot: word ``i`` is written by member ``i``
only, with the number of the last step whose bytes it put here.

Synchronisation protocol (step ``s`` = 1, 2, ... on every member, in the same order):

1. For each peer ``p``: wait until this member's own arrived[p] is ``>= s - 1`` (a local read: ``p``
   started step ``s - 1``, so it consumed everything of step ``s - 2``, the last user of slot parity
   ``s % 2`` at ``p``). In lockstep this already holds (step 3 of ``s - 1`` waited for it): no
   acknowledgement is ever written.
2. For each peer ``p``: put this member's bytes for ``p`` into slot ``(s % 2, me)`` of ``p``'s region,
   then signal ``p``'s arrived[me] = ``s``. The signal is ordered after the put (shm: a release store;
   Mooncake over TCP v2 completes a write only once it landed).
3. Wait until this member's own arrived[q] >= ``s`` for every peer ``q``; the caller consumes the slots
   (views of this member's own heap) before it starts step ``s + 1``.

Waits poll this member's own words (remote writes wake no futex), yielding for ``HOT`` seconds and then
sleeping with back-off to 0.5 ms, and apply the
liveness rule every ``liveness`` seconds: a member that left an op half-way (its ABORT line, read
through the verbs on another host), a member that failed, finalized or died, a host that stopped
answering; the timeout names the members never heard from and their hosts.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import torch

from ...errors import ZbcclInvalidUsageError, ZbcclRemoteError, ZbcclTimeoutError
from ...heap import layout
from ...native.abi import ABORT_PEER
from ...runtime import liveness

__all__ = ["Mesh", "Watch"]

#: Seconds a wait yields the core between polls before it sleeps: short, because the words it waits for are
#: written by this process's own Mooncake engine threads (a remote put lands through them), which a polling
#: thread must not starve on oversubscribed cores.
HOT = 200e-6


def _pause(waited: float, pause: float, left: float) -> float:
    """One pause of a wait: yield while hot, then sleep doubling from 20 us to 0.5 ms (never past the deadline)."""
    if waited < HOT:
        os.sched_yield()
        return pause
    pause = min(2 * pause or 20e-6, 5e-4)
    time.sleep(min(pause, max(0.0, left)))
    return pause


class Watch:
    """The liveness rule of a wait among global ranks (module docstring), with errors in group ranks."""

    def __init__(self, ctx, labels: dict[int, int]) -> None:
        self.ctx, self.t, self.labels = ctx, ctx.heap.transport, labels
        self.remote = getattr(self.t, "remote", None)
        # Its reads of remote words are round trips through the peers' engines: no more often than the
        # mooncake monitor probes them (every max(ZBCCL_LIVENESS_INTERVAL, 0.25) s).
        self.interval = max(ctx.liveness_ns / 1e9, 0.25)

    def where(self, g: int) -> str:
        """The host of global rank ``g``, in words."""
        peer = getattr(self.remote, "peers", {}).get(g)
        return peer.where() if peer is not None else "this host"

    def check(self, members: Sequence[int], pending: Sequence[int], op: str) -> None:
        """Raise if a member left an op half-way, or a pending one failed, finalized, died or is unreachable."""
        ctx, label = self.ctx, self.labels.get
        if ctx.finalized:
            raise ZbcclInvalidUsageError(f"{op}: {liveness.FINALIZED_WHILE_WAITING}", ranks=(ctx.rank,))
        self._hosts_lost(pending, op)  # never blocks: the monitor's verdict
        follow = None
        for g in members:
            if g == ctx.rank:
                continue
            why, where = self._read(lambda g=g: liveness.aborted(self.t, g, liveness.ABORT_LINE), op)
            if why and why != ABORT_PEER:
                raise liveness.abort_error(label(g, g), why, op=op, where=where)
            if why and follow is None:
                follow = (g, why, where)
        dead, gone = set(self.t.dead_peers()), []
        for g in pending:
            if g == ctx.rank:
                continue
            state = self._read(lambda g=g: self.t.load(g, layout.H_STATE), op)
            if state == layout.STATE_FAILED:
                gone.append((g, "failed"))
            elif state == layout.STATE_FINALIZED:
                gone.append((g, "called finalize"))
            elif g in dead:
                gone.append((g, "died (its process exited or was killed)"))
        if gone:
            what = "; ".join(f"rank {label(g, g)} on {self.where(g)} {why}" for g, why in gone)
            raise ZbcclRemoteError(f"{op}: peer lost while waiting: {what}", ranks=tuple(label(g, g) for g, _ in gone))
        if follow is not None:
            raise liveness.abort_error(label(follow[0], follow[0]), follow[1], op=op, where=follow[2])

    def _hosts_lost(self, pending: Sequence[int], op: str) -> None:
        """The mooncake monitor's verdict on the pending members of other hosts: dead (the host answers, the
        engine is gone) or unreachable (no answer for its stall bound: a cut link, a host down)."""
        monitor = getattr(self.remote, "_monitor", None)
        far = [g for g in pending if g in getattr(self.remote, "peers", {})]
        if monitor is None or not far:
            return
        dead, gone = monitor.verdict(far)
        label = self.labels.get
        for ranks, cls, what in ((dead, ZbcclRemoteError, "died (its host answers, its transfer engine is gone)"),
                                 (gone, ZbcclTimeoutError, "is unreachable (no answer: a network partition or a "
                                                           "host down)")):
            if ranks:
                where = "; ".join(f"rank {label(g, g)} on {self.where(g)}" for g in ranks)
                raise cls(f"{op}: peer lost while waiting: {where} {what}", ranks=tuple(label(g, g) for g in ranks))

    def _read(self, read, op: str):
        """A read of a member's words; a failed one is reported in this communicator's numbering."""
        try:
            return read()
        except (ZbcclRemoteError, ZbcclTimeoutError) as exc:
            mine = [self.labels[g] for g in exc.ranks if g in self.labels]
            raise type(exc)(f"{op}: {exc}; in this communicator: rank(s) {mine}", ranks=tuple(mine)) from None


class Mesh:
    """Steps of all-to-all puts among ``members`` (global ranks) over ``ctx``'s transport (module docstring).

    ``regions[i]``: member ``i``'s region offset in its heap; ``slot``: bytes of one slot. Not thread-safe
    (the communicator's op lock serialises its ops)."""

    def __init__(self, ctx, members: Sequence[int], regions: Sequence[int], slot: int, line_base: int,
                 watch: Watch) -> None:
        self.ctx, self.t, self.members = ctx, ctx.heap.transport, list(members)
        self.me = ctx.rank
        self.index = self.members.index(self.me)
        self.regions, self.slot, self.line_base, self.watch = list(regions), slot, line_base, watch
        self.step_no = 0
        self.n = len(self.members)

    def _arrived(self, i: int) -> int:
        return self.line_base + layout.LINE * i

    def _slot_at(self, owner: int, parity: int, src: int) -> int:
        return self.regions[owner] + (parity * self.n + src) * self.slot

    def view(self, parity: int, src: int, nbytes: int) -> torch.Tensor:
        """Member ``src``'s bytes of a step of ``parity`` in this member's own region (uint8, a view)."""
        return self.t.view(self.me, self._slot_at(self.index, parity, src), (nbytes,), torch.uint8, op="hosts")

    def step(self, pieces: Sequence[torch.Tensor | None], *, op: str, timeout: float, at: int = 0,
             before: Sequence[torch.Tensor | None] | None = None, before_at: int = 0) -> int:
        """One step: ``pieces[i]`` (flat uint8, at most ``slot - at`` bytes, or None: nothing) to member ``i``, at
        byte ``at`` of its slot (and ``before[i]`` at ``before_at``, put first); returns the step's parity (read
        what arrived with :meth:`view`) once every peer's bytes are here."""
        self.step_no += 1
        s, parity = self.step_no, self.step_no % 2
        idx = [i for i in range(self.n) if i != self.index]
        if s > 1:  # 1. (holds already in lockstep)
            self.wait([(i, s - 1) for i in idx], op=op, timeout=timeout)
        me_line = self._arrived(self.index)
        for i in idx:  # 2. data, then the signal that publishes it
            g = self.members[i]
            for piece, where in ((None if before is None else before[i], before_at), (pieces[i], at)):
                if piece is not None and piece.numel():
                    if where + piece.numel() > self.slot:
                        raise AssertionError(f"hosts: {piece.numel()} bytes at {where} in a slot of {self.slot}")
                    self.t.put(g, self._slot_at(i, parity, self.index) + where, piece, op=op)
            self.t.signal(g, me_line, s)
        self.wait([(i, s) for i in idx], op=op, timeout=timeout)  # 3.
        return parity

    def wait(self, need: Sequence[tuple[int, int]], *, op: str, timeout: float) -> None:
        """Until this member's arrived[i] >= target for each ``(i, target)``; the liveness rule meanwhile."""
        t, me = self.t, self.me
        start = time.monotonic()
        deadline, next_live, pause = start + timeout, start + self.watch.interval, 0.0
        while True:
            late = [(i, v) for i, target in need if (v := t.load(me, self._arrived(i))) < target]
            if not late:
                return
            now = time.monotonic()
            if now >= next_live or now >= deadline:
                pending = [self.members[i] for i, _ in late]
                self.watch.check(self.members, pending, op)
                next_live = now + self.watch.interval
            if now >= deadline:
                label = self.watch.labels.get
                names = [label(self.members[i], self.members[i]) for i, _ in late]
                where = "; ".join(f"rank {label(self.members[i], self.members[i])} on "
                                  f"{self.watch.where(self.members[i])}" for i, _ in late)
                raise ZbcclTimeoutError(
                    f"{op}: timed out after {timeout:.1f}s waiting for ranks {names} ({where}), expected their "
                    f"step {need[0][1]} of this op, got none", ranks=tuple(names))
            pause = _pause(now - start, pause, deadline - now)
