"""The globally addressable heap: every rank's segment, as seen by this rank.

A global address is ``(rank, offset)`` where ``offset`` counts from the start
of that rank's heap (after its control area). Every access to a peer is
checked against that peer's real heap size, so asymmetric heaps are safe: a
bad offset raises and touches nothing.

Every access goes through the :class:`~.transports.base.Transport`: views and
signal words through its verbs; the addresses native code needs through its
native-core handle (:meth:`GlobalHeap.addr`, :meth:`GlobalHeap.ctrl_addr`).

Heaps grow (see ``transports/shm/transport.py``, "Growth"): a rank's live size
is the value its owner's transport publishes in its signal pad (release store,
after the new range is reserved); every bounds check reads it (acquire), so an
offset a peer learned through any exchange with the owner is within the size
it reads.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch

from ..errors import ZbcclInvalidUsageError, ZbcclOutOfMemoryError
from . import layout
from .flags import primitives
from .transports.base import Segment, Transport

__all__ = ["GlobalHeap"]


class GlobalHeap:
    """Segments of all ranks reachable from this process, plus their sizes.

    :meth:`heap_size` is rank ``r``'s live heap size; ``initial_sizes`` and
    ``max_sizes`` are what every rank announced at init (a rank on another
    host stays at its initial size here).
    """

    def __init__(self, rank: int, segments: dict[int, Segment], heap_sizes: list[int],
                 transport: Transport, *, max_sizes: list[int] | None = None) -> None:
        self.rank = rank
        self.segments = segments
        self.initial_sizes = list(heap_sizes)
        self.max_sizes = list(heap_sizes) if max_sizes is None else list(max_sizes)
        self.transport = transport
        #: The transport's native-core handle: addresses for native code only.
        self.native = transport.native()
        self.prims = primitives()
        self.closed = False
        self._my_size = self.initial_sizes[rank]  # the owner's own size, mirrored (only it grows it)

    def heap_size(self, rank: int) -> int:
        """Rank ``rank``'s heap size now (0 for a rank out of range or a peer not set up yet)."""
        if rank == self.rank:
            return self._my_size
        if not self.transport.viewable(rank):
            return self.initial_sizes[rank] if 0 <= rank < len(self.initial_sizes) else 0
        return min(self.transport.size(rank), self.max_sizes[rank])

    @property
    def heap_sizes(self) -> list[int]:
        """Every rank's live heap size (a snapshot)."""
        return [self.heap_size(r) for r in range(len(self.initial_sizes))]

    def grow(self, nbytes: int) -> None:
        """Owner only: grow this rank's heap to ``nbytes`` and publish the size (not collective).

        Raises ZbcclOutOfMemoryError with nothing changed when the transport
        cannot (beyond ``max_sizes[rank]``, or the machine is full).
        """
        if self.closed:
            raise ZbcclInvalidUsageError("heap: grow: the heap was finalized")
        if nbytes <= self._my_size:
            return
        if nbytes > self.max_sizes[self.rank]:
            raise ZbcclOutOfMemoryError(
                f"heap: grow: heap of {nbytes} bytes requested, expected at most heap_max_bytes="
                f"{self.max_sizes[self.rank]}")
        self.transport.grow(nbytes)  # publishes (release): the range is backed before anyone sees it
        self._my_size = nbytes

    @property
    def heap_base(self) -> int:
        """Native-core address of offset 0 of this rank's heap (for native code: the allocator hook)."""
        return self.native.data_addr(self.rank)

    @property
    def heap_bytes(self) -> int:
        """This rank's live heap size."""
        return self._my_size

    @property
    def heap_max_bytes(self) -> int:
        return self.max_sizes[self.rank]

    def reachable(self, rank: int) -> bool:
        """Whether ``rank``'s heap is mapped here (views work). A rank on another host that the routed
        transport reaches through put/get only is not: the ops treat it as out of reach."""
        return self.transport.viewable(rank)

    def _check_rank(self, rank: int, op: str) -> None:
        if self.closed:
            raise ZbcclInvalidUsageError(f"{op}: the heap was finalized")
        if not 0 <= rank < len(self.initial_sizes):
            raise ZbcclInvalidUsageError(
                f"{op}: rank out of range, expected [0, {len(self.initial_sizes)}), got {rank}")
        if not self.transport.viewable(rank):
            raise ZbcclInvalidUsageError(
                f"{op}: rank {rank} is on another host and its heap is not mapped here "
                "(a remote heap is reached through the transport's put/get, never viewed)")

    def check(self, rank: int, offset: int, nbytes: int, *, op: str) -> None:
        """Raise unless ``rank``'s heap is mapped here and ``[offset, offset+nbytes)`` lies inside it."""
        self._check_rank(rank, op)
        self.check_range(rank, offset, nbytes, op=op)

    def check_range(self, rank: int, offset: int, nbytes: int, *, op: str) -> None:
        """Raise unless ``[offset, offset+nbytes)`` lies inside rank ``rank``'s heap."""
        size = self.heap_size(rank)
        if offset < 0 or nbytes < 0 or offset + nbytes > size:
            raise ZbcclInvalidUsageError(
                f"{op}: out of bounds of rank {rank}'s heap, expected [offset, offset+nbytes) within "
                f"[0, {size}), got offset={offset} nbytes={nbytes}")

    def view(self, rank: int, offset: int, shape: Sequence[int], dtype: torch.dtype, *,
             stride: Sequence[int] | None = None, release: Callable[[], None] | None = None,
             op: str = "heap") -> torch.Tensor:
        """Zero-copy, bounds-checked tensor over rank ``rank``'s heap (the transport's :meth:`view`)."""
        if self.closed or not self.transport.viewable(rank):
            self._check_rank(rank, op)  # raises, naming what is wrong
        return self.transport.view(rank, offset, shape, dtype, stride=stride, release=release, op=op)

    def offset_of(self, t: torch.Tensor) -> int:
        """Heap offset of ``t``'s first element if its whole storage lies in this rank's heap, else -1."""
        return -1 if self.closed else self.transport.offset_of(self.rank, t)

    def addr(self, rank: int, offset: int, nbytes: int = 0, *, op: str = "heap") -> int:
        """Native-core address of byte ``offset`` of rank ``rank``'s heap (bounds-checked): only for
        tables that native code reads (copy tables, the op channel)."""
        self._check_rank(rank, op)
        return self.native.data_addr(rank, offset, nbytes, op=op)

    def ctrl_addr(self, rank: int, offset: int) -> int:
        """Native-core address of byte ``offset`` of rank ``rank``'s signal pad (for native code only)."""
        self._check_rank(rank, "control")
        return self.native.pad_addr(rank, offset)

    def header(self, rank: int, field: int) -> int:
        return self.transport.load(rank, field)

    def set_header(self, field: int, value: int) -> None:
        self.transport.signal(self.rank, field, value)

    def init_header(self) -> None:
        """Write this rank's header (before peers can look at it; the transport wrote its size)."""
        for field, value in ((layout.H_MAGIC, layout.MAGIC_VALUE), (layout.H_VERSION, layout.LAYOUT_VERSION),
                             (layout.H_RANK, self.rank)):
            self.set_header(field, value)
        self.set_header(layout.H_PID, os.getpid())
        self.set_header(layout.H_STATE, layout.STATE_READY)

    def check_peer_headers(self) -> None:
        """Verify every mapped peer's header: right layout and rank, a size between its initial and max.

        A peer may already have grown: it can leave init and allocate before this rank checks.
        """
        for rank in self.segments:
            got = (self.header(rank, layout.H_MAGIC), self.header(rank, layout.H_VERSION),
                   self.header(rank, layout.H_RANK))
            want = (layout.MAGIC_VALUE, layout.LAYOUT_VERSION, rank)
            size = self.header(rank, layout.H_HEAP_BYTES)
            lo, hi = self.initial_sizes[rank], self.max_sizes[rank]
            if got != want or not lo <= size <= hi:
                raise ZbcclInvalidUsageError(
                    f"init: rank {rank}'s segment header disagrees, expected (magic, version, rank) {want} and "
                    f"a heap of {lo} to {hi} bytes, got {got} and {size} bytes")

    def close(self, *, unmap: bool) -> None:
        if not self.closed:
            self.closed = True
            self.transport.close(unmap=unmap)
