"""The control plane of a ``Buffer`` whose group spans hosts: rounds through the transport verbs only.

A group that spans hosts has no op channel (a remote rank's memory cannot be viewed), so EP's
handshake runs on the verbs every transport has: ``put``, ``signal``, ``load`` (``docs/ep-internode.md``).
Memory, per group rank, allocated at the Buffer's construction:

* a **mesh region** in its heap (:class:`zbccl.ops.hosts.mesh.Mesh`, the steps the collectives across
  hosts use): ``2 * R`` slots of ``W * 8 + eager`` bytes, slot ``(k % 2, i)`` receiving rank ``i``'s header
  and parts of round ``k``;
* an **aux** block in its heap: ``AUX`` int64 words a forwarder fills during a dispatch (the op's
  header round, a status word and the heap offset of each sender's rows);
* signal words in its own pad, on lines of the Buffer's private communicator's comm slot (that slot's
  op channel never exists when the group spans hosts, so nothing else writes them): ``FORWARD`` (line 0),
  written by this rank; the mesh's arrived word of rank ``i`` (line 1 + i, written by rank ``i`` of this
  host). Hence at most ``MAX_RANKS`` ranks.

The region and aux offsets and the proposed eager limit go through the store once (the communicator's
bootstrap all_gather), are parsed strictly, and are checked against each peer's live heap size as the
transport reports it: nothing read from the store is trusted. The eager limit is the smallest proposed
(``tuner.ep_hosts_eager``).

A **round** is one mesh step: every rank writes every peer its header (``W`` int64, when the round has
one) and its **eager part** for that peer (a dispatch's rows or a combine's sums up to ``eager`` bytes),
in one stamped write per peer on another host (all in flight at once; a put and a signal on this host),
then waits until every peer's arrived here (the mesh's liveness rule meanwhile: a dead writer is a
``ZbcclRemoteError``, a silent host a ``ZbcclTimeoutError`` naming it, a late one a ``ZbcclTimeoutError``
naming the missing ranks). What arrived in round ``k`` stays in this rank's slots until every rank
entered round ``k + 1`` (a peer writes parity ``k % 2`` again only in round ``k + 2``), so this host's
ranks may read a forwarder's slot in place during the op. A part over the eager limit stays in its
sender's heap and its receiver reads it (:meth:`HostWire.read`).

A dispatch's forwarder records where each sender's rows lie (its slot, or its staging) in its aux block and
signals its own ``FORWARD = k`` (``k`` the op's header round); this host's ranks wait on that word (shm). A
combine's forwarders send each sender its sums in a second round. Normal ops keep their blocks until the
next header round instead of ending with a round (:meth:`HostWire.hold`); a receive hook ends with a plain
round.
"""

from __future__ import annotations

import contextlib
import struct
import time
from collections.abc import Iterator

import torch

from ..errors import ZbcclInvalidUsageError, ZbcclOutOfMemoryError, ZbcclRemoteError, ZbcclTimeoutError
from ..heap import layout
from ..native.abi import WHERE_EP
from ..ops.hosts.flat import copy
from ..ops.hosts.mesh import Mesh, Watch, region_bytes
from ..ops.tuner import ep_hosts_eager
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
)

__all__ = ["HostWire", "spans_hosts", "AUX_ROUND", "AUX_STATUS", "AUX_OFFS", "NO_ROOM", "FAILED"]

#: Aux words: the round the forwarder staged for, its status (0: ok), then one heap offset per rank.
AUX_ROUND, AUX_STATUS, AUX_OFFS = 0, 1, 2
#: Lines of the comm slot: FORWARD, then the mesh's arrived words (1 + i): at most ``MAX_RANKS`` ranks.
_L_FORWARD, _L_MESH = 0, 1
_LINES = layout.SLOT_BYTES // layout.LINE
MAX_RANKS = _LINES - _L_MESH
#: What a forwarder posts instead of an offset or a status when it could not stage: its heap is full (``NO_ROOM``,
#: also the aux status ``STATUS_NOMEM``), or it failed otherwise (``FAILED``: a dead peer, an interrupt).
NO_ROOM, FAILED = -1, -2
#: Seconds :meth:`HostWire.close` waits for writes a failed round left in flight.
_DRAIN_S = 6.0
_RECORD = struct.Struct("<5q")


def spans_hosts(comm) -> bool:
    """Whether some member of ``comm`` is on another host (its heap cannot be viewed here)."""
    heap = comm.heap
    return not all(heap.reachable(g) for g in comm.ranks)


class HostWire:
    """Rounds (header all_gather, barrier) and the forwarding geometry of one spanning group."""

    def __init__(self, comm, timeout: float | None, budget: int = 0) -> None:
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
        #: ``[2, R]`` int64: each rank's host, then its index on that host (the native dispatch pack reads them).
        self.host_table = torch.tensor([self.host_of, self.local_index], dtype=torch.int64)
        self.hostnames = [topo.infos[self.g[rs[0]]].hostname for rs in self.hosts]
        #: The native kernels of this rank's own steps (layout); raises here without them.
        self.caps = Capabilities.of(comm.heap.prims)
        self.W = HDR_LEN + 4 * self.R + 4 * self.H
        self.W8 = self.W * 8
        self.AUX = AUX_OFFS + self.R
        eager = ep_hosts_eager(comm.heap_bytes, self.R, budget)
        # zeroed before it is announced: no stamp of an earlier user of this memory can pass for a round
        self._region = self._aux = None
        nomem = ""
        try:
            self._region = heap_empty(comm, (region_bytes(self.R, self.W8 + eager),), torch.uint8, fallback=False)
            self._region.zero_()
            self._aux = heap_empty(comm, (self.AUX,), torch.int64, fallback=False)
            self._aux.fill_(-1)
        except ZbcclOutOfMemoryError as exc:  # announced, so that every rank raises it (none waits for this one)
            nomem = str(exc)
        regions, self.aux_off, self.eager = self._exchange_offsets(eager, nomem)
        self.mesh = Mesh(comm._ctx, self.g, regions, self.W8 + self.eager, self.line(_L_MESH),
                         Watch(comm._ctx, self.labels))
        self._none: list = [None] * self.R
        self.round = 0
        self.parity = 0
        self._at = 0  # where the parts of the last round lie in its slots (after the header, if it had one)
        #: The blocks peers may still read from this rank's last normal-mode op (send blocks, staging): dropped at
        #: the end of the next header round, which every peer enters only after it finished that op.
        self._held: list = []
        #: The last block of each role (outputs, send blocks, staging), reused by :meth:`reuse` when idle.
        self._reuse: dict[str, tuple[torch.Tensor, tuple[int, int] | None]] = {}
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

    def _exchange_offsets(self, eager: int, nomem: str) -> tuple[list[int], list[int], int]:
        """Every member's region and aux offsets, and the group's eager limit (the smallest proposed), through the
        store; each record parsed strictly and checked against its rank's live heap size. A rank whose heap could not
        hold its blocks (``nomem``) announces a region at -1: every rank raises ``ZbcclOutOfMemoryError`` naming it."""
        if nomem:
            mine = _RECORD.pack(-1, 0, eager, -1, 0)
        else:
            mine = _RECORD.pack(self.offset_of(self._region), self._region.numel(), eager, self.offset_of(self._aux),
                                self._aux.numel() * 8)
        got = self.comm.bootstrap.all_gather(mine, timeout=self.timeout, tag="ep-wire",
                                             watch=self.comm.store_watch)
        recs = []
        for r, raw in enumerate(got):
            if not isinstance(raw, (bytes, bytearray)) or len(raw) != _RECORD.size:
                raise ZbcclRemoteError(f"Buffer: rank {r}'s EP record is malformed, expected {_RECORD.size} bytes, "
                                       f"got {len(raw) if isinstance(raw, (bytes, bytearray)) else type(raw).__name__}",
                                       ranks=(r,))
            recs.append(_RECORD.unpack(raw))
        full = [r for r, rec in enumerate(recs) if rec[0] == -1 and rec[1] == 0]
        if full:
            need = region_bytes(self.R, self.W8 + eager) + self.AUX * 8
            raise ZbcclOutOfMemoryError(f"Buffer: the heap of rank(s) {full} cannot hold EP's blocks across hosts, "
                                        f"expected about {need} free bytes, got less (raise heap_size, or lower "
                                        f"num_rdma_bytes){': ' + nomem if nomem else ''}", ranks=tuple(full))
        bad = [r for r, rec in enumerate(recs) if not 4096 <= rec[2] <= 1 << 30 or rec[2] % 4096]
        if bad:
            raise ZbcclRemoteError(f"Buffer: rank {bad[0]}'s EP record holds a bad eager limit, expected a multiple "
                                   f"of 4096 in [4096, 2**30], got {recs[bad[0]][2]}", ranks=tuple(bad))
        least = min(rec[2] for rec in recs)
        regions, aux = [], []
        for r, (roff, rbytes, _, aoff, abytes) in enumerate(recs):
            size = self.t.size(self.g[r])
            need = region_bytes(self.R, self.W8 + least)
            if rbytes < need or abytes != self.AUX * 8 or min(roff, aoff) < 0 or roff % 64 or aoff % 8 \
                    or roff + rbytes > size or aoff + abytes > size:
                raise ZbcclRemoteError(
                    f"Buffer: rank {r}'s EP record is out of its heap, expected a region of {need}+ bytes (64-byte "
                    f"aligned) and an aux block of {self.AUX * 8} bytes within its {size} heap bytes, got a region of "
                    f"{rbytes} bytes at {roff} and aux {abytes} bytes at {aoff}", ranks=(r,))
            regions.append(roff)
            aux.append(aoff)
        return regions, aux, least

    # ------------------------------------------------------------------ local memory
    def offset_of(self, t: torch.Tensor) -> int:
        return self.comm.heap.offset_of(t) if t.is_contiguous() else -1

    def heap_block(self, nbytes: int, role: str) -> torch.Tensor:
        """A uint8 heap block peers read (never ordinary memory: a peer must reach it)."""
        try:
            return self.reuse(role, [((max(int(nbytes), 1),), torch.uint8)], fallback=False)[0]
        except ZbcclOutOfMemoryError as exc:
            raise Fail(f"cannot hold the {role} ({nbytes} bytes) in the heap: {exc}", STATUS_NOMEM) from None

    #: Exact-size blocks by role, the last one reused while nothing else holds it: a send block or staging is
    #: idle once ``_held`` let it go (at the next header round, when every peer finished reading it).
    reuse = Exchange.reuse
    drop_reused = Exchange.drop_reused
    addr = Exchange.addr

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

    def _round(self, vec: torch.Tensor | None, op: str, parts: list | None = None) -> torch.Tensor | None:
        """One round (see the module docstring): ``vec`` (``[W]`` int64, or None: no header) and ``parts[p]`` (flat
        uint8 of at most ``eager`` bytes, or None) to every peer ``p``; returns ``[R, W]`` (the headers) when
        ``vec`` is given. Read the parts that arrived with :meth:`part`."""
        if self.broken:
            raise ZbcclInvalidUsageError(f"{op}: {self.broken}")
        self.round += 1
        me, R = self.me, self.R
        self._at = self.W8 if vec is not None else 0
        before = None
        if vec is not None:
            raw = vec.view(torch.uint8)
            before = [None if p == me else raw for p in range(R)]
        try:
            self.parity = self.mesh.step(parts if parts is not None else self._none, op=op, timeout=self.timeout,
                                         at=self._at, before=before)
        except (ZbcclRemoteError, ZbcclTimeoutError) as exc:  # its ranks are this group's ranks
            self._named(exc, [r for r in exc.ranks if isinstance(r, int) and 0 <= r < R])
        if vec is None:
            return None
        rows = torch.empty(R, self.W, dtype=torch.int64)
        for p in range(R):
            rows[p] = vec if p == me else self.mesh.view(self.parity, p, self.W8).view(torch.int64)
        return rows

    def rides(self, r: int, nbytes: int) -> bool:
        """Whether a part of ``nbytes`` between this rank and group rank ``r`` rides in its round: ``r`` on another
        host (a part for a rank of this host is read in place) and the part within the eager limit. Sender and
        receiver both ask this, so they agree without a round trip."""
        return 0 < nbytes <= self.eager and self.host_of[r] != self.my_host

    def part(self, p: int, nbytes: int) -> torch.Tensor:
        """The ``nbytes`` rank ``p`` sent this rank in the last round (uint8, a view of this rank's slot: valid until
        every rank entered the next round). A rank of another host that sent fewer (its stamp says) is a
        ``ZbcclRemoteError``: what lies past them in the slot is an older round's."""
        end = self.mesh.extent(self.parity, p)
        if end is not None and self._at + nbytes > end:
            raise ZbcclRemoteError(f"round {self.round}: rank {p} sent {max(end - self._at, 0)} bytes of its part, "
                                   f"expected {nbytes} (its header says so)", ranks=(p,))
        return self.mesh.view(self.parity, p, nbytes, at=self._at)

    def part_offset(self, p: int) -> int:
        """The heap offset of :meth:`part` of ``p`` in this rank's heap (this host's ranks view it there)."""
        return self.mesh.slot_offset(self.parity, p) + self._at

    def step(self, parts: list, op: str) -> None:
        """Collective: a round without headers carrying ``parts`` (see :meth:`_round`)."""
        self._round(None, op, parts)

    def close(self) -> None:
        """Wait (a bounded time) for writes a failed round left in flight: they read this rank's blocks."""
        self.mesh.drain(_DRAIN_S)

    def wait(self, ranks: list[int], line: int, target: int, op: str) -> None:
        """Wait until the word at ``line`` of every group rank of ``ranks`` (ranks of this host) is ``>= target``,
        applying the liveness rule of this host's ranks between slices of the wait (one that left the op half-way
        is named, with the cause it left by); an error names the ranks it is about and their hosts (a dead or
        departed rank: ``ZbcclRemoteError``; a late one: ``ZbcclTimeoutError``)."""
        if not ranks:
            return
        lines = [(self.g[r], line) for r in ranks]
        deadline, piece = time.monotonic() + self.timeout, max(self.comm._ctx.liveness_ns / 1e9, 0.05)
        while True:
            left = deadline - time.monotonic()
            try:
                self.t.wait_until(lines, target, timeout=max(0.0, min(piece, left)), op=op, labels=self.labels)
                return
            except (ZbcclRemoteError, ZbcclTimeoutError) as exc:
                if isinstance(exc, ZbcclRemoteError) or left <= piece:
                    self._named(exc, [r for r in exc.ranks if isinstance(r, int) and 0 <= r < self.R] or list(ranks))
            late = [self.g[r] for r in ranks if self.t.load(self.g[r], line) < target]
            liveness.check(self.comm._ctx, [self.g[r] for r in ranks], op=op, pending=late, labels=self.labels)

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
        """Group rank ``r`` and its host, in words (for a rank on another host, the transport's: with the address
        it reaches it at)."""
        h, g = self.host_of[r], self.g[r]
        return f"rank {r} on host {h} ({self.hostnames[h] if self.t.viewable(g) else self.t.where(g)})"

    def hold(self, blocks: list) -> None:
        """Keep ``blocks`` alive until the next header round (see ``_held``)."""
        self._held = list(blocks)

    def barrier(self, op: str) -> None:
        """Collective: a plain round."""
        self._round(None, op)

    def publish(self, op: str, fields: dict[int, int], vector: list[int], fail: Fail | None,
                parts: list | None = None) -> torch.Tensor:
        """Collective: every rank's header ``[R, W]`` int64 (fields, then ``vector`` from word ``HDR_LEN``), and
        ``parts`` (see :meth:`_round`; None when this rank failed); raises on every rank if any rank failed, or
        when the ranks run different ops."""
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
        rows = self._round(h, op, parts if fail is None else None)
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

    def _stage_copy(self, block: torch.Tensor, t: torch.Tensor) -> None:
        """:meth:`place`'s copy on this thread (``ops/hosts/flat.copy``: torch's would fan out to its intra-op
        threads, whose spinning afterwards holds off the peers and Mooncake's engine threads)."""
        copy(block, t)

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
