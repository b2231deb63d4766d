"""The bootstrap interface: a small, ordered, timeout-bounded control channel.

Ordering guarantees (as in MSCCL++'s ``Bootstrap``):

* every rank must call the collective methods (:meth:`all_gather`,
  :meth:`barrier`) in the same order; each call is matched by its sequence
  number, not by its key text;
* a value set by :meth:`set` is visible to every later :meth:`get` of any rank;
* every blocking method takes a timeout; when it expires the raised
  :class:`~zbccl.errors.ZbcclTimeoutError` names the ranks that never arrived.

The bootstrap carries only small metadata (sizes, handles, host facts). Data
never flows through it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

__all__ = ["Bootstrap", "Watch"]

#: ``watch(pending_ranks, op)``: called at each poll of a wait with the ranks not arrived yet; raises to end
#: the wait (the runtime's liveness check: a dead peer, a peer that left an op, this rank's finalize).
Watch = Callable[[Sequence[int], str], None]


class Bootstrap(ABC):
    """Rendezvous and metadata exchange among ``world_size`` ranks."""

    rank: int
    world_size: int

    @abstractmethod
    def set(self, key: str, value: bytes) -> None:
        """Publish ``value`` under ``key`` (this rank's namespace is the caller's business)."""

    @abstractmethod
    def get(self, key: str, *, timeout: float, owner: int | None = None, watch: Watch | None = None) -> bytes:
        """Block until ``key`` exists, then return it. ``owner`` is named on timeout; ``watch`` (if given)
        is called at each poll."""

    @abstractmethod
    def add(self, key: str, delta: int) -> int:
        """Atomically add to an integer counter and return the new value."""

    def counters(self, keys: Sequence[str]) -> list[int]:
        """The values of existing counters (:meth:`add`), read together."""
        return [self.add(k, 0) for k in keys]

    @abstractmethod
    def all_gather(self, value: bytes, *, timeout: float, tag: str = "ag", watch: Watch | None = None) -> list[bytes]:
        """Collective: every rank contributes ``value``; all get the list indexed by rank (``watch`` as in
        :meth:`get`)."""

    def barrier(self, *, timeout: float, tag: str = "barrier", watch: Watch | None = None) -> None:
        """Collective: return once every rank has entered."""
        self.all_gather(b"", timeout=timeout, tag=tag, watch=watch)

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources (the store connection stays owned by its creator)."""
