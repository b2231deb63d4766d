"""The globally addressable heap: every rank's segment, as seen by this rank.

A global address is ``(rank, offset)`` where ``offset`` counts from the start
of that rank's heap (after its control area). Every access to a peer is
checked against that peer's real heap size, so asymmetric heaps are safe: a
bad offset raises and touches nothing.

Heaps grow (see ``shm.py``, "Growth"): a rank's live size is the value its
owner publishes in its header line ``H_HEAP_BYTES`` (release store, after the
new range is reserved); every bounds check reads it (acquire), so an offset a
peer learned through any exchange with the owner is within the size it reads.
"""

from __future__ import annotations

import os

from ..errors import ZbcclInvalidUsageError, ZbcclOutOfMemoryError
from . import layout
from .base import Segment, Transport
from .flags import primitives

__all__ = ["GlobalHeap"]


class GlobalHeap:
    """Segments of all ranks reachable from this process, plus their sizes.

    :meth:`heap_size` is rank ``r``'s live heap size (its segment minus the
    control area); ``initial_sizes`` and ``max_sizes`` are what every rank
    announced at init (a rank on another host stays at its initial size here).
    """

    def __init__(self, rank: int, segments: dict[int, Segment], heap_sizes: list[int],
                 transport: Transport, *, max_sizes: list[int] | None = None) -> None:
        self.rank = rank
        self.segments = segments
        self.initial_sizes = list(heap_sizes)
        self.max_sizes = list(heap_sizes) if max_sizes is None else list(max_sizes)
        self.transport = transport
        self.prims = primitives()
        self.closed = False
        self._my_size = self.initial_sizes[rank]  # the owner's own word, mirrored (only it writes it)
        self._size_words = {r: seg.addr + layout.H_HEAP_BYTES for r, seg in segments.items() if r != rank}

    def heap_size(self, rank: int) -> int:
        """Rank ``rank``'s heap size now (0 for a rank out of range or a peer not set up yet)."""
        if rank == self.rank:
            return self._my_size
        word = self._size_words.get(rank)
        if word is None:
            return self.initial_sizes[rank] if 0 <= rank < len(self.initial_sizes) else 0
        # Clamped: a peer's header never makes us touch memory past its reservation.
        return min(self.prims.load_acquire(word), self.max_sizes[rank])

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
        self.transport.grow(self.rank, layout.segment_bytes(nbytes))
        self._my_size = nbytes
        self.set_header(layout.H_HEAP_BYTES, nbytes)  # release: the range is backed before anyone sees it

    @property
    def local(self) -> Segment:
        return self.segments[self.rank]

    @property
    def heap_base(self) -> int:
        """Address of offset 0 of this rank's heap."""
        return self.local.addr + layout.CTRL_BYTES

    @property
    def heap_bytes(self) -> int:
        """This rank's live heap size."""
        return self._my_size

    @property
    def heap_max_bytes(self) -> int:
        return self.max_sizes[self.rank]

    def reachable(self, rank: int) -> bool:
        return rank in self.segments

    def _segment(self, rank: int, op: str) -> Segment:
        if self.closed:
            raise ZbcclInvalidUsageError(f"{op}: the heap was finalized")
        if not 0 <= rank < len(self.initial_sizes):
            raise ZbcclInvalidUsageError(
                f"{op}: rank out of range, expected [0, {len(self.initial_sizes)}), got {rank}")
        seg = self.segments.get(rank)
        if seg is None:
            raise ZbcclInvalidUsageError(
                f"{op}: rank {rank} is on another host and its heap is not mapped here "
                "(no inter-host transport is configured)")
        return seg

    def check_range(self, rank: int, offset: int, nbytes: int, *, op: str) -> None:
        """Raise unless ``[offset, offset+nbytes)`` lies inside rank ``rank``'s heap."""
        size = self.heap_size(rank)
        if offset < 0 or nbytes < 0 or offset + nbytes > size:
            raise ZbcclInvalidUsageError(
                f"{op}: out of bounds of rank {rank}'s heap, expected [offset, offset+nbytes) within "
                f"[0, {size}), got offset={offset} nbytes={nbytes}")

    def addr(self, rank: int, offset: int, nbytes: int = 0, *, op: str = "heap") -> int:
        """Local address of byte ``offset`` of rank ``rank``'s heap (bounds-checked)."""
        seg = self._segment(rank, op)
        self.check_range(rank, offset, nbytes, op=op)
        return seg.addr + layout.CTRL_BYTES + offset

    def locate(self, addr: int, nbytes: int) -> tuple[int, int] | None:
        """``(rank, offset)`` of an address range lying wholly inside one mapped heap, else None."""
        for rank, seg in self.segments.items():
            base = seg.addr + layout.CTRL_BYTES
            if base <= addr and addr + nbytes <= base + self.heap_size(rank):
                return rank, addr - base
        return None

    def ctrl_addr(self, rank: int, offset: int) -> int:
        """Local address of byte ``offset`` of rank ``rank``'s control area."""
        assert 0 <= offset < layout.CTRL_BYTES
        return self._segment(rank, "control").addr + offset

    def header(self, rank: int, field: int) -> int:
        return self.prims.load_acquire(self.ctrl_addr(rank, field))

    def set_header(self, field: int, value: int) -> None:
        self.prims.signal(self.ctrl_addr(self.rank, field), value)

    def init_header(self) -> None:
        """Write this rank's header (before peers can look at it)."""
        for field, value in ((layout.H_MAGIC, layout.MAGIC_VALUE), (layout.H_VERSION, layout.LAYOUT_VERSION),
                             (layout.H_RANK, self.rank), (layout.H_HEAP_BYTES, self.heap_bytes)):
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
