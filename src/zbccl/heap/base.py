"""What a heap transport must provide, so that a CUDA backend can plug in later.

A transport creates this rank's segment, maps the segments of the peers it can
reach, and tells which peers died. Everything above it (the SMA, handles,
bounds checks, the collectives' Python layer) sees only :class:`Segment`
objects: a rank, a base address in this process, a size and a device. A CUDA
transport would return device addresses from CUDA IPC or VMM mappings of the
same sizes; the control area could stay in host shared memory.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from ..bootstrap.base import Bootstrap
from ..bootstrap.secret import JobSecret
from ..bootstrap.topology import Topology
from ..errors import ZbcclOutOfMemoryError

__all__ = ["Segment", "Transport"]


@dataclass
class Segment:
    """One rank's segment as mapped in this process.

    ``nbytes`` is the size this process knows to be backed (for a peer's segment,
    its size at mapping time: read the owner's header for the live size);
    ``reserved`` the address range mapped for it, at least ``nbytes``, the most
    it may grow to.
    """

    rank: int
    addr: int
    nbytes: int
    device: str = "cpu"
    owner: bool = False
    reserved: int = 0

    def __post_init__(self) -> None:
        self.reserved = max(self.reserved, self.nbytes)

    def contains(self, addr: int, nbytes: int) -> bool:
        return self.addr <= addr and addr + nbytes <= self.addr + self.nbytes


class Transport(ABC):
    """Creates, exchanges and maps segments among the ranks of one host."""

    device: str = "cpu"

    @abstractmethod
    def establish(self, bootstrap: Bootstrap, topology: Topology, *, segment_bytes: list[int],
                  job_id: str, timeout: float, reserve_bytes: list[int] | None = None) -> dict[int, Segment]:
        """Collective: create this rank's segment and map every reachable peer's.

        ``segment_bytes`` (initial sizes) and ``reserve_bytes`` (most each segment
        may grow to; default: no growth) are indexed by rank. Returns segments
        keyed by rank, this rank's included. Ranks on other hosts are absent.
        """

    def grow(self, rank: int, nbytes: int) -> None:
        """Owner only: make this rank's segment ``nbytes`` long (at most its reservation).

        Raises ZbcclOutOfMemoryError with nothing changed when it cannot.
        """
        raise ZbcclOutOfMemoryError(f"heap: grow: the {self.device} transport cannot grow a segment")

    @abstractmethod
    def dead_peers(self) -> list[int]:
        """Ranks whose process is gone (exited or killed). Cheap; never blocks."""

    def liveness_fd(self, rank: int) -> int:
        """A descriptor that becomes readable (``POLLIN``) when ``rank``'s process exits, or -1 if there is none.

        The native core polls it every liveness interval; the CPU transport returns a pidfd.
        """
        return -1

    def job_secret(self, job_id: str, world_size: int) -> JobSecret | None:
        """After :meth:`establish`: the job's secret, shared by every rank through this transport, never
        through the store; None when some rank is out of this transport's reach (a transport between
        hosts would agree on it in its own authenticated handshake)."""
        return None

    @abstractmethod
    def close(self, *, unmap: bool) -> None:
        """Drop connections; unmap the segments only when ``unmap`` (no tensor still uses them)."""
