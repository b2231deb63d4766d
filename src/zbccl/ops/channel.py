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
* ``PHASE`` (line 2): mid-op points of multi-phase algorithms (two-shot
  allreduce: "my reduced slice of chunk ``step-1`` is ready"). Each rank
  posts its current PHASE value in its header (field ``PHASE_BASE``); step
  ``k`` of the op is ``max(all posted values) + k``. So the counter only
  grows, by the op's own number of steps, and no encoding can overflow
  (the former ``seq << 24 | step`` did after 2^39 ops or 2^24 chunks).
* ``DONE`` (line 3): ``DONE = seq`` says "I no longer read your operands and
  mine are final". A rank returns only after every peer's ``DONE >= seq``,
  so the caller may reuse its tensors at once, and no peer can overwrite a
  header another rank has not read yet (a rank can post ``seq+1`` only after
  everyone finished ``seq``).

* ``ABORT`` (line 6): non-zero once this rank left an op half-way (Ctrl-C,
  an unexpected exception): the communicator is broken. Peers waiting for
  this rank read it at every liveness check and raise
  :class:`~zbccl.errors.ZbcclRemoteError` naming it within seconds, instead
  of waiting out the timeout.

Errors found after ``ARRIVE`` (disagreement, a rank's own bad arguments) are
raised only after the ``DONE`` handshake, so the group leaves the op in step;
everything the message needs (a peer's error text, its sizes) is copied
before ``DONE``, as a peer may overwrite it with its next op right after.
The header's ``ERROR`` field says what kind of error a rank posts
(``ERR_USAGE``, ``ERR_NOMEM``).
"""

from __future__ import annotations

import ctypes
import struct
import time
import zlib
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..errors import (
    ZbcclError,
    ZbcclInvalidUsageError,
    ZbcclOutOfMemoryError,
    ZbcclRemoteError,
    ZbcclTimeoutError,
)
from ..heap import layout
from ..runtime.waits import FlagSet, wait_flags
from .args import timeout_error
from .diagnose import late_message

if TYPE_CHECKING:
    from ..runtime.communicator import Communicator

__all__ = ["OpChannel", "Header", "channel_of", "sizes_digest", "ERR_USAGE", "ERR_NOMEM"]

L_ARRIVE, L_PHASE, L_DONE, L_HEADER, L_ABORT, L_VECTORS = 1, 2, 3, 4, 6, 8
#: Header ERROR values (chan.h mirrors them): what kind of error a rank posts.
ERR_USAGE, ERR_NOMEM = 1, 2
#: ABORT line values: why this rank left an op half-way (the word after the futex waiter count).
ABORT_INTERRUPT, ABORT_EXCEPTION = 1, 2
_HDR = struct.Struct("<16q")
VECTOR_CAPACITY = (layout.SLOT_BYTES - L_VECTORS * layout.LINE) // 8


class Header:
    """Field indices of the op header (16 int64)."""

    SEQ, OP, DTYPE, REDOP, IN_NUMEL, OUT_NUMEL, IN_OFF, OUT_OFF, ALGO, ROOT, ROW, DIGEST, ERROR, AUX, \
        PHASE_BASE = range(15)
    NAMES = {OP: "op", DTYPE: "dtype", REDOP: "reduce op", IN_NUMEL: "input numel", OUT_NUMEL: "output numel",
             ALGO: "algorithm", ROOT: "root rank", ROW: "elements per row", DIGEST: "size vector"}


def sizes_digest(sizes) -> int:
    """A cheap fingerprint of a size vector, compared across ranks."""
    return zlib.crc32(np.asarray(sizes, dtype=np.int64).tobytes())


class _LiveSizes:
    """Each group rank's heap size, read live at every check (heaps grow; see heap/heap.py)."""

    __slots__ = ("_heap", "_ranks")

    def __init__(self, heap, ranks) -> None:
        self._heap, self._ranks = heap, tuple(ranks)

    def __getitem__(self, r: int) -> int:
        return self._heap.heap_size(self._ranks[r])


class OpChannel:
    """Precomputed addresses and the handshake of one communicator's collectives."""

    @property
    def my_size(self) -> int:
        """This rank's live heap size."""
        return self._heap.heap_bytes

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
        self.my_flags = {i: line(me, i) for i in (L_ARRIVE, L_PHASE, L_DONE, L_ABORT)}
        group = [comm.ranks.index(g) for g in peers]
        self.peer_flags = {i: FlagSet(peers, [line(g, i) for g in peers], group) for i in (L_ARRIVE, L_PHASE, L_DONE)}
        #: Every group rank's ABORT, ARRIVE and DONE line and barrier flag (for diagnostics).
        self.lines = {i: [line(g, i) for g in comm.ranks] for i in (L_ABORT, L_ARRIVE, L_DONE, layout.SLOT_BARRIER)}
        self.headers = [(ctypes.c_char * _HDR.size).from_address(line(g, L_HEADER)) for g in comm.ranks]
        self.vectors = [np.frombuffer((ctypes.c_char * (VECTOR_CAPACITY * 8)).from_address(line(g, L_VECTORS)),
                                      dtype=np.int64) for g in comm.ranks]
        #: Local address of byte 0 of each group rank's heap, and that heap's size.
        self.heap_base = [heap.addr(g, 0) for g in comm.ranks]
        self.heap_size = _LiveSizes(heap, comm.ranks)
        self.my_base = self.heap_base[self.rank]
        self._heap = heap
        self._scratch = torch.empty(0, dtype=torch.uint8)
        #: (op, dtype, bytes) -> algorithm, filled by ``plan.choose`` (cleared when the table changes).
        self.choices: dict = {}
        self._sizes: dict = {}
        #: Seconds the current op's waits may take (its ``timeout=``, else the communicator's).
        self.timeout = self.default_timeout = ctx.timeout
        self.phase_base = 0
        #: Why this communicator is unusable on this rank (an op was left half-way), or None.
        self.broken: str | None = None

    # ------------------------------------------------------------- handshake
    def enter(self, timeout, *, op: str) -> str | None:
        """Start an op: refuse a broken communicator, set the op's timeout; a bad ``timeout`` is
        returned as an error for the handshake (the op then runs with the communicator's)."""
        if self.broken is not None:
            raise ZbcclInvalidUsageError(f"{op}: this communicator is broken on rank {self.rank}: {self.broken}; "
                                         "finalize and init again", ranks=(self.rank,))
        self.timeout, error = timeout_error(timeout, self.default_timeout, op=op)
        return error

    def left(self, seq: int, exc: BaseException, *, op: str) -> None:
        """An op that started at sequence number ``seq`` is being left by ``exc``: mark the
        communicator broken (ABORT line) if the op had posted ARRIVE and ``exc`` is not a
        ZbcclError. Ctrl-C or an unexpected exception mid-op would otherwise leave the peers
        waiting for this rank until their timeout. Ops call it from ``except BaseException``
        (free when nothing is raised, unlike a context manager)."""
        if self.seq != seq and not isinstance(exc, ZbcclError):
            why = ABORT_INTERRUPT if isinstance(exc, KeyboardInterrupt) else ABORT_EXCEPTION
            self.abort(why, f"op #{self.seq} ({op}) was left half-way by {type(exc).__name__}")

    def abort(self, why: int, text: str) -> None:
        """Publish that this rank left an op half-way; every later op on this communicator refuses."""
        self.broken = self.broken or text
        ctypes.c_int64.from_address(self.my_flags[L_ABORT] + 16).value = why
        self.prims.signal(self.my_flags[L_ABORT], self.seq)

    def aborted(self, r: int) -> int:
        """Why group rank ``r`` broke this communicator (``ABORT_*``), or 0."""
        if self.prims.load_acquire(self.lines[L_ABORT][r]) == 0:
            return 0
        return ctypes.c_int64.from_address(self.lines[L_ABORT][r] + 16).value or ABORT_EXCEPTION

    def wait(self, flags: FlagSet, target: int, *, op: str) -> None:
        """``wait_flags`` under this op's timeout, checking in slices whether a peer broke the
        communicator, and naming on timeout what each late rank is doing."""
        deadline = time.monotonic() + self.timeout
        slice_s = max(0.25, self.ctx.liveness_ns / 1e9)
        while True:
            left = deadline - time.monotonic()
            try:
                wait_flags(self.ctx, flags, target, timeout=max(0.0, min(slice_s, left)), op=op)
                return
            except ZbcclTimeoutError as exc:
                for r in exc.ranks:
                    if self.aborted(r):
                        raise self.abort_error(r, op=op) from None
                if left <= slice_s:
                    raise ZbcclTimeoutError(late_message(self, list(exc.ranks), op=op), ranks=exc.ranks) from None

    def abort_error(self, r: int, *, op: str) -> ZbcclRemoteError:
        why = "was interrupted (Ctrl-C)" if self.aborted(r) == ABORT_INTERRUPT else "hit an unexpected error"
        return ZbcclRemoteError(f"{op}: peer lost while waiting: rank {r} {why} in the middle of a collective and "
                                "left it; this communicator is broken", ranks=(r,))

    def begin(self, fields: list[int], *, op: str, vectors: np.ndarray | None = None,
              error: str | None = None, kind: int = ERR_USAGE) -> list[tuple[int, ...]]:
        """Post this rank's header, wait for every peer's, return all headers by group rank."""
        if vectors is not None and error is None and len(vectors) > VECTOR_CAPACITY - 1:
            error = f"{op}: world too large for per-rank size vectors"
        self.seq += 1
        seq = self.seq
        fields = list(fields) + [0] * (16 - len(fields))
        fields[Header.SEQ] = seq
        fields[Header.PHASE_BASE] = self.prims.load_acquire(self.my_flags[L_PHASE])
        if error is not None:
            fields[Header.ERROR] = kind
            raw = error.encode()[: VECTOR_CAPACITY * 8 - 16]
            self.vectors[self.rank][0] = len(raw)
            self.vectors[self.rank].view(np.uint8)[8:8 + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        elif vectors is not None:
            self.vectors[self.rank][: len(vectors)] = vectors
        _HDR.pack_into(self.headers[self.rank], 0, *fields)
        self.prims.signal(self.my_flags[L_ARRIVE], seq)
        self.wait(self.peer_flags[L_ARRIVE], seq, op=op)
        headers = [_HDR.unpack_from(h, 0) for h in self.headers]
        self.phase_base = max(h[Header.PHASE_BASE] for h in headers)
        bad = [r for r, h in enumerate(headers) if h[Header.SEQ] != seq]
        if bad:
            self.end(op=op)
            raise ZbcclInvalidUsageError(
                f"{op}: ranks out of step, expected op #{seq} everywhere, got "
                + ", ".join(f"rank {r} at #{headers[r][Header.SEQ]}" for r in bad), ranks=tuple(bad))
        return headers

    def phase(self, step: int = 1, *, op: str, wait: bool = True) -> None:
        """Mid-op rendezvous number ``step`` (1, 2, ...): signal it, then wait for the peers'."""
        self.prims.signal(self.my_flags[L_PHASE], self.phase_base + step)
        if wait:
            self.wait_phase(step, op=op)

    def wait_phase(self, step: int, *, op: str) -> None:
        """Wait until every peer signalled phase ``step`` of this op."""
        self.wait(self.peer_flags[L_PHASE], self.phase_base + step, op=op)

    def end(self, *, op: str) -> None:
        """Final rendezvous: nobody reads anyone's operands any more."""
        self.prims.signal(self.my_flags[L_DONE], self.seq)
        self.wait(self.peer_flags[L_DONE], self.seq, op=op)

    def agree(self, headers: list[tuple[int, ...]], fields: tuple[int, ...], *, op: str,
              show=None) -> None:
        """Raise on every rank (after ``end``) unless all ranks agree on ``fields``."""
        errs = [r for r, h in enumerate(headers) if h[Header.ERROR]]
        if errs:
            r = errs[0]
            text = self.error_text(r)  # before DONE: afterwards rank r may post its next op over it
            self.end(op=op)
            raise peer_error(op, r, headers[r][Header.ERROR], text, ranks=tuple(errs))
        for f in fields:
            values = [h[f] for h in headers]
            if any(v != values[0] for v in values):
                self.end(op=op)
                fmt = show or (lambda _f, v: str(v))
                got = ", ".join(f"rank {r} {fmt(f, v)}" for r, v in enumerate(values))
                raise ZbcclInvalidUsageError(f"{op}: ranks disagree on {Header.NAMES.get(f, f)}, got {got}",
                                             ranks=tuple(range(len(values))))

    def agree_sizes(self, width: int, *, op: str, row: int = 1) -> None:
        """Raise on every rank (after ``end``) unless every rank posted the same first ``width``
        entries of its size vector (exact counts, printed in rows when they differ)."""
        vecs = [v[:width].copy() for v in self.vectors]  # copies: DONE lets peers overwrite them
        bad = [r for r in range(1, self.world_size) if not np.array_equal(vecs[r], vecs[0])]
        if bad:
            self.end(op=op)
            raise ZbcclInvalidUsageError(sizes_message(op, vecs[0], bad[0], vecs[bad[0]], row),
                                         ranks=(0, bad[0]))

    def fail_together(self, opcode: int, error: str, *, op: str) -> None:
        """This rank's arguments are unusable: run the handshake with the error flag so that every
        rank raises (instead of this one raising alone and the others waiting for it)."""
        if self.world_size == 1:
            raise ZbcclInvalidUsageError(error)
        hdrs = self.begin([0, opcode], op=op, error=error)
        self.agree(hdrs, (), op=op)
        raise AssertionError("unreachable: agree() raises when a header carries an error")  # pragma: no cover

    def error_text(self, rank: int) -> str:
        return text_of(self.vectors[rank])

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


def text_of(vec: np.ndarray) -> str:
    """The error text a rank posted in its size-vector area: int64 length, then UTF-8 bytes."""
    n = max(0, min(int(vec[0]), VECTOR_CAPACITY * 8 - 16))
    return bytes(vec.view(np.uint8)[8:8 + n]).decode(errors="replace")


def peer_error(op: str, r: int, kind: int, text: str, *, ranks: tuple[int, ...]) -> ZbcclError:
    """The error every rank raises when rank ``r`` posted an error of ``kind`` with ``text``."""
    if kind == ERR_NOMEM:
        return ZbcclOutOfMemoryError(f"{op}: rank {r} ran out of memory: {text}", ranks=ranks)
    return ZbcclInvalidUsageError(f"{op}: rank {r} passed invalid arguments: {text}", ranks=ranks)


def sizes_message(op: str, ref: np.ndarray, r: int, got: np.ndarray, row: int) -> str:
    unit = "elements" if row == 1 else "rows"
    show = lambda v: str([int(x) // max(1, row) for x in v])  # noqa: E731
    return (f"{op}: ranks disagree on sizes ({unit} per rank), expected {show(ref)} (rank 0) on every rank, "
            f"got {show(got)} on rank {r}")


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
