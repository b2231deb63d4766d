"""The control plane of a ``Buffer`` whose group spans hosts: rounds through the transport verbs only.

A group that spans hosts has no op channel (a remote rank's memory cannot be viewed), so EP's
handshake runs on the verbs every transport has: ``put``, ``signal``, ``load`` (``docs/ep-internode.md``).
Memory, per group rank, allocated at the Buffer's construction:

* an **inbox** in its heap: ``[2, R, W]`` int64, two halves of one header slot per source rank;
* an **aux** block in its heap: ``AUX`` int64 words a forwarder fills during a dispatch (the op's
  header round, a status word and the heap offset of each sender's staged rows);
* signal words in its own pad, on lines of the Buffer's private communicator's comm slot (that slot's
  op channel never exists when the group spans hosts, so nothing else writes them): ``LOCAL`` (line 0)
  and ``FORWARD`` (line 1), written by this rank; ``ARRIVE[i]`` (line 2 + i), written by rank ``i``;
  ``FORWARDED[f]`` (line 2 + R + f, with an offset word 16 bytes in), written by forwarder ``f``.
  Hence at most ``MAX_RANKS`` ranks.

The inbox and aux offsets go through the store once (the communicator's bootstrap all_gather),
are parsed strictly, and are checked against each peer's live heap size as the transport reports
it: nothing read from the store is trusted.

Protocol of round ``k`` (``k`` = 1, 2, ... on every member, in the same order):

1. with a header: put it into slot ``me`` of half ``k % 2`` of every peer's inbox (complete when
   the call returns: a remote write has landed, a local one is a plain store);
2. signal ``ARRIVE[me] = k`` in every peer's pad (ordered after the put);
3. wait until this rank's own ``ARRIVE[p] >= k`` for every peer ``p``: local words, polled without a
   network round trip (:meth:`HostWire.wait_own`), the writers' liveness checked every liveness interval
   (a dead writer is a ``ZbcclRemoteError``, a silent host a ``ZbcclTimeoutError`` naming it, a late one
   a ``ZbcclTimeoutError`` naming the missing ranks);
4. with a header: copy half ``k % 2`` out.

A peer can be at most one round ahead (round ``k + 1`` needs this rank's ``ARRIVE >= k + 1``, which
it stores only after copying round ``k`` out), so it writes only the other half.

A dispatch's forwarder records its staging in its aux block and signals its own ``FORWARD = k``
(``k`` the op's header round); this host's ranks wait on that word (shm). A combine's forwarder pushes
each sender the offset of its sums and ``FORWARDED[f] = k``. Normal ops keep their blocks until the
next header round instead of ending with a round (:meth:`HostWire.hold`); combine ends with a barrier
of this host's ranks (``LOCAL``), a receive hook with a plain round.
"""

from __future__ import annotations

import contextlib
import os
import struct
import time
from collections.abc import Iterator

import torch

from .. import env
from ..errors import ZbcclInvalidUsageError, ZbcclOutOfMemoryError, ZbcclRemoteError, ZbcclTimeoutError
from ..heap import layout
from ..native.abi import WHERE_EP
from ..runtime import liveness
from ..runtime.liveness import leave
from .caps import Capabilities
from .exchange import (
    _MSG_AT,
    _MSG_BYTES,
    HDR_LEN,
    STATUS_NOMEM,
    STATUS_OK,
    Exchange,
    F,
    Fail,
    heap_empty,
    heap_empty_many,
)

__all__ = ["HostWire", "spans_hosts", "AUX_ROUND", "AUX_STATUS", "AUX_OFFS", "NO_ROOM", "FAILED"]

#: Aux words: the round the forwarder staged for, its status (0: ok), then one heap offset per rank.
AUX_ROUND, AUX_STATUS, AUX_OFFS = 0, 1, 2
#: Lines of the comm slot: LOCAL, FORWARD, then ARRIVE[i] (2 + i) and FORWARDED[f] (2 + R + f, its offset word
#: 16 bytes in): at most ``MAX_RANKS`` ranks.
_L_LOCAL, _L_FORWARD = 0, 1
_LINES = layout.SLOT_BYTES // layout.LINE
MAX_RANKS = (_LINES - 2) // 2
_OFFSET_WORD = 16
#: What a forwarder posts instead of an offset or a status when it could not stage: its heap is full (``NO_ROOM``,
#: also the aux status ``STATUS_NOMEM``), or it failed otherwise (``FAILED``: a dead peer, an interrupt).
NO_ROOM, FAILED = -1, -2
_SPIN_S, _MAX_PAUSE_S = 50e-6, 1e-3
_RECORD = struct.Struct("<4q")


def spans_hosts(comm) -> bool:
    """Whether some member of ``comm`` is on another host (its heap cannot be viewed here)."""
    heap = comm.heap
    return not all(heap.reachable(g) for g in comm.ranks)


class HostWire:
    """Rounds (header all_gather, barrier) and the forwarding geometry of one spanning group."""

    def __init__(self, comm, timeout: float | None) -> None:
        self.comm, self.R, self.me = comm, comm.world_size, comm.rank
        if self.R > MAX_RANKS:
            raise ZbcclInvalidUsageError(f"Buffer: too many ranks for EP across hosts, expected at most {MAX_RANKS}, "
                                         f"got {self.R}")
        self.timeout = comm.timeout if timeout is None else float(timeout)
        self.t = comm.heap.transport
        self.g = list(comm.ranks)
        self.labels = {g: i for i, g in enumerate(self.g)}
        topo = comm.topology
        by_host: dict[int, list[int]] = {}
        for i, g in enumerate(self.g):
            by_host.setdefault(topo.host_of(g), []).append(i)
        #: Group ranks per host (hosts ordered by their lowest group rank), and each rank's host and index there.
        self.hosts = sorted(by_host.values())
        self.H = len(self.hosts)
        self.host_of, self.local_index = [0] * self.R, [0] * self.R
        for h, ranks in enumerate(self.hosts):
            for j, r in enumerate(ranks):
                self.host_of[r], self.local_index[r] = h, j
        self.my_host = self.host_of[self.me]
        self.hostnames = [topo.infos[self.g[rs[0]]].hostname for rs in self.hosts]
        #: The native kernels of this rank's own steps (layout); raises here without them.
        self.caps = Capabilities.of(comm.heap.prims)
        self.W = HDR_LEN + 4 * self.R + 4 * self.H
        self.AUX = AUX_OFFS + self.R
        self._inbox = heap_empty(comm, (2, self.R, self.W), torch.int64, fallback=False)
        self._inbox.zero_()
        self._aux = heap_empty(comm, (self.AUX,), torch.int64, fallback=False)
        self._aux.fill_(-1)
        self.inbox_off, self.aux_off = self._exchange_offsets()
        self.round = 0
        #: The blocks peers may still read from this rank's last normal-mode op (send blocks, staging): dropped at
        #: the end of the next header round, which every peer enters only after it finished that op.
        self._held: list = []
        #: Set once the ranks were found out of step: every later op raises it.
        self.broken: str | None = None
        #: Payload bytes this rank read from or wrote to peers in its last op (DeepEP-style rows, not the handshake).
        self.moved = 0
        #: Payload bytes of the last op that crossed to or from another host through this rank (rows, scales,
        #: top-k and the per-token routing words), and the forwarding staging it held (see ``Buffer.memory_stats``).
        self.stats = {"rdma_send_bytes": 0, "rdma_recv_bytes": 0, "nvl_bytes": 0, "rdma_peak_bytes": 0}

    # ------------------------------------------------------------------ geometry
    def forwarder(self, src: int, host: int) -> int:
        """The rank of ``host`` that receives ``src``'s rows for that host: the one with ``src``'s local index
        (modulo the host's size), so the forwarding load spreads over the host's ranks."""
        ranks = self.hosts[host]
        return ranks[self.local_index[src] % len(ranks)]

    def line(self, which: int) -> int:
        """Byte offset in the pad of line ``which`` of this communicator's comm slot."""
        return layout.slot_line(self.comm.slot, which)

    def _arrive(self, src: int) -> int:
        return self.line(2 + src)

    def _forwarded(self, fwd: int) -> int:
        return self.line(2 + self.R + fwd)

    def _exchange_offsets(self) -> tuple[list[int], list[int]]:
        """Every member's inbox and aux offsets, through the store, checked against its live heap size."""
        mine = _RECORD.pack(self.offset_of(self._inbox), self._inbox.numel() * 8, self.offset_of(self._aux),
                            self._aux.numel() * 8)
        got = self.comm.bootstrap.all_gather(mine, timeout=self.timeout, tag="ep-wire",
                                             watch=self.comm.store_watch)
        inbox, aux = [], []
        for r, raw in enumerate(got):
            if not isinstance(raw, (bytes, bytearray)) or len(raw) != _RECORD.size:
                raise ZbcclRemoteError(f"Buffer: rank {r}'s EP record is malformed, expected {_RECORD.size} bytes, "
                                       f"got {len(raw) if isinstance(raw, (bytes, bytearray)) else type(raw).__name__}",
                                       ranks=(r,))
            ioff, ibytes, aoff, abytes = _RECORD.unpack(raw)
            size = self.t.size(self.g[r])
            want = (2 * self.R * self.W * 8, self.AUX * 8)
            if (ibytes, abytes) != want or min(ioff, aoff) < 0 or ioff % 8 or aoff % 8 \
                    or ioff + ibytes > size or aoff + abytes > size:
                raise ZbcclRemoteError(
                    f"Buffer: rank {r}'s EP record is out of its heap, expected an inbox of {want[0]} and an aux block "
                    f"of {want[1]} bytes within its {size} heap bytes, got inbox {ibytes} bytes at {ioff} and aux "
                    f"{abytes} bytes at {aoff}", ranks=(r,))
            inbox.append(ioff)
            aux.append(aoff)
        return inbox, aux

    # ------------------------------------------------------------------ local memory
    def offset_of(self, t: torch.Tensor) -> int:
        return self.comm.heap.offset_of(t) if t.is_contiguous() else -1

    def heap_block(self, nbytes: int, role: str) -> torch.Tensor:
        """A uint8 heap block peers read (never ordinary memory: a peer must reach it)."""
        try:
            return heap_empty(self.comm, (max(int(nbytes), 1),), torch.uint8, fallback=False)
        except ZbcclOutOfMemoryError as exc:
            raise Fail(f"cannot hold the {role} ({nbytes} bytes) in the heap: {exc}", STATUS_NOMEM) from None

    def reuse(self, role: str, specs: list) -> list[torch.Tensor]:
        """Exact-size outputs in one heap block (``Exchange.reuse``'s signature; no cache across hosts)."""
        return heap_empty_many(self.comm, specs)

    def drop_reused(self) -> None:
        """Nothing cached (see :meth:`reuse`)."""

    def view(self, r: int, offset: int, nbytes: int, op: str) -> torch.Tensor:
        """uint8 view of group rank ``r``'s heap (a rank of this host), bounds-checked by the transport."""
        return self.t.view(self.g[r], int(offset), (int(nbytes),), torch.uint8, op=op)

    def read(self, r: int, offset: int, nbytes: int, op: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """``nbytes`` of group rank ``r``'s heap at ``offset``: a view for a rank of this host, else a copy
        (``out``, uint8, or a fresh tensor) read through the transport. Checked against ``r``'s live heap first."""
        try:
            size = self.t.size(self.g[r])
        except (ZbcclRemoteError, ZbcclTimeoutError) as exc:
            self._named(exc, self._of(exc, r))
        if offset < 0 or nbytes < 0 or offset + nbytes > size:
            raise ZbcclRemoteError(
                f"{op}: rank {r} published a block out of its heap, expected [offset, offset+nbytes) within "
                f"[0, {size}), got offset={offset} nbytes={nbytes}", ranks=(r,))
        if self.t.viewable(self.g[r]):
            return self.view(r, offset, nbytes, op)
        dst = torch.empty(nbytes, dtype=torch.uint8) if out is None else out
        if nbytes:
            try:
                self.t.get_into(self.g[r], int(offset), dst, op=op)
            except (ZbcclRemoteError, ZbcclTimeoutError) as exc:
                self._named(exc, self._of(exc, r))
        return dst

    # ------------------------------------------------------------------ rounds
    @contextlib.contextmanager
    def op(self, name: str) -> Iterator[None]:
        """The boundary of one EP op (as ``Exchange.op``): leaving it half-way marks this rank's ABORT line."""
        try:
            yield
        except BaseException as exc:
            leave(self.comm._ctx, exc, op=name, where=WHERE_EP)
            raise

    def _round(self, vec: torch.Tensor | None, op: str) -> torch.Tensor | None:
        """One round (see the module docstring); returns ``[R, W]`` (the headers) when ``vec`` is given."""
        if self.broken:
            raise ZbcclInvalidUsageError(f"{op}: {self.broken}")
        self.round += 1
        k, half, me = self.round, self.round & 1, self.me
        if vec is not None:
            self._inbox[half, me] = vec
            at = (half * self.R + me) * self.W * 8
            for p in range(self.R):
                if p != me:
                    try:
                        self.t.put(self.g[p], self.inbox_off[p] + at, vec, op=op)
                    except (ZbcclRemoteError, ZbcclTimeoutError) as exc:  # its ranks are global ranks
                        self._named(exc, self._of(exc, p))
        peers = [p for p in range(self.R) if p != me]
        for p in peers:  # after the put: a signal is ordered after this process's earlier writes to that peer
            self._signal(p, self._arrive(me), k, op)
        self.wait_own({p: self._arrive(p) for p in peers}, k, op)
        return self._inbox[half].clone() if vec is not None else None

    def wait(self, ranks: list[int], line: int, target: int, op: str) -> None:
        """Wait until the word at ``line`` of every group rank of ``ranks`` is ``>= target``; an error names the
        ranks it is about and their hosts (a dead rank: ``ZbcclRemoteError``; a silent host or a late rank:
        ``ZbcclTimeoutError``)."""
        if not ranks:
            return
        try:
            self.t.wait_until([(self.g[r], line) for r in ranks], target, timeout=self.timeout, op=op,
                              labels=self.labels)
        except (ZbcclRemoteError, ZbcclTimeoutError) as exc:
            self._named(exc, [r for r in exc.ranks if isinstance(r, int) and 0 <= r < self.R] or list(ranks))

    def _signal(self, r: int, line: int, value: int, op: str) -> None:
        try:
            self.t.signal(self.g[r], line, value)
        except (ZbcclRemoteError, ZbcclTimeoutError) as exc:
            self._named(exc, self._of(exc, r))

    def wait_own(self, lines: dict[int, int], target: int, op: str) -> None:
        """Wait until each word of this rank's pad in ``lines`` (group rank of its writer -> line) is ``>= target``.

        The words are local, so a poll costs no network round trip; the writers' liveness is checked every
        ``liveness`` interval (a dead writer: ``ZbcclRemoteError``; its host silent for the transport's stall
        time: ``ZbcclTimeoutError``; naming the ranks and their hosts), and after ``timeout`` seconds a
        ``ZbcclTimeoutError`` names the writers whose word never came."""
        me, load = self.g[self.me], self.t.load
        pending = [r for r, ln in lines.items() if load(me, ln) < target]
        if not pending:
            return
        start = time.monotonic()
        live = max(env.LIVENESS_INTERVAL.get(), 0.05)
        deadline, next_live, pause = start + self.timeout, start + live, 0.0
        while pending:
            now = time.monotonic()
            if now >= next_live:
                self._check_writers(pending, op)
                next_live = now + live
            if now >= deadline:
                got = ", ".join(f"{load(me, lines[r])} from rank {r}" for r in pending)
                raise self._lost(ZbcclTimeoutError,
                                 f"{op}: timed out after {self.timeout:.1f}s waiting for ranks {pending}, expected their "
                                 f"signal >= {target}, got {got} ({'; '.join(self.where(r) for r in pending)})", pending)
            if now - start < _SPIN_S:
                os.sched_yield()
            else:
                pause = min(2 * pause or 10e-6, _MAX_PAUSE_S)
                time.sleep(pause)
            pending = [r for r in pending if load(me, lines[r]) < target]

    def _check_writers(self, ranks: list[int], op: str) -> None:
        """Raise if one of ``ranks`` died or its host stopped answering."""
        glob = {self.g[r]: r for r in ranks}
        dead = sorted(glob[g] for g in self.t.dead_peers() if g in glob)
        if dead:
            raise self._lost(ZbcclRemoteError, f"{op}: peer lost while waiting: rank(s) {dead} died "
                             f"({'; '.join(self.where(r) for r in dead)})", dead)
        remote = getattr(self.t, "remote", self.t)
        gone_of = getattr(remote, "unreachable_peers", None)
        gone = sorted(glob[g] for g in (gone_of() if gone_of is not None else []) if g in glob)
        if gone:
            raise self._lost(ZbcclTimeoutError, f"{op}: host unreachable while waiting for rank(s) {gone} "
                             f"({'; '.join(self.where(r) for r in gone)})", gone)
        # The rule on the writers of this host: one that left an op half-way (its ABORT line: it may have left
        # because of a host it lost, which then comes first in the error), failed, finalized or died.
        liveness.check(self.comm._ctx, list(glob), op=op, pending=list(glob), labels=self.labels)

    def _of(self, exc: ZbcclRemoteError | ZbcclTimeoutError, r: int) -> list[int]:
        """The group ranks of a transport error (its ranks are global ranks), else ``[r]``."""
        return [self.labels[g] for g in exc.ranks if g in self.labels] or [r]

    def _named(self, exc: ZbcclRemoteError | ZbcclTimeoutError, ranks: list[int]):
        """Raise ``exc`` again, naming the group ranks it is about and their hosts."""
        raise self._lost(type(exc), f"{exc} ({'; '.join(self.where(r) for r in ranks)})", ranks) from None

    def _lost(self, cls, text: str, ranks) -> ZbcclRemoteError | ZbcclTimeoutError:
        """``cls(text)`` about group ranks ``ranks``, carrying the first one's world rank (``via``): when this rank
        leaves the op because of it, its ABORT line names it, so a rank waiting on this one names the first
        cause (``runtime/chain.py``)."""
        err = cls(text, ranks=tuple(ranks))
        if ranks:
            err.via = self.g[ranks[0]]
        return err

    def where(self, r: int) -> str:
        """Group rank ``r`` and its host, in words (with the address Mooncake reaches it at, for a remote one)."""
        h = self.host_of[r]
        peers = getattr(getattr(self.t, "remote", self.t), "peers", {})
        peer = peers.get(self.g[r]) if isinstance(peers, dict) else None
        addr = f" at {peer.ip}" if peer is not None and getattr(peer, "ip", None) else ""
        return f"rank {r} on host {h} ({self.hostnames[h]}{addr})"

    def hold(self, blocks: list) -> None:
        """Keep ``blocks`` alive until the next header round (see ``_held``)."""
        self._held = list(blocks)

    def local_barrier(self, header_round: int, op: str) -> None:
        """Collective over this host's ranks of the group: after it, none of them reads this rank's blocks of the op
        whose header round is ``header_round`` (shm words only: no network round trip)."""
        line = self.line(_L_LOCAL)
        self.t.signal(self.g[self.me], line, header_round)
        self.wait([r for r in self.hosts[self.my_host] if r != self.me], line, header_round, op)

    def barrier(self, op: str) -> None:
        """Collective: a plain round."""
        self._round(None, op)

    def publish(self, op: str, fields: dict[int, int], vector: list[int], fail: Fail | None) -> torch.Tensor:
        """Collective: every rank's header ``[R, W]`` int64 (fields, then ``vector`` from word ``HDR_LEN``); raises
        on every rank if any rank failed, or when the ranks run different ops."""
        self.moved = 0
        vals = [0] * self.W
        for key, v in fields.items():
            vals[key] = int(v)
        if len(vector) > self.W - HDR_LEN:
            raise AssertionError("header vector too long")  # internal: sized at construction
        vals[HDR_LEN:HDR_LEN + len(vector)] = [int(v) for v in vector]
        h = torch.tensor(vals, dtype=torch.int64)
        if fail is not None:
            h[F.STATUS] = fail.status
            msg = str(fail).encode()[:_MSG_BYTES].ljust(_MSG_BYTES, b"\0")
            h[_MSG_AT:HDR_LEN].view(torch.uint8).numpy()[:] = memoryview(msg)
        rows = self._round(h, op)
        self._held = []  # every peer entered this round, so it finished reading the previous op's blocks
        bad = [r for r, st in enumerate(rows[:, F.STATUS].tolist()) if st != STATUS_OK]
        if bad:
            r = bad[0]
            text = bytes(rows[r, _MSG_AT:HDR_LEN].contiguous().view(torch.uint8).tolist()).rstrip(b"\0")
            cls = ZbcclOutOfMemoryError if rows[r, F.STATUS] == STATUS_NOMEM else ZbcclInvalidUsageError
            raise cls(f"{op}: {text.decode(errors='replace')} (on rank {r})", ranks=tuple(bad))
        tags = list(zip(rows[:, F.OP].tolist(), rows[:, F.SEQ].tolist()))
        if any(t != tags[0] for t in tags):
            from ..native.abi import EP_OP_NAMES

            where = "; ".join(f"rank {r} in op #{s} {EP_OP_NAMES.get(o, o)}" for r, (o, s) in enumerate(tags))
            self.broken = (f"the Buffer's ranks went out of step ({where}), expected every rank in the same op: every "
                           "rank must run the same EP ops in the same order and call every receive hook; destroy "
                           "this Buffer")
            raise ZbcclInvalidUsageError(f"{op}: {self.broken}", ranks=tuple(range(self.R)))
        return rows

    agree = Exchange.agree
    place = Exchange.place

    def sync(self, op: str, code: int, seq: int, phase: int) -> None:
        """``Exchange.sync``'s signature: a header round carrying the op's tag (``clean_low_latency_buffer``)."""
        self.publish(op, {F.OP: code, F.SEQ: seq}, [], None)

    # ------------------------------------------------------------------ forwarding
    def post_forward(self, header_round: int, offsets: dict[int, int], status: int = STATUS_OK) -> None:
        """This rank's staging of the op whose header round is ``header_round`` is complete: record where each
        source's part lies (``offsets``: group rank -> heap offset), then signal ``FORWARD``."""
        aux = self._aux
        aux.fill_(-1)
        for r, off in offsets.items():
            aux[AUX_OFFS + r] = int(off)
        aux[AUX_STATUS] = status
        aux[AUX_ROUND] = header_round
        self.t.signal(self.g[self.me], self.line(_L_FORWARD), header_round)

    def push_forwarded(self, header_round: int, offsets: dict[int, int], op: str) -> None:
        """Tell each sender of ``offsets`` (group rank -> heap offset of its staged part here, -1: none, the heap is
        full) where its part is: the offset word, then ``FORWARDED[me] = header_round`` in its pad."""
        for s, off in offsets.items():
            self._signal(s, self._forwarded(self.me) + _OFFSET_WORD, off, op)
            self._signal(s, self._forwarded(self.me), header_round, op)

    def wait_forwarded(self, ranks: list[int], header_round: int, op: str) -> dict[int, int]:
        """Wait for the forwarders ``ranks`` to push this rank's part of the op; their offsets."""
        self.wait_own({f: self._forwarded(f) for f in ranks}, header_round, op)
        out = {}
        for f in ranks:
            off = self.t.load(self.g[self.me], self._forwarded(f) + _OFFSET_WORD)
            if off == NO_ROOM:
                raise ZbcclOutOfMemoryError(f"{op}: rank {f} could not stage the sums it forwards (its heap is full)",
                                            ranks=(f,))
            if off < 0:
                raise ZbcclRemoteError(f"{op}: rank {f} failed while staging the sums it forwards (its own error "
                                       f"names the cause; {self.where(f)})", ranks=(f,))
            out[f] = off
        return out

    def wait_forward(self, ranks: list[int], header_round: int, op: str) -> dict[int, list[int]]:
        """Wait for every rank of ``ranks`` to post its staging of the op, then read their aux words."""
        if not ranks:
            return {}
        self.wait(ranks, self.line(_L_FORWARD), header_round, op)
        out = {}
        for r in ranks:
            words = self.read(r, self.aux_off[r], self.AUX * 8, op).view(torch.int64).tolist()
            if words[AUX_ROUND] != header_round:
                raise ZbcclRemoteError(f"{op}: rank {r}'s staging is for another op, expected round {header_round}, "
                                       f"got {words[AUX_ROUND]}", ranks=(r,))
            if words[AUX_STATUS] == STATUS_NOMEM:
                raise ZbcclOutOfMemoryError(f"{op}: rank {r} could not stage the rows it forwards (its heap is full)",
                                            ranks=(r,))
            if words[AUX_STATUS] != STATUS_OK:
                raise ZbcclRemoteError(f"{op}: rank {r} failed while staging the rows it forwards (its own error "
                                       f"names the cause; {self.where(r)})", ranks=(r,))
            out[r] = words
        return out
