"""Point-to-point send/recv of one process group, straight between heaps.

Synchronisation protocol (Python over the native flag primitives; no new
native code). Each rank that sends owns a *mailbox*, a heap block made on
its first send and published through the group's store; for every peer
``p`` it holds one line ``POSTED[p]`` and a ring of ``DEPTH`` entry lines::

    POSTED[p]     int64: messages this rank posted to p (written by the owner only)
    ENTRY[p][k]   [done int64][waiters int32][pad][seq][offset][nbytes][tag][err][spare]

* **Post** (sender ``s`` -> ``d``, its ``n``-th message to ``d``): entry
  ``k = (n-1) % DEPTH`` is free once ``done >= n - DEPTH``. The sender fills
  ``seq, offset, nbytes, tag`` (offset: where the payload lies in *its own*
  heap), then release-stores ``POSTED[d] = n``.
* **Match** (receiver ``d``): acquire-loads ``POSTED[d]`` of the sender,
  scans the posted entries it has not taken yet, oldest first, and takes the
  first whose tag equals the receive's (per (src, dst, tag) messages match in
  order; different tags may be received in any order). It copies ``nbytes``
  from the sender's heap straight into the receive tensor, then
  release-stores ``done = seq`` in the entry (``err`` first, when the sizes
  disagree: nothing is copied and both sides raise).
* **Complete**: a send of a contiguous heap tensor is zero-copy: it returns
  (or its Work completes) once ``done >= n``, like NCCL. A send of any other
  tensor is staged: copied into a heap block (counted in ``staged_bytes``)
  and complete at once, like gloo; the block is freed once the receiver
  took it.

Receives complete lazily: in their ``wait()``, or during any other wait of
this group (so ``irecv``/``isend`` pairs posted in any order never deadlock).
A blocking ``send`` of a heap tensor waits for its receiver: two ranks that
both send heap tensors to each other before receiving deadlock (as with
NCCL) and get a timeout naming the peer; use ``isend``/``irecv`` or
``batch_isend_irecv``. Every wait applies the one liveness rule
(``runtime/liveness.py``: this rank's finalize, the peers' ABORT lines, dead
peers) at each liveness interval and is bounded by the group's timeout. A wait
left by Ctrl-C or an unexpected exception marks this rank's ABORT line (the
peers name it at once); a timed-out wait does not: the receive is cancelled and
the group stays usable.

Why p2p is not an op of the op channel (as barrier and EP's exchange are): a channel op is collective,
numbered in the one order every member runs; messages match per (src, dst, tag), in any order with
respect to the group's collectives and to each other, so they cannot take the channel's sequence
numbers. What they share with it: the same native flag wait (spin, yield, futex), the same rule
at each liveness interval (``runtime/liveness.py``, the twin of ``chan.c`` ``check_peers``), the
same ABORT line and the same error texts naming the rank.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

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
from ..native.abi import WHERE_P2P
from ..runtime.liveness import leave, waiting, waits_on
from ..runtime.threads import nthreads
from ..runtime.waits import FlagSet, check_peers
from .work import CompletedWork, PendingWork

__all__ = ["PointToPoint", "DEPTH"]

#: Messages one rank may have posted to one peer and not yet taken.
DEPTH = 64
_WORDS = layout.LINE // 8
_PEER_WORDS = (1 + DEPTH) * _WORDS
DONE, SEQ, OFFSET, NBYTES, TAG, ERR = 0, 2, 3, 4, 5, 6
ERR_SIZE = 1
# Wait slice while receives of this group are pending (they progress between slices).
_POLL_NS = 200_000


@dataclass
class _Recv:
    tensor: torch.Tensor
    src: int | None
    tag: int
    work: PendingWork | None = None
    done: bool = False
    error: BaseException | None = None


@dataclass
class _Box:
    """A sender's mailbox as this rank sees it: its words, and their native-core address (for the flag waits)."""

    words: np.ndarray
    addr: int
    taken: set = field(default_factory=set)
    next_seq: int = 1


class PointToPoint:
    """send/recv of one communicator's members (group ranks)."""

    def __init__(self, comm, *, incarnation: int | str = 0) -> None:
        self.comm = comm
        #: Tells this group's mailboxes from an earlier group's on the same communicator (keys).
        self.incarnation = incarnation
        self.ctx = comm._ctx
        self.prims = self.ctx.prims
        self.lock = threading.RLock()
        self.mine: _Box | None = None
        self.block: int | None = None
        self.boxes: dict[int, _Box] = {}
        self.sent = [0] * comm.world_size
        self.pending: list[_Recv] = []
        self.staged: list[tuple[int, int, int]] = []  # (dst, seq, heap block) of staged sends
        self.closed = False
        self._flags: dict[int, FlagSet] = {}

    # ------------------------------------------------------------ mailboxes
    def _key(self, rank: int) -> str:
        return f"p2p/{self.incarnation}/box/{rank}"

    def _own_box(self) -> _Box:
        if self.mine is None:
            nbytes = self.comm.world_size * _PEER_WORDS * 8
            block = self.ctx.sma.malloc(nbytes, kind="p2p")
            heap = self.ctx.heap
            heap.transport.zero(heap.rank, block, nbytes, op="send")
            self.block = block
            self.mine = _Box(_words(heap, heap.rank, block, nbytes), heap.addr(heap.rank, block, nbytes, op="send"))
            self.comm.bootstrap.set(self._key(self.comm.rank), str(block).encode())
        return self.mine

    def _box_of(self, src: int, *, wait: float | None) -> _Box | None:
        """Rank ``src``'s mailbox (None if it never sent and ``wait`` is None)."""
        box = self.boxes.get(src)
        if box is not None:
            return box
        key = self._key(src)
        boot = self.comm.bootstrap
        if wait is None:
            if not boot.store.check([boot._key(key)]):
                return None
            raw = boot.get(key, timeout=1.0, owner=self.comm.ranks[src])
        else:
            raw = boot.get(key, timeout=wait, owner=self.comm.ranks[src], watch=self.comm.store_watch)
        nbytes = self.comm.world_size * _PEER_WORDS * 8
        # The record is sealed (the bootstrap opened it); still parsed strictly, and bounds-checked.
        g, heap = self.comm.ranks[src], self.ctx.heap
        offset = _mailbox_offset(raw, boot._key(key))
        box = self.boxes[src] = _Box(_words(heap, g, offset, nbytes), heap.addr(g, offset, nbytes, op="recv"))
        return box

    # ------------------------------------------------------------ send
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> CompletedWork:
        t = _one(tensors, "send")
        self._check_broken("send")
        self._check_peer(dst, "send")
        with self.lock:
            self._reap()
            box = self._own_box()
            seq = self.sent[dst] + 1
            base = dst * _PEER_WORDS + (1 + (seq - 1) % DEPTH) * _WORDS
            if seq > DEPTH:
                self._wait_word(box.addr + base * 8, seq - DEPTH, dst, op=f"send(dst={dst}, tag={tag})",
                                why="the receiver to take older messages")
            nbytes = t.numel() * t.element_size()
            offset, block = self._source(t, nbytes)
            w = box.words
            w[base + ERR] = 0
            w[base + SEQ], w[base + OFFSET], w[base + NBYTES], w[base + TAG] = seq, offset, nbytes, tag
            self.sent[dst] = seq
            self.prims.signal(box.addr + dst * _PEER_WORDS * 8, seq)
            if block is not None:
                self.staged.append((dst, seq, block))
                return CompletedWork([t])
        done_addr = box.addr + base * 8
        op = f"send(dst={dst}, tag={tag})"

        def step(timeout: float | None) -> bool:
            if timeout is None:
                if self.prims.load_acquire(done_addr) < seq:
                    self.progress()
                    return False
            else:
                self._wait_word(done_addr, seq, dst, op=op, timeout=timeout,
                                why="a matching recv (a blocking send of a heap tensor waits for its receiver)")
            if w[base + ERR] == ERR_SIZE:
                raise ZbcclInvalidUsageError(
                    f"{op}: rank {dst} posted a recv of another size, expected {nbytes} bytes on both sides",
                    ranks=(dst,))
            return True

        return PendingWork([t], step, default_timeout=self.ctx.timeout)

    def _source(self, t: torch.Tensor, nbytes: int) -> tuple[int, int | None]:
        """``(offset in my heap, staging block or None)`` of the payload."""
        heap = self.ctx.heap
        if t.is_contiguous():
            off = t.data_ptr() - heap.heap_base
            if 0 <= off and off + nbytes <= heap.heap_bytes:
                return off, None
        block = self.ctx.sma.try_malloc(max(nbytes, 1), kind="staging")
        if block is None:
            raise ZbcclOutOfMemoryError(
                f"send: the heap cannot stage a {nbytes}-byte tensor, expected a heap tensor or a larger heap")
        if nbytes:
            src = t.contiguous()
            self.prims.copy(heap.heap_base + block, src.data_ptr(), nbytes, nthreads())
            self.ctx.sma.record_staged(nbytes)
        return block, block

    def _reap(self) -> None:
        """Free the staging blocks of sends their receivers took."""
        keep = []
        for dst, seq, block in self.staged:
            base = dst * _PEER_WORDS + (1 + (seq - 1) % DEPTH) * _WORDS
            if self.mine is not None and self.prims.load_acquire(self.mine.addr + base * 8) >= seq:
                self.ctx.sma.free(block)
            else:
                keep.append((dst, seq, block))
        self.staged = keep

    # ------------------------------------------------------------ recv
    def recv(self, tensors: list[torch.Tensor], src: int | None, tag: int) -> PendingWork:
        t = _one(tensors, "recv")
        self._check_broken("recv")
        if src is not None:
            self._check_peer(src, "recv")
        rec = _Recv(t, src, tag)

        def step(timeout: float | None) -> bool:
            return self._complete(rec, timeout)

        rec.work = PendingWork([t], step, default_timeout=self.ctx.timeout)
        with self.lock:
            self.pending.append(rec)
            self.progress()
        return rec.work

    def progress(self) -> bool:
        """Take every message a pending recv matches (never blocks); True if any completed."""
        moved = False
        with self.lock:
            for rec in list(self.pending):
                srcs = [rec.src] if rec.src is not None else [r for r in range(self.comm.world_size)
                                                                 if r != self.comm.rank]
                for s in srcs:
                    box = self._box_of(s, wait=None)
                    if box is not None and self._match(rec, s, box):
                        moved = True
                        break
            self.pending = [r for r in self.pending if not r.done]
        return moved

    def _match(self, rec: _Recv, s: int, box: _Box) -> bool:
        me = self.comm.rank
        posted = self.prims.load_acquire(box.addr + me * _PEER_WORDS * 8)
        for seq in range(box.next_seq, posted + 1):
            if seq in box.taken:
                continue
            base = me * _PEER_WORDS + (1 + (seq - 1) % DEPTH) * _WORDS
            w = box.words
            if int(w[base + SEQ]) != seq or int(w[base + TAG]) != rec.tag:
                continue
            self._take(rec, s, box, base, seq)
            return True
        return False

    def _take(self, rec: _Recv, s: int, box: _Box, base: int, seq: int) -> None:
        w, t = box.words, rec.tensor
        nbytes = t.numel() * t.element_size()
        if int(w[base + NBYTES]) != nbytes:
            rec.error = ZbcclInvalidUsageError(
                f"recv(src={s}, tag={rec.tag}): size mismatch, expected {nbytes} bytes, got a {int(w[base + NBYTES])}"
                f"-byte message from rank {s}", ranks=(s,))
            w[base + ERR] = ERR_SIZE
        elif nbytes:
            src_addr = self.ctx.heap.addr(self.comm.ranks[s], int(w[base + OFFSET]), nbytes, op="recv")
            dst = t if t.is_contiguous() else torch.empty_like(t, memory_format=torch.contiguous_format)
            self.prims.copy(dst.data_ptr(), src_addr, nbytes, nthreads())
            if dst is not t:
                t.copy_(dst)
                self.ctx.sma.record_staged(nbytes)
        self.prims.signal(box.addr + base * 8, seq)
        box.taken.add(seq)
        while box.next_seq in box.taken:
            box.taken.discard(box.next_seq)
            box.next_seq += 1
        rec.done = True
        if rec.work is not None:
            rec.work._source = s

    def _complete(self, rec: _Recv, timeout: float | None) -> bool:
        if not rec.done:
            self.progress()
        if not rec.done and timeout is not None:
            try:
                self._wait_recv(rec, timeout)
            except BaseException as exc:
                with self.lock:  # cancelled: a later message must not land in this tensor
                    if not rec.done:
                        self.pending = [r for r in self.pending if r is not rec]
                self._left(exc, "recv")
                raise
        if rec.error is not None:
            raise rec.error
        return rec.done

    def _wait_recv(self, rec: _Recv, timeout: float) -> None:
        on = None if rec.src is None else self.comm.ranks[rec.src]
        waiting(self.ctx, on)
        try:
            self._wait_recv_until(rec, timeout)
        except ZbcclError as exc:  # stays set: a peer waiting on this rank reads why (waits_on)
            waiting(self.ctx, on, ended=1 if isinstance(exc, ZbcclTimeoutError) else 2)
            raise
        except BaseException:
            waiting(self.ctx, None)
            raise
        waiting(self.ctx, None)

    def _timeout(self, text: str, peer: int | None) -> ZbcclTimeoutError:
        """A p2p wait's timeout: ``text``, and when ``peer`` (group rank) itself waits for another rank in a
        send/recv (or gave up on it), that chain and its last rank (:func:`.liveness.waits_on`)."""
        ranks = self.comm.ranks
        more, last = ("", None) if peer is None else waits_on(
            self.ctx, ranks[peer], lambda g: ranks.index(g) if g in ranks else f"{g} (world)")
        return ZbcclTimeoutError(text + more, ranks=(peer,) if last is None else (peer, last))

    def _wait_recv_until(self, rec: _Recv, timeout: float) -> None:
        op = f"recv(src={'any' if rec.src is None else rec.src}, tag={rec.tag})"
        deadline = time.monotonic() + timeout
        peers = [rec.src] if rec.src is not None else [r for r in range(self.comm.world_size) if r != self.comm.rank]
        while not rec.done:
            left = deadline - time.monotonic()
            if left <= 0:
                if rec.src is not None:
                    raise self._timeout(f"{op}: timed out after {timeout:.1f}s, expected a matching message from "
                                        f"rank(s) {peers}, got none", rec.src)
                raise ZbcclTimeoutError(
                    f"{op}: timed out after {timeout:.1f}s, expected a matching message from rank(s) {peers}, "
                    "got none", ranks=tuple(peers))
            box = self._box_of(rec.src, wait=None) if rec.src is not None else None
            if box is not None:  # sleep on the sender's POSTED line until it posts again
                addr = box.addr + self.comm.rank * _PEER_WORDS * 8
                posted = self.prims.load_acquire(addr)
                if self.progress() and rec.done:  # posted before this box was first seen: no wait
                    break
                self.prims.wait_ge(self._ptr(addr), 1, posted + 1, self.ctx.spin,
                                   min(self.ctx.liveness_ns, int(left * 1e9)))
            else:  # any source, or a sender that never sent: poll
                time.sleep(_POLL_NS / 1e9)
            self.progress()
            if rec.done:  # a message posted before its sender finalized (or died) still counts
                break
            try:
                self._check_alive(peers, op)
            except ZbcclRemoteError:  # it may have posted after the progress above and then left: look again
                self.progress()
                if rec.done:
                    break
                raise

    # ------------------------------------------------------------ waits
    def _wait_word(self, addr: int, target: int, peer: int, *, op: str, why: str,
                   timeout: float | None = None) -> None:
        """Block until the int64 at ``addr`` is >= ``target``, progressing pending recvs meanwhile."""
        timeout = self.ctx.timeout if timeout is None else timeout
        on = self.comm.ranks[peer]
        waiting(self.ctx, on)
        try:
            self._wait_word_until(addr, target, peer, op=op, why=why, timeout=timeout)
        except BaseException as exc:
            if isinstance(exc, ZbcclError):  # stays set: a peer waiting on this rank reads why (waits_on)
                waiting(self.ctx, on, ended=1 if isinstance(exc, ZbcclTimeoutError) else 2)
            else:
                waiting(self.ctx, None)
            self._left(exc, op)
            raise
        waiting(self.ctx, None)

    def _left(self, exc: BaseException, op: str) -> None:
        """A wait is left by ``exc``: Ctrl-C, an unexpected exception or a lost peer marks this rank's ABORT
        line (a lost peer: ``ABORT_PEER``, with the rank it lost, so that a rank waiting on this one names
        both within a liveness interval); a timeout or another ZbcclError does not (the wait is cancelled)."""
        if not isinstance(exc, ZbcclError) or isinstance(exc, ZbcclRemoteError):
            leave(self.ctx, exc, op=op, where=WHERE_P2P)

    def _wait_word_until(self, addr: int, target: int, peer: int, *, op: str, why: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        ptr = self._ptr(addr)
        while True:
            slice_ns = _POLL_NS if self.pending else self.ctx.liveness_ns
            if self.prims.wait_ge(ptr, 1, target, self.ctx.spin, slice_ns) < 0:
                return
            if self.pending:
                self.progress()
            self._check_alive([peer], op)
            if time.monotonic() > deadline:
                raise self._timeout(f"{op}: timed out after {timeout:.1f}s waiting for rank {peer}: expected "
                                    f"{why}, got none", peer)

    def _ptr(self, addr: int) -> int:
        """Address of a one-element address array for ``prims.wait_ge`` (kept per flag)."""
        flags = self._flags.get(addr)
        if flags is None:
            flags = self._flags[addr] = FlagSet([0], [addr])
        return flags.ptr

    def _check_alive(self, peers: list[int], op: str) -> None:
        if self.closed and not self.ctx.finalized:  # this rank's finalize: the rule's own text (check, below)
            raise ZbcclInvalidUsageError(f"{op}: the process group was shut down while the op waited")
        ranks = [self.comm.ranks[p] for p in peers]
        check_peers(self.ctx, ranks, op=op, labels={g: p for p, g in enumerate(self.comm.ranks)})

    def _check_broken(self, op: str) -> None:
        if self.ctx.left is not None:  # this rank left an op half-way (runtime/liveness.py)
            raise ZbcclInvalidUsageError(f"{op}: this communicator is broken on rank {self.comm.rank}: "
                                         f"{self.ctx.left}; finalize and init again", ranks=(self.comm.rank,))

    def _check_peer(self, peer: int, op: str) -> None:
        W = self.comm.world_size
        if not isinstance(peer, int) or not 0 <= peer < W:
            raise ZbcclInvalidUsageError(f"{op}: peer rank out of range, expected [0, {W}), got {peer}")
        if peer == self.comm.rank:
            raise ZbcclInvalidUsageError(f"{op}: peer is this rank, expected another rank, got {peer}")

    def close(self) -> None:
        """Drop the mailbox and staging blocks (no peer may still take a message from them)."""
        with self.lock:
            self.closed = True
            if self.ctx.finalized:
                return
            for _, _, block in self.staged:
                self.ctx.sma.free(block)
            self.staged = []
            if self.block is not None:
                self.ctx.sma.free(self.block)
                self.block, self.mine = None, None


def _mailbox_offset(raw: bytes, key: str) -> int:
    """A mailbox's heap offset as announced: decimal digits of a line-aligned offset, nothing else."""
    text = bytes(raw)
    if not (0 < len(text) <= 20 and text.isdigit()) or int(text) % layout.LINE:
        raise ZbcclRemoteError(f"recv: malformed mailbox record under '{key}', expected a {layout.LINE}-byte "
                               f"aligned heap offset, got {text[:40]!r}")
    return int(text)


def _words(heap, rank: int, offset: int, nbytes: int) -> np.ndarray:
    """Global rank ``rank``'s mailbox words: an int64 view through the heap's transport."""
    return heap.view(rank, offset, (nbytes // 8,), torch.int64, op="recv").numpy()


def _one(tensors: list[torch.Tensor], op: str) -> torch.Tensor:
    if len(tensors) != 1 or not isinstance(tensors[0], torch.Tensor):
        raise ZbcclInvalidUsageError(f"{op}: expected one tensor, got {len(tensors)}")
    t = tensors[0]
    if t.device.type != "cpu":
        raise ZbcclInvalidUsageError(f"{op}: expected a CPU tensor, got device {t.device}")
    return t
