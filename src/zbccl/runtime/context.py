"""Per-process runtime state shared by the world communicator and its sub-groups."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..bootstrap.rendezvous import Rendezvous
from ..bootstrap.store import StoreBootstrap
from ..bootstrap.topology import Topology
from ..heap.heap import GlobalHeap
from ..sma import CachingAllocator

__all__ = ["Context"]


@dataclass
class Context:
    """Everything one ``zbccl.init`` built: one heap, one SMA, one job."""

    rendezvous: Rendezvous
    bootstrap: StoreBootstrap
    topology: Topology
    heap: GlobalHeap
    sma: CachingAllocator
    job_id: str
    generation: int
    timeout: float
    spin: int
    liveness_ns: int
    heap_sizes: list[int]
    #: How many groups with a given member list this process created (matches keys).
    group_counts: dict[str, int] = field(default_factory=dict)
    finalized: bool = False

    @property
    def rank(self) -> int:
        return self.bootstrap.rank

    @property
    def world_size(self) -> int:
        return self.bootstrap.world_size

    @property
    def prims(self):
        return self.heap.prims

    @property
    def key_prefix(self) -> str:
        return f"{self.rendezvous.namespace}/{self.generation}"
