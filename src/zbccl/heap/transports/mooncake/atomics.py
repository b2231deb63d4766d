"""Remote fetch_add for the mooncake transport: executed by the owner of the word.

Mooncake has no remote atomics over TCP, so :class:`AtomicServer` executes
fetch_adds for remote requesters on this rank's own words (the OpenSHMEM
active-message scheme): a requester writes ``[line, delta]`` and then its
``seq`` into its mailbox line here (ordered writes); this thread sees the new
``seq``, applies an atomic fetch_add to the word (atomic with this rank's own
fetch_adds), and writes ``old`` and then ``seq`` into the requester's reply
line. One request per requester is in flight at a time.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from .engine import MooncakeEngine
from .liveness import Peer
from .memory import CTRL_MAIL

__all__ = ["AtomicServer"]


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
        fetch_add = self.prims.fetch_add_signal
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
                    if self.engine.write(peer.sid, self.scratch, reply + 8, 8, watch=False) == 0:
                        self.engine.write(peer.sid, self.scratch + 8, reply, 8, watch=False)
                    self.done[r] = seq  # a failed reply: the requester is gone (its liveness reports it)
                    served = True
                pause = fast if served else min(idle, max(fast, 2 * pause))
        except BaseException as exc:  # noqa: BLE001 - reported by the requester's timeout and at close
            self.error = exc

    def stop(self, wait: float) -> bool:
        """Ask the thread to end; whether it ended within ``wait`` seconds (a reply to a requester behind a cut
        link may block in Mooncake for much longer)."""
        self._stop_ev.set()
        if self.ident is not None:
            self.join(timeout=wait)
        return not self.is_alive()
