"""Peer liveness across hosts for the mooncake transport (no pidfds there), and how waits are paced.

Liveness across hosts cannot use pidfds. :class:`Monitor` reads one word of
every remote peer's control region through the engine every ``period``
seconds (the read is served by the peer's own engine thread, so it proves the
process is up and the path works). A failed read is classified by a plain
TCP connect to the peer's handshake port: *refused* means its host answers
but the process is gone (dead); no answer means the host or the link is down
(unreachable). A read that hangs (a cut link: Mooncake fails it only after
``MC_TCP_PROGRESS_TIMEOUT_SEC``) shows as a peer whose probe has been running for
more than ``stall`` seconds; a peer merely waiting behind another's hung probe is
not blamed. Waiters ask :meth:`Monitor.verdict`; it never blocks.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from ....errors import ZbcclError, ZbcclRemoteError, ZbcclTimeoutError
from ..base import pause as base_pause
from .engine import MooncakeEngine, probe
from .memory import CTRL_TABLE

__all__ = ["Peer", "Monitor", "STALL", "backoff"]

#: Seconds without an answer after which a peer's host is reported unreachable.
STALL = 5.0

#: Seconds a wait polls before it starts napping: remote polls back to back (each is a network round trip:
#: paced already); local ones yield the core meanwhile, briefly (the words they wait for are landed by this
#: process's engine threads, which a yielding poller keeps off a busy core).
HOT_REMOTE, HOT_LOCAL = 2e-3, 200e-6


def backoff(waited: float, pause: float, *, remote: bool, cap: float, left: float) -> float:
    """One pause of a polling wait (:func:`zbccl.heap.transports.base.pause`) that polls remote words (``remote``)
    or local ones; returns the next ``pause``."""
    return base_pause(waited, pause, hot=HOT_REMOTE if remote else HOT_LOCAL, left=left, cap=cap, spin=not remote)


@dataclass(frozen=True)
class Peer:
    """A remote rank as this rank reaches it (published by it through the store)."""

    rank: int
    sid: str
    ip: str
    port: int
    hostname: str
    pad: int
    data: int
    ctrl: int
    reserve: int

    def where(self) -> str:
        return f"host {self.hostname} ({self.ip})"


class Monitor(threading.Thread):
    """Probes the remote peers' engines (see the module docstring); :meth:`verdict` reads the state."""

    def __init__(self, engine: MooncakeEngine, peers: dict[int, Peer], scratch: int, *, period: float,
                 stall: float) -> None:
        super().__init__(name="zbccl-mooncake-liveness", daemon=True)
        self.engine, self.peers, self.scratch = engine, peers, scratch
        self.period, self.stall = period, stall
        self._stop_ev = threading.Event()
        self._inflight: dict[int, float] = {}  # rank -> when the probe of it now running started
        self._dead: set[int] = set()
        self._unreachable: set[int] = set()
        self._lock = threading.Lock()

    def run(self) -> None:
        while not self._stop_ev.wait(self.period):
            for r, peer in self.peers.items():
                if self._stop_ev.is_set() or r in self._dead:
                    continue
                with self._lock:
                    self._inflight[r] = time.monotonic()
                ok = self.engine.read(peer.sid, self.scratch, peer.ctrl + CTRL_TABLE, 8, watch=False) == 0
                with self._lock:
                    del self._inflight[r]
                    if ok:
                        self._unreachable.discard(r)
                if ok:
                    continue
                if self._judge(r) == "alive":  # a transient failure, or a process being killed: look again
                    self._stop_ev.wait(0.05)
                    self._judge(r)

    def _judge(self, rank: int) -> str:
        """:meth:`classify` ``rank``; a dead one is published with the ranks of its host that die with it
        (:meth:`host_mates`), so that a wait names the host's dead ranks together, not the first one alone."""
        verdict = self.classify(rank, publish=False)
        if verdict == "dead":
            self.host_mates(rank, "dead")
        else:
            self._publish(verdict, (rank,))
        return verdict

    def classify(self, rank: int, *, publish: bool = True) -> str:
        """Ask the network what a failed transfer to ``rank`` means; remember (``publish``) a verdict of dead or
        unreachable."""
        peer = self.peers[rank]
        verdict = probe(peer.ip, peer.port, timeout=min(1.0, self.stall))
        if publish:
            self._publish(verdict, (rank,))
        return verdict

    def _publish(self, verdict: str, ranks) -> None:
        with self._lock:
            if verdict == "dead":
                self._dead.update(ranks)
            elif verdict == "unreachable":
                self._unreachable.update(ranks)

    def verdict(self, ranks) -> tuple[list[int], list[int]]:
        """``(dead, unreachable)`` among ``ranks`` (remote peers only), each sorted. Never blocks."""
        now = time.monotonic()
        with self._lock:
            dead = sorted(r for r in ranks if r in self._dead)
            # Stale: a probe of it hangs (a cut link). A peer merely waiting behind another's hung probe is not.
            late = sorted(r for r in ranks if r in self.peers and r not in self._dead
                          and (r in self._unreachable or now - self._inflight.get(r, now) > self.stall))
        return dead, late

    def dead(self) -> list[int]:
        with self._lock:
            return sorted(self._dead)

    def settled(self, rank: int) -> str:
        """:meth:`classify`, asked again for up to a second while it says alive (a process being killed resets
        connections a moment before its listener closes), and once more when it says unreachable: the listener
        of a process being killed can leave a connection attempt unanswered instead of refusing it (seen once
        in CI as "unreachable" for a killed host whose other connections had been reset)."""
        until = time.monotonic() + 1.0
        while True:
            verdict = self.classify(rank, publish=False)
            if verdict != "alive" or time.monotonic() >= until:
                break
            time.sleep(0.05)
        if verdict == "unreachable" and self.classify(rank, publish=False) == "dead":
            verdict = "dead"
        if verdict == "dead":
            self.host_mates(rank, "dead")  # published with the ranks of its host that die with it
        else:
            self._publish(verdict, (rank,))
        return verdict

    def host_mates(self, rank: int, verdict: str) -> tuple[int, ...]:
        """``rank`` and the other remote ranks of its host in the same state: every rank of an unreachable
        host is; a rank of a host that answers is dead when its own port refuses too (a quick probe). Dead
        ones are published together (:meth:`verdict`)."""
        ip = self.peers[rank].ip
        mates = [r for r, p in self.peers.items() if p.ip == ip and r != rank]
        if verdict == "dead":
            # A host's ranks do not die at one instant: give the others half a second to follow.
            with self._lock:
                dead = {r for r in mates if r in self._dead}
            until = time.monotonic() + 0.5
            while True:
                dead |= {r for r in mates if r not in dead and self.classify(r, publish=False) == "dead"}
                if len(dead) == len(mates) or time.monotonic() >= until:
                    break
                time.sleep(0.05)
            mates = sorted(dead)
            self._publish("dead", (rank, *mates))
        return tuple(sorted([rank, *mates]))

    def _dead_with(self, rank: int) -> tuple[int, ...]:
        """``rank`` and the ranks of its host published dead with it (no probe: whoever published ``rank`` dead,
        :meth:`_judge` or :meth:`settled`, gave its host's ranks their grace then)."""
        ip = self.peers[rank].ip
        with self._lock:
            return tuple(sorted({rank} | {r for r in self._dead if self.peers[r].ip == ip}))

    def failure(self, rank: int, op: str, what: str, verdict: str) -> ZbcclError:
        """The error for a transfer to ``rank`` that failed: it died, its host is unreachable, or it refused."""
        peer = self.peers[rank]
        if verdict == "dead":
            ranks = self._dead_with(rank)  # (published by :meth:`settled`, with its host's)
            return ZbcclRemoteError(f"{op}: rank(s) {list(ranks)} died or called finalize ({peer.where()} refuses "
                                    f"connections to their transfer engines), expected {what} to complete, got rc -1",
                                    ranks=ranks)
        if verdict == "unreachable":
            ranks = self.host_mates(rank, "unreachable")
            return ZbcclTimeoutError(f"{op}: {peer.where()} of rank(s) {list(ranks)} is unreachable, expected {what} "
                                     f"to complete, got no answer (a network partition or a host down)", ranks=ranks)
        return ZbcclRemoteError(f"{op}: rank {rank}'s transfer engine refused {what} ({peer.where()}), expected "
                                "rc 0, got -1 (an address outside its registered memory)", ranks=(rank,))

    def lost(self, ranks, op: str, label) -> ZbcclError | None:
        """The error for a wait on ``ranks`` when one died (remote error, naming every dead rank of its host)
        or its host stopped answering (timeout); None while all answer. ``label`` numbers ranks for messages."""
        dead, gone = self.verdict(ranks)
        if dead:
            dead = sorted({m for r in dead for m in self._dead_with(r)})
            names = [label(r, r) for r in dead]
            where = "; ".join(f"rank {label(r, r)} on {self.peers[r].where()}" for r in dead)
            return ZbcclRemoteError(f"{op}: peer lost while waiting: rank(s) {names} died or called finalize ({where}: "
                                    "its host answers, its transfer engine is gone)", ranks=tuple(names))
        if gone:
            gone = sorted({m for r in gone for m in self.host_mates(r, "unreachable")})
            names = [label(r, r) for r in gone]
            where = "; ".join(f"rank {label(r, r)} on {self.peers[r].where()}" for r in gone)
            return ZbcclTimeoutError(
                f"{op}: host unreachable while waiting for rank(s) {names}, expected an answer from their transfer "
                f"engine within {self.stall:.0f}s, got none ({where}: a network partition or a host down)",
                ranks=tuple(names))
        return None

    def stop(self, wait: float) -> bool:
        """Ask the thread to end; whether it ended within ``wait`` seconds (a probe of a host behind a cut link
        may block in Mooncake for much longer: :meth:`MooncakeTransport.close` then retires the engine)."""
        self._stop_ev.set()
        if self.ident is not None:
            self.join(timeout=wait)
        return not self.is_alive()
