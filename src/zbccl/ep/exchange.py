"""The one protocol every EP op runs over its communicator: publish -> pull -> barrier.

1. **Prepare** (local). A rank checks its arguments, stages what peers must read but is not a
   contiguous heap tensor (a heap block, counted in ``memory_stats()["staged_bytes"]``), and
   writes its plan (counts, per-destination token lists) into a heap block of its own.
2. **Publish**: each rank writes a fixed 64-int64 header (status and error text, shapes, dtypes,
   heap offsets of its operands and plan) into its heap, enters a barrier, and copies every peer's
   header out of the peer's heap (the offsets were gathered once, when the Buffer was built). The
   barrier is the release/acquire point: once it returns, every rank may read every peer's
   published blocks. Headers alternate between two slots (see ``Exchange.__init__``).
   If any rank posted an error, every rank raises the same error (``ZbcclInvalidUsageError``,
   or ``ZbcclOutOfMemoryError`` for a block that did not fit) and nothing is read or written.
   Disagreements between ranks (experts, hidden size, dtype, a handle from another dispatch)
   are found from the gathered headers, which every rank holds alike, so all raise together.
3. **Pull** (local writes only). Each rank copies the rows it receives from its peers'
   published blocks into its own outputs (the native ``copy_many`` row tables, bounds-checked
   addresses) or reduces them (combine). Peers' memory is only ever read.
4. **Barrier**: when it returns, no peer reads this rank's published blocks any more; staged
   blocks are freed and the caller may reuse its inputs. It runs even when this rank's pull
   failed, so such a failure stays on its rank and the group stays in step.

Every barrier is tagged (:meth:`Exchange.sync`): it is the communicator's barrier, an op of its op
channel (``ops/barrier.py``), and each rank posts in its header which op (its number and kind) and
which phase (publish, the closing barrier, clean) it is in; the channel's handshake compares them.
Ranks whose calls do not match (one skipped a receive hook, or ran another op) would otherwise pair
one rank's publish with another's closing barrier and read stale headers; they all raise
``ZbcclInvalidUsageError`` at that barrier instead, naming each rank's op, and the Buffer refuses
further ops.

Both waits are the op channel's (the Buffer's timeout; a dead peer raises ``ZbcclRemoteError`` within
a liveness interval, a missing one ``ZbcclTimeoutError`` naming it: the ops' own guarantees).

**Leaving an op half-way** (:meth:`Exchange.op`, around every Buffer op): Ctrl-C or an unexpected
exception at any point of the op, or a timeout or lost peer in its barriers, marks this rank's
ABORT line, with the same meaning as the op channel's (``runtime/liveness.py``): peers waiting in
this op's barriers, or in the next op they enter on any communicator, raise ``ZbcclRemoteError``
naming this rank within about a liveness interval, and this rank refuses later ops. The barriers,
ops of the channel, read every member's ABORT line at each liveness interval (``chan.c``
``check_peers``) and mark this rank's with ``WHERE_EP`` when it leaves one half-way. Errors every rank
raises together (bad input, out of memory, ranks out of step) mark nothing: the Buffer stays usable.
"""

from __future__ import annotations

import contextlib
import sys
from array import array
from collections.abc import Iterator
from functools import partial

import torch

from ..errors import ZbcclInvalidUsageError, ZbcclOutOfMemoryError
from ..heap.views import HeapHandle
from ..native.abi import EP_OP_NAMES, WHERE_EP
from ..ops import all_gather_into_tensor
from ..ops.barrier import tagged_barrier
from ..runtime.liveness import leave
from .caps import Capabilities
from .stores import PullStores

__all__ = ["Exchange", "Fail", "F", "HDR_LEN", "PHASE_CLEAN", "heap_empty", "heap_empty_many"]

HDR_LEN = 64
_MSG_AT, _MSG_BYTES = 32, 256
STATUS_OK, STATUS_USAGE, STATUS_NOMEM = 0, 1, 2
#: The phases a tagged barrier (:meth:`Exchange.sync`) can be in.
PHASE_PUBLISH, PHASE_DONE, PHASE_CLEAN = 0, 1, 2
_PHASE_NAMES = {PHASE_PUBLISH: "its publish", PHASE_DONE: "its closing barrier (the receive hook, if any)",
                PHASE_CLEAN: "its barrier"}


class F:
    """Header field indices."""

    OP, SEQ, STATUS, E, H, DTYPE, K, T, META, X, XROW, SCALES, SROW, TOPK, W, HANDLE = range(16)
    FLAGS, TMAX, WORST, NRECV, CHANNELS, XBYTES, NROWS, MASK, SDTYPE = range(16, 25)


class Fail(Exception):
    """A local argument problem, reported through the header so that every rank raises it."""

    def __init__(self, message: str, status: int = STATUS_USAGE) -> None:
        super().__init__(message)
        self.status = status


def _sized(shape, dtype: torch.dtype) -> tuple[tuple[int, ...], int]:
    """``(shape as ints, its bytes in dtype)``."""
    shape = tuple(int(s) for s in shape)
    nbytes = dtype.itemsize
    for s in shape:
        nbytes *= s
    return shape, nbytes


def heap_empty(comm, shape, dtype: torch.dtype, *, fallback: bool = True) -> torch.Tensor:
    """A contiguous tensor in this rank's heap (ordinary memory, counted, if the heap is full and
    ``fallback``; else :class:`ZbcclOutOfMemoryError`). Freed when its last view dies."""
    shape, nbytes = _sized(shape, dtype)
    sma = comm.sma
    offset = sma.try_malloc(max(nbytes, 1), kind="ep")
    if offset is None:
        if not fallback:
            raise ZbcclOutOfMemoryError(f"ep: out of heap memory, expected room for {nbytes} bytes, got a full heap")
        sma.record_fallback(nbytes)
        return torch.empty(shape, dtype=dtype)
    heap = comm.heap
    return heap.view(heap.rank, offset, shape, dtype, release=partial(sma.free, offset), op="ep")


def device_heap_empty(comm, device: str, shape, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous tensor in this rank's ``device`` heap (``"cuda"``), freed when its last view dies; a full heap
    raises :class:`ZbcclOutOfMemoryError` (there is no ordinary device memory to fall back on: the peers read it)."""
    shape, nbytes = _sized(shape, dtype)
    dh = comm.device_heap(device, op="ep")
    offset = dh.sma.try_malloc(max(nbytes, 1), kind="ep")
    if offset is None:
        raise ZbcclOutOfMemoryError(f"ep: out of {device} heap memory, expected room for {nbytes} bytes, got a full "
                                    "heap (init(cuda_heap_size=...) sets its size)")
    heap = dh.heap
    return heap.view(heap.rank, offset, shape, dtype, release=partial(dh.sma.free, offset), op="ep")


def heap_empty_many(comm, specs: list[tuple[tuple, torch.dtype]]) -> list[torch.Tensor]:
    """:func:`heap_empty` of several tensors in one heap block (64-byte aligned parts, one allocation):
    the block is freed when the last view of any part dies."""
    offs, total = _parts(specs)
    return _views(heap_empty(comm, (total,), torch.uint8), offs, specs)


def _parts(specs: list[tuple[tuple, torch.dtype]]) -> tuple[list[tuple[int, int]], int]:
    """``(offset, bytes)`` of each part of a block holding ``specs`` (64-byte aligned) and its size (>= 1)."""
    offs, total = [], 0
    for shape, dtype in specs:
        n = dtype.itemsize
        for d in shape:
            n *= int(d)
        offs.append((total, n))
        total += -(-n // 64) * 64
    return offs, max(total, 1)


def _views(raw: torch.Tensor, offs: list[tuple[int, int]], specs: list[tuple[tuple, torch.dtype]]) -> list[torch.Tensor]:
    return [raw[o:o + n].view(dtype).view(tuple(int(d) for d in shape)) for (o, n), (shape, dtype) in zip(offs, specs)]


_STORAGE_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


def _holders(t: torch.Tensor) -> tuple[int, int] | None:
    """Who holds ``t``'s storage: ``(references to the storage, from tensors viewing it and its Python object,
    references to that Python object)``. A kept ``untyped_storage()`` shows only in the second: torch keeps
    one Python object per storage, which holds one reference however many hold it. None (never reused) when
    this torch does not tell."""
    if _STORAGE_USE_COUNT is None:
        return None
    st = t.untyped_storage()
    return _STORAGE_USE_COUNT(st._cdata), sys.getrefcount(st)


class Exchange:
    """Publish/pull/barrier over one communicator; one per ``Buffer``."""

    def __init__(self, comm, timeout: float | None) -> None:
        self.comm = comm
        self.R, self.me = comm.world_size, comm.rank
        self.timeout = timeout
        #: The native kernels every EP op runs on (raises here, at the Buffer's construction, without them).
        self.caps = Capabilities.of(comm.heap.prims)
        # Two header slots, used by alternate ops: a rank writes slot s of op n + 2 only after op n + 1's
        # barrier, which every peer enters only after it copied op n's headers out of slot s.
        self._hdr = heap_empty(comm, (2, HDR_LEN), torch.int64, fallback=False)
        self._hdr_np = self._hdr.numpy()
        self._all = torch.empty(self.R * HDR_LEN, dtype=torch.int64)
        self._slot = 0
        # The peers' header offsets, once (the Buffer's construction is collective).
        offs = torch.full((self.R,), self.offset_of(self._hdr), dtype=torch.int64)
        all_gather_into_tensor(offs, offs[self.me:self.me + 1].clone(), comm=comm, timeout=timeout)
        self._hdr_off = offs.tolist()
        #: Set once the ranks were found out of step: the Buffer refuses every later op with it.
        self.broken: str | None = None
        self._plan: torch.Tensor | None = None
        self._reuse: dict[str, tuple[torch.Tensor, tuple[int, int] | None]] = {}
        #: Payload bytes this rank copied or read from peers' memory since the last publish.
        self.moved = 0
        #: The store kind of this rank's dispatch pulls, measured (``ep/stores.py``).
        self.stores = PullStores()

    # ------------------------------------------------------------------ local side
    def offset_of(self, t: torch.Tensor) -> int:
        """Heap offset of a contiguous tensor lying in this rank's heap, else -1."""
        if not t.is_contiguous():
            return -1
        return self.comm.heap.offset_of(t)

    def _stage_copy(self, block: torch.Tensor, t: torch.Tensor) -> None:
        """:meth:`place`'s copy into its heap block."""
        block.copy_(t)

    def place(self, t: torch.Tensor, keep: list, role: str, *, copy: bool = False) -> int:
        """Heap offset peers read ``t`` at: in place for a contiguous heap tensor (unless ``copy``:
        the caller may change ``t`` before peers read it), else a staged copy."""
        off = -1 if copy else self.offset_of(t)
        if off >= 0:
            return off
        try:
            block = heap_empty(self.comm, t.shape, t.dtype, fallback=False)
        except ZbcclOutOfMemoryError as exc:
            raise Fail(f"cannot stage the {role} ({t.numel() * t.element_size()} bytes) through the heap: {exc}",
                       STATUS_NOMEM) from None
        self._stage_copy(block, t)
        if t.numel():
            self.comm.sma.record_staged(t.numel() * t.element_size())
        keep.append(block)
        return self.offset_of(block) if t.numel() else 0

    def block(self, values: torch.Tensor, keep: list) -> int:
        """Publish a small int64 plan block (not counted as staging: it is the handshake)."""
        t = heap_empty(self.comm, values.shape, torch.int64, fallback=False)
        t.copy_(values)
        keep.append(t)
        return self.offset_of(t) if t.numel() else 0

    def plan_block(self, n: int) -> torch.Tensor:
        """This rank's reusable int64 plan block of ``n`` entries (grown as needed; one op uses it at a
        time, and each op's closing barrier ends the peers' reads before the next op rewrites it)."""
        if self._plan is None or self._plan.numel() < n:
            self._plan = None
            self._plan = heap_empty(self.comm, (max(n, 1024),), torch.int64, fallback=False)
        return self._plan[:n]

    def reuse(self, role: str, specs: list[tuple[tuple, torch.Tensor]], *, fallback: bool = True) -> list[torch.Tensor]:
        """:func:`heap_empty_many` of ``specs``, in the block this role got last time when its size is the same
        and nothing but this cache holds a view of it any more (the caller dropped the previous outputs, so
        no peer reads them either); saves the allocation and the view set-up of a repeated step. The cache
        keeps one block per role (at most one step's outputs) until the Buffer is destroyed. ``fallback``:
        as :func:`heap_empty`'s."""
        offs, total = _parts(specs)
        hit = self._reuse.get(role)
        if hit is not None and hit[0].numel() == total and hit[1] is not None and _holders(hit[0]) == hit[1]:
            raw = hit[0]
        else:
            self._reuse.pop(role, None)  # an idle block of another size goes back to the heap first
            raw = heap_empty(self.comm, (total,), torch.uint8, fallback=fallback)
            self._reuse[role] = (raw, _holders(raw))
        return _views(raw, offs, specs)

    def drop_reused(self) -> None:
        """Give the cached output blocks of :meth:`reuse` back (those still in use live on with their views)."""
        self._reuse.clear()

    # ------------------------------------------------------------------ the handshake
    @contextlib.contextmanager
    def op(self, name: str) -> Iterator[None]:
        """The boundary of one EP op: an exception that leaves it half-way marks this rank's ABORT line
        (:func:`zbccl.runtime.liveness.leave`; errors every rank raises together mark nothing)."""
        try:
            yield
        except BaseException as exc:
            leave(self.comm._ctx, exc, op=name, where=WHERE_EP)
            raise

    def sync(self, op: str, code: int, seq: int, phase: int) -> None:
        """Collective: a barrier tagged with this rank's op ``code`` (its number ``seq``) and ``phase``; raises
        :class:`ZbcclInvalidUsageError` on every rank when the ranks' tags differ (their calls do not match)."""
        if self.broken:
            raise ZbcclInvalidUsageError(f"{op}: {self.broken}")
        tag = (seq << 10) | (code << 2) | phase
        tags = tagged_barrier(tag, comm=self.comm, timeout=self.timeout)
        if tags is not None:
            where = "; ".join(f"rank {r} in {_describe(t)}" for r, t in enumerate(tags))
            self.broken = (f"the Buffer's ranks went out of step ({where}), expected every rank in the same op and "
                           "phase: every rank must run the same EP ops in the same order and call every receive "
                           "hook; destroy this Buffer")
            raise ZbcclInvalidUsageError(f"{op}: {self.broken}", ranks=tuple(r for r, t in enumerate(tags) if t != tag))

    def publish(self, op: str, fields: dict[int, int], fail: Fail | None) -> torch.Tensor:
        """Collective: every rank's header ``[R, HDR_LEN]`` int64; raises everywhere if any rank failed (and, through
        :meth:`sync`, on a Buffer whose ranks went out of step)."""
        self.moved = 0
        slot, self._slot = self._slot, self._slot ^ 1
        h = self._hdr[slot]
        vals = [0] * HDR_LEN
        for k, v in fields.items():
            vals[k] = int(v)
        self._hdr_np[slot] = vals  # a list into the numpy view: not a tensor build (µs per op)
        if fail is not None:
            h[F.STATUS] = fail.status
            msg = str(fail).encode()[:_MSG_BYTES].ljust(_MSG_BYTES, b"\0")
            h[_MSG_AT:].view(torch.uint8).numpy()[:] = memoryview(msg)
        # The handshake: a barrier (release/acquire), then each peer's header copied out of its heap.
        self.sync(op, int(fields[F.OP]), int(fields[F.SEQ]), PHASE_PUBLISH)
        nbytes = HDR_LEN * 8
        base = self._all.data_ptr()
        table = array("q", [v for r, off in enumerate(self._hdr_off)
                            for v in (base + r * nbytes, self.addr(r, off + slot * nbytes, nbytes), nbytes)])
        self.caps.copy_many(table.buffer_info()[0], self.R, 1)
        rows = self._all.view(self.R, HDR_LEN).clone()
        bad = [r for r, st in enumerate(rows[:, F.STATUS].tolist()) if st != STATUS_OK]
        if bad:
            r = bad[0]
            text = bytes(rows[r, _MSG_AT:].contiguous().view(torch.uint8).tolist()).rstrip(b"\0").decode(errors="replace")
            cls = ZbcclOutOfMemoryError if rows[r, F.STATUS] == STATUS_NOMEM else ZbcclInvalidUsageError
            raise cls(f"{op}: {text} (on rank {r})", ranks=tuple(bad))
        return rows

    def agree(self, op: str, rows: torch.Tensor, fields: tuple) -> None:
        """Raise on every rank unless every header has the same value in each ``(field, what)`` of
        ``fields`` (one vectorised check; the error names the first field and the ranks that differ)."""
        rl = rows.tolist() if isinstance(rows, torch.Tensor) else rows
        if all(r[f] == rl[0][f] for f, _ in fields for r in rl):
            return
        for field, what in fields:
            col = [r[field] for r in rl]
            if all(v == col[0] for v in col):
                continue
            # the value most ranks hold is the expected one; with no strict majority every rank is named
            common = max(set(col), key=col.count)
            if 2 * col.count(common) > len(col):
                odd = [r for r, v in enumerate(col) if v != common]
                got = ", ".join(f"{col[r]} on rank {r}" for r in odd)
                raise ZbcclInvalidUsageError(
                    f"{op}: ranks disagree on {what}, expected {common} (as on the other ranks), got {got}",
                    ranks=tuple(odd))
            got = ", ".join(f"{v} on rank {r}" for r, v in enumerate(col))
            raise ZbcclInvalidUsageError(f"{op}: ranks disagree on {what}, expected one value on every rank, got {got}",
                                         ranks=tuple(range(len(col))))

    def done(self, op: str, fields: dict[int, int]) -> None:
        """Collective: the closing barrier of the op published with ``fields``; after it no peer reads this
        rank's published blocks."""
        self.sync(op, int(fields[F.OP]), int(fields[F.SEQ]), PHASE_DONE)

    # ------------------------------------------------------------------ the peer side
    def addr(self, r: int, offset: int, nbytes: int, op: str = "ep") -> int:
        """Native-core address of ``offset`` in group rank ``r``'s heap (bounds-checked; a rank of this host),
        for the row tables that native code reads (``prims.copy_many``, the EP kernels); ``op`` names errors."""
        return self.comm.heap.addr(self.comm.ranks[r], int(offset), int(nbytes), op=op)

    def view(self, r: int, offset: int, shape, dtype: torch.dtype) -> torch.Tensor:
        """Zero-copy, bounds-checked view of rank ``r``'s published bytes."""
        shape = tuple(int(s) for s in shape)
        stride, acc = [], 1
        for s in reversed(shape):
            stride.append(acc)
            acc *= s
        handle = HeapHandle(rank=self.comm.ranks[r], offset=int(offset), shape=shape, stride=tuple(reversed(stride)),
                            dtype=str(dtype).removeprefix("torch."))
        return self.comm.peer_tensor(r, handle)


def _describe(tag: int) -> str:
    """A tag of :meth:`Exchange.sync` in words."""
    if tag <= 0:
        return "a plain barrier (no EP op)"
    seq, code, phase = tag >> 10, (tag >> 2) & 0xFF, tag & 3
    return f"op #{seq} {EP_OP_NAMES.get(code, f'(code {code})')}, {_PHASE_NAMES.get(phase, f'phase {phase}')}"
