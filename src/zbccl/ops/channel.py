"""The op channel: the per-communicator handshake every collective runs.

Synchronisation protocol (all flags live in the *owner's* comm slot, one
64-byte line each, and only grow, so they are never reset):

* ``ARRIVE`` (slot line 1): a rank writes its op header (line 4-5: sequence
  number, op, dtype, reduce op, sizes, the heap offsets of its operands, the
  algorithm, an error flag) and, for ops with per-rank sizes, its size vectors
  (lines 8+), then release-stores ``ARRIVE = seq``. Peers acquire-load
  ``ARRIVE >= seq`` before reading the header, so they see it complete.
* Every rank reads every header and checks that the group agrees (same op,
  dtype, reduce op, sizes, algorithm). All ranks read the same headers, so
  all reach the same verdict: either every rank proceeds or every rank raises
  :class:`~zbccl.errors.ZbcclInvalidUsageError` naming the disagreement.
* ``PHASE`` (line 2): mid-op points of multi-phase algorithms, valued
  ``seq << 24 | step`` (two-shot allreduce: "my reduced slice of chunk
  ``step-1`` is ready").
* ``DONE`` (line 3): ``DONE = seq`` says "I no longer read your operands and
  mine are final". A rank returns only after every peer's ``DONE >= seq``,
  so the caller may reuse its tensors at once, and no peer can overwrite a
  header another rank has not read yet (a rank can post ``seq+1`` only after
  everyone finished ``seq``).

Errors found after ``ARRIVE`` (disagreement, a rank's own bad arguments) are
raised only after the ``DONE`` handshake, so the group leaves the op in step.
"""

from __future__ import annotations

import ctypes
import struct
import zlib
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..errors import ZbcclInvalidUsageError
from ..heap import layout
from ..runtime.waits import FlagSet, wait_flags

if TYPE_CHECKING:
    from ..runtime.communicator import Communicator

__all__ = ["OpChannel", "Header", "channel_of", "sizes_digest"]

L_ARRIVE, L_PHASE, L_DONE, L_HEADER, L_VECTORS = 1, 2, 3, 4, 8
_HDR = struct.Struct("<16q")
VECTOR_CAPACITY = (layout.SLOT_BYTES - L_VECTORS * layout.LINE) // 8


class Header:
    """Field indices of the op header (16 int64)."""

    SEQ, OP, DTYPE, REDOP, IN_NUMEL, OUT_NUMEL, IN_OFF, OUT_OFF, ALGO, ROOT, ROW, DIGEST, ERROR, AUX = range(14)
    NAMES = {OP: "op", DTYPE: "dtype", REDOP: "reduce op", IN_NUMEL: "input numel", OUT_NUMEL: "output numel",
             ALGO: "algorithm", ROOT: "root rank", ROW: "elements per row", DIGEST: "size vector"}


def sizes_digest(sizes) -> int:
    """A cheap fingerprint of a size vector, compared across ranks."""
    return zlib.crc32(np.asarray(sizes, dtype=np.int64).tobytes())


class OpChannel:
    """Precomputed addresses and the handshake of one communicator's collectives."""

    def __init__(self, comm: Communicator) -> None:
        ctx = comm._ctx
        heap = ctx.heap
        if not all(heap.reachable(g) for g in comm.ranks):
            raise ZbcclInvalidUsageError(
                "collective: this communicator spans hosts, and no inter-host transport is configured yet")
        self.comm, self.ctx, self.prims = comm, ctx, ctx.prims
        self.world_size, self.rank = comm.world_size, comm.rank
        self.seq = 0
        slot = comm.slot

        def line(g: int, i: int) -> int:
            return heap.ctrl_addr(g, layout.slot_line(slot, i))

        me = ctx.rank
        peers = [g for g in comm.ranks if g != me]
        self.my_flags = {i: line(me, i) for i in (L_ARRIVE, L_PHASE, L_DONE)}
        group = [comm.ranks.index(g) for g in peers]
        self.peer_flags = {i: FlagSet(peers, [line(g, i) for g in peers], group) for i in (L_ARRIVE, L_PHASE, L_DONE)}
        self.headers = [(ctypes.c_char * _HDR.size).from_address(line(g, L_HEADER)) for g in comm.ranks]
        self.vectors = [np.frombuffer((ctypes.c_char * (VECTOR_CAPACITY * 8)).from_address(line(g, L_VECTORS)),
                                      dtype=np.int64) for g in comm.ranks]
        #: Local address of byte 0 of each group rank's heap, and that heap's size.
        self.heap_base = [heap.addr(g, 0) for g in comm.ranks]
        self.heap_size = [ctx.heap_sizes[g] for g in comm.ranks]
        self.my_base, self.my_size = self.heap_base[self.rank], self.heap_size[self.rank]
        self._scratch = torch.empty(0, dtype=torch.uint8)
        #: (op, dtype, bytes) -> algorithm, filled by ``plan.choose`` (cleared when the table changes).
        self.choices: dict = {}
        self._sizes: dict = {}

    # ------------------------------------------------------------- handshake
    def begin(self, fields: list[int], *, op: str, vectors: np.ndarray | None = None,
              error: str | None = None) -> list[tuple[int, ...]]:
        """Post this rank's header, wait for every peer's, return all headers by group rank."""
        self.seq += 1
        seq = self.seq
        fields = list(fields) + [0] * (16 - len(fields))
        fields[Header.SEQ] = seq
        if error is not None:
            fields[Header.ERROR] = 1
            raw = error.encode()[: VECTOR_CAPACITY * 8 - 8]
            self.vectors[self.rank][0] = len(raw)
            self.vectors[self.rank].view(np.uint8)[8:8 + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        elif vectors is not None:
            if len(vectors) > VECTOR_CAPACITY:
                raise ZbcclInvalidUsageError(f"{op}: world too large for per-rank size vectors")
            self.vectors[self.rank][: len(vectors)] = vectors
        _HDR.pack_into(self.headers[self.rank], 0, *fields)
        self.prims.signal(self.my_flags[L_ARRIVE], seq)
        wait_flags(self.ctx, self.peer_flags[L_ARRIVE], seq, timeout=self.ctx.timeout, op=op)
        headers = [_HDR.unpack_from(h, 0) for h in self.headers]
        bad = [r for r, h in enumerate(headers) if h[Header.SEQ] != seq]
        if bad:
            self.end(op=op)
            raise ZbcclInvalidUsageError(
                f"{op}: ranks out of step, expected op #{seq} everywhere, got "
                + ", ".join(f"rank {r} at #{headers[r][Header.SEQ]}" for r in bad), ranks=tuple(bad))
        return headers

    def phase(self, step: int = 1, *, op: str, wait: bool = True) -> None:
        """Mid-op rendezvous number ``step`` (1, 2, ...): signal it, then wait for the peers'.

        The flag value is ``seq << 24 | step``, so it grows across steps and ops alike.
        """
        value = (self.seq << 24) | step
        self.prims.signal(self.my_flags[L_PHASE], value)
        if wait:
            self.wait_phase(step, op=op)

    def wait_phase(self, step: int, *, op: str) -> None:
        """Wait until every peer signalled phase ``step`` of this op."""
        wait_flags(self.ctx, self.peer_flags[L_PHASE], (self.seq << 24) | step, timeout=self.ctx.timeout, op=op)

    def end(self, *, op: str) -> None:
        """Final rendezvous: nobody reads anyone's operands any more."""
        self.prims.signal(self.my_flags[L_DONE], self.seq)
        wait_flags(self.ctx, self.peer_flags[L_DONE], self.seq, timeout=self.ctx.timeout, op=op)

    def agree(self, headers: list[tuple[int, ...]], fields: tuple[int, ...], *, op: str,
              show=None) -> None:
        """Raise on every rank (after ``end``) unless all ranks agree on ``fields``."""
        errs = [r for r, h in enumerate(headers) if h[Header.ERROR]]
        if errs:
            self.end(op=op)
            r = errs[0]
            raise ZbcclInvalidUsageError(f"{op}: rank {r} passed invalid arguments: {self.error_text(r)}",
                                         ranks=tuple(errs))
        for f in fields:
            values = [h[f] for h in headers]
            if any(v != values[0] for v in values):
                self.end(op=op)
                fmt = show or (lambda _f, v: str(v))
                got = ", ".join(f"rank {r} {fmt(f, v)}" for r, v in enumerate(values))
                raise ZbcclInvalidUsageError(f"{op}: ranks disagree on {Header.NAMES.get(f, f)}, got {got}",
                                             ranks=tuple(range(len(values))))

    def fail_together(self, opcode: int, error: str, *, op: str) -> None:
        """This rank's arguments are unusable: run the handshake with the error flag so that every
        rank raises (instead of this one raising alone and the others waiting for it)."""
        hdrs = self.begin([0, opcode], op=op, error=error)
        self.agree(hdrs, (), op=op)
        raise AssertionError("unreachable: agree() raises when a header carries an error")  # pragma: no cover

    def error_text(self, rank: int) -> str:
        vec = self.vectors[rank]
        n = int(vec[0])
        return bytes(vec.view(np.uint8)[8:8 + n]).decode(errors="replace")

    def check_span(self, headers, field: int, nbytes: list[int] | int, *, op: str) -> list[int]:
        """Local addresses of each rank's operand ``field``, bounds-checked against its heap."""
        out = []
        for r, h in enumerate(headers):
            off = h[field]
            n = nbytes[r] if isinstance(nbytes, list) else nbytes
            if off < 0 or off + n > self.heap_size[r]:
                self.end(op=op)
                raise ZbcclInvalidUsageError(
                    f"{op}: rank {r}'s operand is outside its heap, expected [0, {self.heap_size[r]}), "
                    f"got offset {off} + {n} bytes", ranks=(r,))
            out.append(self.heap_base[r] + off)
        return out

    # ---------------------------------------------------------------- memory
    def offset_of(self, t: torch.Tensor) -> int:
        """Heap offset of a contiguous tensor's data in this rank's heap, or -1."""
        if not t.is_contiguous():
            return -1
        ptr = t.data_ptr()
        if ptr == 0:  # zero-element tensors report 0; their storage still has an address
            ptr = t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size()
        off = ptr - self.my_base
        return off if 0 <= off and off + t.numel() * t.element_size() <= self.my_size else -1

    def sizes(self, counts: list[int]) -> tuple[int, int]:
        """``(digest, address of an int64 copy)`` of a size vector, cached per vector."""
        key = tuple(counts)
        hit = self._sizes.get(key)
        if hit is None:
            if len(self._sizes) > 1024:
                self._sizes.clear()
            arr = np.asarray(counts, dtype=np.int64)
            hit = self._sizes[key] = (sizes_digest(counts), int(arr.ctypes.data), arr)
        return hit[0], hit[1]

    def scratch(self, nbytes: int) -> int:
        """Address of a private scratch buffer of at least ``nbytes`` (reused across calls)."""
        if self._scratch.numel() < nbytes:
            self._scratch = torch.empty(max(nbytes, 2 * self._scratch.numel()), dtype=torch.uint8)
        return self._scratch.data_ptr()


def channel_of(comm: Communicator) -> OpChannel:
    """The communicator's op channel, created on first use."""
    ch = comm.__dict__.get("_op_channel")
    if ch is None:
        if not hasattr(comm._ctx.prims, "reduce_n"):
            from ..errors import ZbcclSystemError

            raise ZbcclSystemError(
                "collective: the native core is not available (no C compiler?); see 'zbccl info' and the README")
        ch = comm.__dict__["_op_channel"] = OpChannel(comm)
    return ch
