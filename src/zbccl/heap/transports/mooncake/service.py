"""The mooncake transport's two background threads: peer liveness, and remote fetch_add.

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

Mooncake has no remote atomics over TCP, so :class:`AtomicServer` executes
fetch_adds for remote requesters on this rank's own words (the OpenSHMEM
active-message scheme): a requester writes ``[line, delta]`` and then its
``seq`` into its mailbox line here (ordered writes); this thread sees the new
``seq``, applies an atomic fetch_add to the word (atomic with this rank's own
fetch_adds), and writes ``old`` and then ``seq`` into the requester's reply
line. One request per requester is in flight at a time.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from .engine import MooncakeEngine, probe
from .memory import CTRL_MAIL, CTRL_TABLE

__all__ = ["Peer", "Monitor", "AtomicServer", "backoff"]

#: Seconds a wait polls before it starts sleeping (a remote poll is a network round trip: paced already).
HOT_SECONDS = 2e-3


def backoff(waited: float, pause: float, *, remote: bool, cap: float, left: float) -> float:
    """One pause of a polling wait that has waited ``waited`` seconds; returns the next ``pause``.

    Hot for ``HOT_SECONDS`` (remote polls back to back, local ones yielding the core), then sleeps doubling
    from 20 us to ``cap``, never past the deadline (``left`` seconds away).
    """
    if waited < HOT_SECONDS:
        if not remote:
            os.sched_yield()
        return pause
    pause = min(2 * pause or 20e-6, cap)
    time.sleep(min(pause, max(0.0, left)))
    return pause


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
                ok = self.engine.read(peer.sid, self.scratch, peer.ctrl + CTRL_TABLE, 8) == 0
                with self._lock:
                    del self._inflight[r]
                    if ok:
                        self._unreachable.discard(r)
                if ok:
                    continue
                if self.classify(r) == "alive":  # a transient failure, or a process being killed: look again
                    self._stop_ev.wait(0.05)
                    self.classify(r)

    def classify(self, rank: int) -> str:
        """Ask the network what a failed transfer to ``rank`` means; remember a verdict of dead or unreachable."""
        peer = self.peers[rank]
        verdict = probe(peer.ip, peer.port, timeout=min(1.0, self.stall))
        with self._lock:
            if verdict == "dead":
                self._dead.add(rank)
            elif verdict == "unreachable":
                self._unreachable.add(rank)
        return verdict

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

    def stop(self) -> None:
        self._stop_ev.set()
        if self.ident is not None:
            self.join(timeout=2 * self.stall + 5)  # a probe over a cut link ends within Mooncake's stall timeout


class AtomicServer(threading.Thread):
    """Applies remote fetch_add requests to this rank's words (see the module docstring)."""

    def __init__(self, engine: MooncakeEngine, peers: dict[int, Peer], *, ctrl: int, reply_offset: int, scratch: int,
                 word_addr: Callable[[int], int | None], prims, load: Callable[[int], int]) -> None:
        super().__init__(name="zbccl-mooncake-atomics", daemon=True)
        self.engine, self.peers, self.ctrl, self.reply_offset = engine, peers, ctrl, reply_offset
        self.scratch, self.word_addr, self.prims, self.load = scratch, word_addr, prims, load
        self.done = {r: 0 for r in peers}
        self._stop_ev = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        pause, fast, idle = 0.0, 50e-6, 2e-3
        fetch_add = getattr(self.prims, "fetch_add_signal", None) or self.prims.fetch_add
        try:
            while not self._stop_ev.wait(pause):
                served = False
                for r, peer in self.peers.items():
                    mail = self.ctrl + CTRL_MAIL + 64 * r
                    seq = self.load(mail)
                    if seq <= self.done[r]:
                        continue
                    line, delta = self.load(mail + 8), self.load(mail + 16)
                    word = self.word_addr(line)
                    if word is None:  # not a word of this pad (no zbccl rank sends one): dropped, never applied
                        self.done[r] = seq
                        continue
                    old = fetch_add(word, delta)
                    self.prims.store_release(self.scratch, old)
                    self.prims.store_release(self.scratch + 8, seq)
                    # old first, then seq: the requester's seq is the publication of old.
                    reply = peer.ctrl + self.reply_offset
                    if self.engine.write(peer.sid, self.scratch, reply + 8, 8) == 0:
                        self.engine.write(peer.sid, self.scratch + 8, reply, 8)
                    self.done[r] = seq  # a failed reply: the requester is gone (its liveness reports it)
                    served = True
                pause = fast if served else min(idle, max(fast, 2 * pause))
        except BaseException as exc:  # noqa: BLE001 - reported by the requester's timeout and at close
            self.error = exc

    def stop(self) -> None:
        self._stop_ev.set()
        if self.ident is not None:
            self.join(timeout=30)
