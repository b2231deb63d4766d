"""The globally addressable heap: every rank's segment, as seen by this rank.

A global address is ``(rank, offset)`` where ``offset`` counts from the start
of that rank's heap (after its control area). Every access to a peer is
checked against that peer's real heap size, exchanged at the handshake, so
asymmetric heaps are safe: a bad offset raises and touches nothing.
"""

from __future__ import annotations

import os

from ..errors import ZbcclInvalidUsageError
from . import layout
from .base import Segment, Transport
from .flags import primitives

__all__ = ["GlobalHeap"]


class GlobalHeap:
    """Segments of all ranks reachable from this process, plus their sizes.

    ``heap_sizes[r]`` is rank ``r``'s heap size (its segment minus the control
    area), known for every rank, mapped or not.
    """

    def __init__(self, rank: int, segments: dict[int, Segment], heap_sizes: list[int],
                 transport: Transport) -> None:
        self.rank = rank
        self.segments = segments
        self.heap_sizes = list(heap_sizes)
        self.transport = transport
        self.prims = primitives()
        self.closed = False

    @property
    def local(self) -> Segment:
        return self.segments[self.rank]

    @property
    def heap_base(self) -> int:
        """Address of offset 0 of this rank's heap."""
        return self.local.addr + layout.CTRL_BYTES

    @property
    def heap_bytes(self) -> int:
        return self.heap_sizes[self.rank]

    def reachable(self, rank: int) -> bool:
        return rank in self.segments

    def _segment(self, rank: int, op: str) -> Segment:
        if self.closed:
            raise ZbcclInvalidUsageError(f"{op}: the heap was finalized")
        if not 0 <= rank < len(self.heap_sizes):
            raise ZbcclInvalidUsageError(f"{op}: rank out of range, expected [0, {len(self.heap_sizes)}), got {rank}")
        seg = self.segments.get(rank)
        if seg is None:
            raise ZbcclInvalidUsageError(
                f"{op}: rank {rank} is on another host and its heap is not mapped here "
                "(no inter-host transport is configured)")
        return seg

    def check_range(self, rank: int, offset: int, nbytes: int, *, op: str) -> None:
        """Raise unless ``[offset, offset+nbytes)`` lies inside rank ``rank``'s heap."""
        size = self.heap_sizes[rank] if 0 <= rank < len(self.heap_sizes) else 0
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
            if base <= addr and addr + nbytes <= base + self.heap_sizes[rank]:
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
        """Verify every mapped peer's header: right layout, rank and size."""
        for rank in self.segments:
            got = (self.header(rank, layout.H_MAGIC), self.header(rank, layout.H_VERSION),
                   self.header(rank, layout.H_RANK), self.header(rank, layout.H_HEAP_BYTES))
            want = (layout.MAGIC_VALUE, layout.LAYOUT_VERSION, rank, self.heap_sizes[rank])
            if got != want:
                raise ZbcclInvalidUsageError(
                    f"init: rank {rank}'s segment header disagrees, expected (magic, version, rank, heap) "
                    f"{want}, got {got}")

    def close(self, *, unmap: bool) -> None:
        if not self.closed:
            self.closed = True
            self.transport.close(unmap=unmap)
