"""Peer liveness by pidfd: readable once the peer's process exited, whoever holds its descriptors."""

from __future__ import annotations

import os
import select
import threading

__all__ = ["Pidfds"]


class Pidfds:
    """The pidfds of the local peers (owned: closed by :meth:`close`), polled without blocking. Thread-safe: the
    waits of several threads (a communicator each, over one transport) ask at once, and a ``select.poll``
    object refuses a concurrent ``poll()``."""

    def __init__(self) -> None:
        self._fds: dict[int, int] = {}
        self._rank_of: dict[int, int] = {}
        self._poll = select.poll()
        self._lock = threading.Lock()

    def add(self, rank: int, pidfd: int) -> None:
        """Own ``pidfd`` (of ``rank``'s process) from now on (one that watched ``rank`` before is closed)."""
        with self._lock:
            old = self._fds.get(rank)
            if old is not None:
                self._poll.unregister(old)
                self._rank_of.pop(old, None)
                try:
                    os.close(old)
                except OSError:
                    pass
            self._fds[rank] = pidfd
            self._rank_of[pidfd] = rank
            self._poll.register(pidfd, select.POLLIN)

    def fd(self, rank: int) -> int:
        """``rank``'s pidfd (borrowed), or -1."""
        return self._fds.get(rank, -1)

    def dead(self) -> list[int]:
        """Ranks whose process exited (sorted). Never blocks."""
        with self._lock:
            return sorted({self._rank_of[fd] for fd, _ in self._poll.poll(0) if fd in self._rank_of})

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._fds.clear()
            self._rank_of.clear()
            self._poll = select.poll()
