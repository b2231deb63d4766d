"""Per-process runtime state shared by the world communicator and its sub-groups."""

from __future__ import annotations

import threading
import weakref
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
    #: How long a native wait polls, yielding between polls, before it sleeps on a futex (ns).
    poll_ns: int
    #: Every rank's heap size at init (live sizes: ``heap.heap_size(rank)``; heaps grow).
    heap_sizes: list[int]
    #: How many groups with a given member list this process created (matches keys).
    group_counts: dict[str, int] = field(default_factory=dict)
    finalized: bool = False
    #: Why this rank left an op half-way by its own cause (see :mod:`.liveness`), or None: every
    #: communicator of this rank is then broken until finalize and init.
    left: str | None = None
    #: Set in a process forked after init: it may not touch the shared heap (see state._after_fork_in_child).
    forked: bool = False
    #: Every live communicator over this heap (world and groups): finalize waits for their ops to leave.
    comms: weakref.WeakSet = field(default_factory=weakref.WeakSet)
    #: Guards ``group_counts`` and slot bookkeeping (new_group may run on several communicators at once).
    groups_lock: threading.Lock = field(default_factory=threading.Lock)
    #: Device heaps beside the CPU heap, by device type (``"cuda"``): :class:`~.device_heap.DeviceHeap`
    #: ``(device, transport, heap, sma)``; empty unless init asked for one (see :mod:`.device_heap`).
    device_heaps: dict = field(default_factory=dict)
    #: What :func:`~.state.finalize` runs once every op left, before the heap closes: frees of heap blocks that
    #: another thread's op might still have used when their owner closed (the host ops' regions).
    after_ops: list = field(default_factory=list)

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
