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

__all__ = ["Bootstrap"]


class Bootstrap(ABC):
    """Rendezvous and metadata exchange among ``world_size`` ranks."""

    rank: int
    world_size: int

    @abstractmethod
    def set(self, key: str, value: bytes) -> None:
        """Publish ``value`` under ``key`` (this rank's namespace is the caller's business)."""

    @abstractmethod
    def get(self, key: str, *, timeout: float, owner: int | None = None) -> bytes:
        """Block until ``key`` exists, then return it. ``owner`` is named on timeout."""

    @abstractmethod
    def add(self, key: str, delta: int) -> int:
        """Atomically add to an integer counter and return the new value."""

    @abstractmethod
    def all_gather(self, value: bytes, *, timeout: float, tag: str = "ag") -> list[bytes]:
        """Collective: every rank contributes ``value``; all get the list indexed by rank."""

    def barrier(self, *, timeout: float, tag: str = "barrier") -> None:
        """Collective: return once every rank has entered."""
        self.all_gather(b"", timeout=timeout, tag=tag)

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources (the store connection stays owned by its creator)."""
