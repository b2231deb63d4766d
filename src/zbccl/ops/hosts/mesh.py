"""A mesh: every member writes to every other member through the transport verbs, in steps.

The one data-moving primitive of the collectives across hosts. It uses only the verbs every
transport has (put, put_async, signal, load), so a member may sit on another host (mooncake) or on this one
(shm); nothing of a peer is ever viewed.

Memory: each member owns a **region** in its heap (announced through the store at setup, zeroed by its
owner before, and checked against its heap size): ``2 * n`` slots of ``STAMP + slot`` bytes, slot
``(parity, i)`` receiving member ``i``'s bytes of the steps of that parity behind a ``STAMP``-byte stamp.
Each member owns ``n`` **arrived** words in its signal pad, from ``line_base`` (one line each), in its
communicator's comm slot: word ``i`` is written by member ``i`` only, with the number of the last step whose
bytes it put here.

How a step's bytes are published depends on where the receiver is:

* **on this host** (a peer this rank can view): put the bytes, then ``signal`` the receiver's arrived word
  (a release store orders them);
* **on another host**: a **stamped** write. The stamp is ``[step, at0, len0, at1, len1, mode, check, 0]``
  (uint64). Mode 0 (steps up to ``ORDERED`` bytes): ``check`` is the XXH64 of the stamp's first six words
  followed by the pieces' bytes (about 15 GB/s, against the network's 1-2 here); stamp and pieces are
  copied into one contiguous ``put``: one round trip, its bytes landing in no promised order. Mode 1
  (larger steps): the pieces' ``put_many`` completes (landed), then the stamp is written, its check
  covering its own six words only. The receiver polls its own slot: the step has arrived once the stamp
  says ``step`` and the check it computes over what it holds equals the stamp's. Bytes still landing (a
  torn stamp, a half-written piece) fail the check and are polled again, so no ordering promise of the
  engine is needed and one network round trip publishes a small step (instead of two: data, then a flag).
* **relayed**, for a member on another host that has a **relay**: the member of its host with this
  member's index among its own host's members (DeepEP's rule: what is bound for several ranks of a host
  crosses the network once). A one-write step to the relay carries, 64-byte aligned after the relay's own
  bytes, the step of each such member as its own write would have carried it (its stamp, word 7 naming the
  member, then its bytes); the relay's stamp says mode 2, word 7 the riders' length, and its check covers
  them too. The relay, once it verified the step, copies each rider's bytes and then its stamp into that
  member's slot (a put on this host), where the member checks it as a direct write. Only when every
  rider's step and the relay's fit one unordered write; otherwise each goes directly. At 2 x 2 this halves
  a small step's writes between hosts (four instead of eight).

Synchronisation protocol (step ``s`` = 1, 2, ... on every member, in the same order):

1. For each peer ``p``: wait until ``p``'s step ``s - 1`` arrived here (``p`` started step ``s - 1``, so it
   consumed everything of step ``s - 2``, the last user of slot parity ``s % 2`` at ``p``). In lockstep this
   already holds (step 3 of ``s - 1`` waited for it): no acknowledgement is ever written.
2. For each peer ``p``: publish this member's bytes for ``p`` in slot ``(s % 2, me)`` of ``p``'s region as
   above. Every write to a peer on another host is started (``put_async``) and left in flight while the next
   peer's start: a one-write step's from a staging buffer of ``p``'s; an ordered step's bytes uncopied, and
   its stamp (from that staging buffer) once every peer's bytes landed (Mooncake over TCP v2 completes a
   write only once it landed).
3. Wait until every peer's step ``s`` arrived here; the caller consumes the slots (views of this member's own
   heap) before it starts step ``s + 1``. This member's last writes of step ``s`` (a one-write step's, or an
   ordered step's stamps) may still be in flight: they read only its staging buffers (an ordered step's bytes,
   read from the caller's memory, landed before its stamps left), so step ``s + 1`` waits for them before it
   refills those buffers, as :meth:`Mesh.drain` does before the buffers are freed. Waiting for them here
   instead (for the acknowledgement of a write the peer already checked) cost a 2 x 1 all_reduce of 4-64 KiB
   10-20 % (``docs/benchmarks.md`` A.15). A write that failed is retried (or raises, naming its peer) there.

Waits poll this member's own memory (remote writes wake no futex), yielding for ``HOT`` seconds and then
napping in short steps (:func:`~zbccl.heap.transports.base.pause`), and apply the liveness rule every ``liveness`` seconds: a member that left an op half-way (its ABORT line, read
through the verbs on another host), a member that failed, finalized or died, a host that stopped
answering; the timeout names the members never heard from and their hosts.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from ... import native
from ...errors import ZbcclError, ZbcclInvalidUsageError, ZbcclRemoteError, ZbcclTimeoutError
from ...heap import layout
from ...heap.transports.base import DONE, Pending
from ...heap.transports.base import pause as backoff
from ...native.abi import ABORT_PEER, ABORT_TIMEOUT
from ...runtime import liveness

__all__ = ["Mesh", "Watch", "STAMP", "ORDERED", "region_bytes", "part"]

#: Bytes of the stamp in front of every slot (module docstring).
STAMP = 64
#: Up to this many bytes (a 256 KiB piece and its header), a step's stamp and bytes to a member on another host
#: are copied into one contiguous write, checked by hashing the bytes (a batch of several slices costs more
#: than one slice: measured). Above, the bytes go first, uncopied, and the stamp after them (an ordered write:
#: Mooncake over TCP v2 completes a write once it landed), checked without hashing the bytes: an extra round
#: trip instead of a staging copy and two hashes. Measured by host id, 2 x 1 all_reduce, three alternated runs:
#: 256 KiB one write 480 us, ordered 530 us; 512 KiB one write 1020 us, ordered 710 us; 1 MiB 1870, 1780 us.
ORDERED = (256 << 10) + (64 << 10)
_MODE_ORDERED = 1
_MODE_RELAY = 2
_SEED = 0x7A62636D65736801  # "zbcmesh" + 1: XXH64 seed of the stamps' checks


def _align(nbytes: int) -> int:
    return (nbytes + 63) // 64 * 64


#: One part of a step to a member: ``(byte in its slot, the bytes (flat uint8, contiguous), their address, their
#: length)``, each tensor attribute read once (:func:`part`).
Part = tuple[int, torch.Tensor, int, int]


def part(where: int, piece: torch.Tensor) -> Part:
    """``piece`` (flat uint8, contiguous) at byte ``where`` of a slot, as :meth:`Mesh.seal` takes it."""
    return where, piece, piece.data_ptr(), piece.numel()


def _end(parts: Sequence[Part]) -> int:
    """Where the last of a step's parts ends in its slot."""
    return max((p[0] + p[3] for p in parts), default=0)


def region_bytes(members: int, slot: int) -> int:
    """Bytes of a member's region of a mesh of ``members`` with slots of ``slot`` bytes."""
    return 2 * members * (STAMP + slot)


#: Seconds a wait yields the core between polls before it naps (:func:`~zbccl.heap.transports.base.pause`):
#: short, because the words it waits for are written by this process's own Mooncake engine threads (a remote
#: put lands through them), which a polling thread must not starve on oversubscribed cores.
HOT = 200e-6
#: ... except while it waits for the arrival of a step whose pieces are all small (at most ``SMALL_STEP`` bytes to
#: each member): such a step's bytes land within one write's round trip (100-300 µs here), so a nap would mostly
#: overshoot it, and no multi-segment write needs the core meanwhile. Measured by alternating both in the same
#: processes (``docs/benchmarks.md`` A.25).
HOT_SMALL, SMALL_STEP = 1e-3, 64 << 10
#: A wait that waits for peers' steps only polls this member's own writes in flight on every this-many-th pass
#: (a 4 KiB step polls about 10 times; each write's poll is a call into the engine).
WRITES_EVERY = 8


class Watch:
    """The liveness rule of a wait among global ranks (module docstring), with errors in group ranks."""

    def __init__(self, ctx, labels: dict[int, int]) -> None:
        self.ctx, self.t, self.labels = ctx, ctx.heap.transport, labels
        # Its reads of remote words are round trips through the peers' engines: no more often than the
        # mooncake monitor probes them (every max(ZBCCL_LIVENESS_INTERVAL, 0.25) s).
        self.interval = max(ctx.liveness_ns / 1e9, 0.25)

    def where(self, g: int) -> str:
        """The host of global rank ``g``, in words."""
        return self.t.where(g)

    def check(self, members: Sequence[int], pending: Sequence[int], op: str, *, waited: float = 0.0,
              timeout: float = float("inf"), watched: Sequence[int] = ()) -> None:
        """Raise if a member left an op half-way, or a pending one failed, finalized, died or is unreachable, or a
        ``watched`` one (a pending one's relay, or a member late only behind its relay: never named as late) failed,
        died or is unreachable (a relay that finalized had passed on all it got).

        Members that left only because they timed out waiting too, while this wait (``waited`` seconds of its
        ``timeout``) is past half its own timeout: they gave up at about the moment it would, so the pending
        members that never left are named, as this rank's own timeout would name them. Earlier, the member that
        left is named (its shorter timeout is the cause this rank sees)."""
        ctx, label = self.ctx, self.labels.get
        if ctx.finalized:
            raise ZbcclInvalidUsageError(f"{op}: {liveness.FINALIZED_WHILE_WAITING}", ranks=(ctx.rank,))
        suspects = list(dict.fromkeys([*pending, *watched]))
        self._hosts_lost(suspects, op)  # never blocks: the monitor's verdict
        follow, timed = None, []
        for g in members:
            if g == ctx.rank:
                continue
            why, where = self._read(lambda g=g: liveness.aborted(self.t, g, liveness.ABORT_LINE), op)
            if why == ABORT_TIMEOUT:
                timed.append((g, why, where))
            elif why and why != ABORT_PEER:
                raise liveness.abort_error(label(g, g), why, op=op, where=where)
            elif why and follow is None:
                follow = (g, why, where)
        dead, gone = set(self.t.dead_peers()), []
        for g in suspects:
            if g == ctx.rank:
                continue
            state = self._read(lambda g=g: self.t.load(g, layout.H_STATE), op)
            if state == layout.STATE_FAILED:
                gone.append((g, "failed"))
            elif state == layout.STATE_FINALIZED and g in pending:
                gone.append((g, "called finalize"))
            elif g in dead:
                gone.append((g, "died (its process exited or was killed)"))
        if gone:
            what = "; ".join(f"rank {label(g, g)} on {self.where(g)} {why}" for g, why in gone)
            err: ZbcclError = ZbcclRemoteError(f"{op}: peer lost while waiting: {what}",
                                               ranks=tuple(label(g, g) for g, _ in gone))
            err.via = gone[0][0]  # (world ranks, as every error's via: what a leave records)
            raise err
        late = [g for g in pending if g != ctx.rank and g not in {t[0] for t in timed}]
        if timed and late and follow is None and waited >= timeout / 2:
            names = [label(g, g) for g in late]
            where = "; ".join(f"rank {label(g, g)} on {self.where(g)}" for g in late)
            err = ZbcclTimeoutError(f"{op}: ranks {names} never arrived ({where}; rank(s) "
                                    f"{[label(g, g) for g, _, _ in timed]} timed out waiting and left)",
                                    ranks=tuple(names))
            err.via = late[0]
            raise err
        if timed or follow is not None:
            g, why, where = timed[0] if timed else follow
            raise liveness.abort_error(label(g, g), why, op=op, where=where)

    def _hosts_lost(self, pending: Sequence[int], op: str) -> None:
        """The transport's verdict on the pending members of other hosts (the liveness rule's, same words): dead
        (the host answers, the engine is gone) or unreachable (no answer for its stall bound: a cut link, a host
        down)."""
        _, lost = liveness.far_members(self.ctx, pending, pending)
        if lost is not None:
            raise liveness.lost_error(self.ctx, *lost, op=op, labels=self.labels)

    def _read(self, read, op: str):
        """A read of a member's words; a failed one is reported in this communicator's numbering."""
        try:
            return read()
        except (ZbcclRemoteError, ZbcclTimeoutError) as exc:
            raise self.relabel(exc, op) from None

    def relabel(self, exc: ZbcclRemoteError | ZbcclTimeoutError, op: str) -> ZbcclError:
        """A verb's error (its ranks are global ranks) in this communicator's numbering."""
        mine = [self.labels[g] for g in exc.ranks if g in self.labels]
        text = str(exc) if str(exc).startswith(f"{op}: ") else f"{op}: {exc}"
        err = type(exc)(f"{text}; in this communicator: rank(s) {mine}", ranks=tuple(mine))
        err.via = next((g for g in exc.ranks if g in self.labels), None)
        return err


class Mesh:
    """Steps of all-to-all puts among ``members`` (global ranks) over ``ctx``'s transport (module docstring).

    ``regions[i]``: member ``i``'s region offset in its heap (zeroed by its owner before it announced it);
    ``slot``: bytes of one slot; ``relay``: relay small steps (:meth:`set_relays`). Not thread-safe (the
    communicator's op lock serialises its ops)."""

    def __init__(self, ctx, members: Sequence[int], regions: Sequence[int], slot: int, line_base: int,
                 watch: Watch, *, relay: bool = True) -> None:
        self.ctx, self.t, self.members = ctx, ctx.heap.transport, list(members)
        self.me = ctx.rank
        self.index = self.members.index(self.me)
        self.regions, self.slot, self.line_base, self.watch = list(regions), slot, line_base, watch
        self.pitch = STAMP + slot
        self.step_no = 0
        self.n = len(self.members)
        #: Members on another host (this rank cannot view their memory): their steps arrive stamped.
        self.stamped = [i != self.index and not self.t.viewable(g) for i, g in enumerate(self.members)]
        #: Per member: the member of its host that relays this member's small steps to it (``relays[i]``; None:
        #: written directly), the one with this member's index among its host's members (module docstring); and
        #: the member of this host that may relay member ``i``'s steps here (``relayed_by[i]``).
        self.relays: list[int | None] = [None] * self.n
        self.relayed_by: list[int | None] = [None] * self.n
        self.set_relays(relay)
        self.got = [0] * self.n  # the last step verified from each stamped member
        self._peers = [i for i in range(self.n) if i != self.index]
        core = native.core()
        self._hash, self._copy, self._load = core.hash64, core.memcpy, core.load_acquire
        self._out = np.zeros(STAMP // 8, dtype=np.uint64)  # the stamp being sent (one peer at a time)
        self._out_addr = self._out.ctypes.data
        self._snap = np.zeros(STAMP // 8, dtype=np.uint64)  # a stamp as it was when checked
        self._snap_addr = self._snap.ctypes.data
        # per member: its staging buffer (a step's stamp, and its bytes when they go in one write); the writes in
        # flight, (member, write), until they say done
        self._stage: list[tuple[torch.Tensor, int, torch.Tensor] | None] = [None] * self.n
        self._stage_cut: list[tuple[int, torch.Tensor | None]] = [(-1, None)] * self.n  # its last cut (see _send)
        self._sent: list[tuple[int, Pending]] = []
        #: This member's region (flat uint8; it lives as long as the mesh) and its address: what :meth:`offset`
        #: counts from.
        self.own = self.t.view(self.me, self.regions[self.index], (region_bytes(self.n, slot),), torch.uint8,
                               op="hosts")
        self._own_np = self.own.numpy()
        self.own_addr = self.own.data_ptr()
        # the stamps of this member's slots, viewed once: [parity][member] (uint64 words)
        self._stamps = [[self._own_np[at:at + STAMP].view(np.uint64)
                         for at in (self._local(parity, i) - STAMP for i in range(self.n))] for parity in (0, 1)]
        self._stamp_addr = [[self.own_addr + self._local(parity, i) - STAMP for i in range(self.n)] for parity in (0, 1)]

    def set_relays(self, on: bool) -> None:
        """Relay small steps (``relays``, ``relayed_by``: the module docstring), or write every step directly. Every
        member must make the same choice (a step's receiver names a late member's relay, not the member)."""
        self.relays, self.relayed_by = [None] * self.n, [None] * self.n
        self._relaying = False
        topology = getattr(self.ctx, "topology", None)
        if not on or topology is None or not any(self.stamped):
            return
        host_of = topology.host_of
        by_host: dict[int, list[int]] = {}
        for i, g in enumerate(self.members):
            by_host.setdefault(host_of(g), []).append(i)
        here = by_host[host_of(self.me)]
        mine = here.index(self.index)
        for i, g in enumerate(self.members):
            if not self.stamped[i]:
                continue
            there = by_host[host_of(g)]
            if len(there) > mine and there[mine] != i and self.stamped[there[mine]]:
                self.relays[i] = there[mine]
            theirs = there.index(i)
            if len(here) > theirs and here[theirs] != self.index:
                self.relayed_by[i] = here[theirs]
        self._relaying = any(r is not None for r in self.relays)

    def _arrived(self, i: int) -> int:
        return self.line_base + layout.LINE * i

    def _slot_at(self, owner: int, parity: int, src: int) -> int:
        """Offset of the stamp of slot ``(parity, src)`` in member ``owner``'s heap (its bytes follow it)."""
        return self.regions[owner] + (parity * self.n + src) * self.pitch

    def _local(self, parity: int, src: int) -> int:
        """Offset in this member's own region of the bytes of slot ``(parity, src)`` (after its stamp)."""
        return (parity * self.n + src) * self.pitch + STAMP

    def extent(self, parity: int, src: int) -> int | None:
        """The end (bytes from the start of slot ``(parity, src)``) of what member ``src`` wrote there in its last
        step of that parity, as its verified stamp says; None for a member of this host (no stamp)."""
        if not self.stamped[src]:
            return None
        st = self._stamp(parity, src)
        return max(int(st[1]) + int(st[2]), int(st[3]) + int(st[4]))

    def slot_offset(self, parity: int, src: int) -> int:
        """Heap offset (in this member's heap) of the bytes of its slot ``(parity, src)``."""
        return self.regions[self.index] + self._local(parity, src)

    def _bytes_at(self, parity: int, src: int, nbytes: int) -> int:
        if nbytes > self.slot:
            raise AssertionError(f"hosts: a view of {nbytes} bytes of a slot of {self.slot}")
        return self._local(parity, src)

    def offset(self, parity: int, src: int, nbytes: int, *, at: int = 0) -> int:
        """Where (bytes into :attr:`own`) :meth:`view`'s bytes start."""
        return at + self._bytes_at(parity, src, at + nbytes)

    def view(self, parity: int, src: int, nbytes: int, *, at: int = 0) -> torch.Tensor:
        """Member ``src``'s bytes of a step of ``parity`` in this member's own region, from byte ``at`` of its
        slot (uint8, a view)."""
        at += self._bytes_at(parity, src, at + nbytes)
        return self.own[at:at + nbytes]

    def view_np(self, parity: int, src: int, nbytes: int) -> np.ndarray:
        """:meth:`view` as a numpy array."""
        at = self._bytes_at(parity, src, nbytes)
        return self._own_np[at:at + nbytes]

    def step(self, pieces: Sequence[torch.Tensor | None], *, op: str, timeout: float, at: int = 0,
             before: Sequence[torch.Tensor | None] | None = None, before_at: int = 0) -> int:
        """One step: ``pieces[i]`` (flat uint8, at most ``slot - at`` bytes, or None: nothing) to member ``i``, at
        byte ``at`` of its slot (and ``before[i]`` at ``before_at``); returns the step's parity (read what
        arrived with :meth:`view`) once every peer's bytes are here (this member's own last writes may still be in
        flight from its staging buffers: protocol step 3)."""
        self.step_no += 1
        s, parity = self.step_no, self.step_no % 2
        idx, got = self._peers, self.got
        if self._sent:  # the last step's writes (3.): their staging buffers are refilled below
            self._sent = [(i, w) for i, w in self._sent if not self._done(w, op)]  # (mostly landed: no wait)
            if self._sent:
                self.wait([], op=op, timeout=timeout, sent=True)
        if s > 1 and not all(got[i] >= s - 1 for i in idx):  # 1. (holds already in lockstep)
            self.wait([(i, s - 1) for i in idx], op=op, timeout=timeout)
        stamps: list[tuple[int, int, int, torch.Tensor]] = []  # ordered steps: their stamps, sent last
        remote: dict[int, list[Part]] = {}  # members on other hosts: their parts
        room, biggest = self.slot, 0
        for i in idx:  # 2.
            parts = []
            for piece, where in ((None if before is None else before[i], before_at), (pieces[i], at)):
                if piece is not None:
                    nbytes = piece.numel()
                    if not nbytes:
                        continue
                    if where + nbytes > room or not piece.is_contiguous():
                        raise AssertionError(f"hosts: {nbytes} bytes at {where} in a slot of {room}")
                    parts.append((where, piece, piece.data_ptr(), nbytes))
                    biggest = max(biggest, nbytes)
            if self.stamped[i]:
                remote[i] = parts
                continue
            g = self.members[i]
            slot = self._slot_at(i, parity, self.index)  # on this host: the bytes, then the signal publishing them
            for where, piece, _, _ in parts:
                self.t.put(g, slot + STAMP + where, piece, op=op)
            self.t.signal(g, self._arrived(self.index), s)
        riders = self._riders(remote) if self._relaying else {}  # (nothing to relay: no per-step work)
        riding = {d for ds in riders.values() for d, _ in ds} if riders else ()
        for i, parts in remote.items():
            if i not in riding:
                self._send(s, i, parts, riders.get(i, ()), stamps, op)
        if stamps:  # every write of this step is in flight at once: one round trip for all peers, not one each
            self.wait([], op=op, timeout=timeout, sent=True)
            for i, g, slot, head in stamps:
                self._sent.append((i, self._start(g, slot, head, op)))
        self.wait([(i, s) for i in idx], op=op, timeout=timeout,  # 3.
                  hot=HOT_SMALL if biggest <= SMALL_STEP else HOT)
        return parity

    def _start(self, g: int, offset: int, src: torch.Tensor, op: str) -> Pending:
        """``put_async`` to global rank ``g``; a failure reported in this communicator's numbering."""
        try:
            return self.t.put_async(g, offset, src, op=op)
        except (ZbcclRemoteError, ZbcclTimeoutError) as exc:
            raise self.watch.relabel(exc, op) from None

    def _done(self, w: Pending, op: str) -> bool:
        """Whether write ``w`` landed; a failure (retried, then raised by the transport) in this communicator's
        numbering."""
        try:
            return w.done()
        except (ZbcclRemoteError, ZbcclTimeoutError) as exc:
            raise self.watch.relabel(exc, op) from None

    def _riders(self, remote: dict[int, list[Part]]) -> dict[int, list[tuple[int, list[Part]]]]:
        """Per relay: the members of its host whose step rides in the relay's write (all of them, or none when
        the relay's bytes and theirs, each behind a stamp, would not fit one unordered write)."""
        out: dict[int, list[tuple[int, list[Part]]]] = {}
        room = min(ORDERED, self.slot)
        for d, parts in remote.items():
            r = self.relays[d]
            if r is not None:
                out.setdefault(r, []).append((d, parts))
        for r in list(out):
            need = _align(_end(remote[r])) + sum(STAMP + _align(_end(parts)) for _, parts in out[r])
            if need > room:
                del out[r]
        return out

    def _send(self, s: int, i: int, parts: list[Part], riders, stamps: list, op: str) -> None:
        """Publish step ``s``'s ``parts`` to member ``i`` on another host (module docstring), with the steps of
        ``riders`` (``(member of i's host, its parts)``) riding behind them for ``i`` to relay."""
        g, slot = self.members[i], self._slot_at(i, s % 2, self.index)
        stage, base, head = self._staging(i)  # (free: the last step's writes landed, waited for above)
        body = base + STAMP
        end = _end(parts)
        relay = None
        if riders:  # each rider's step as its own write would carry it, 64-byte aligned after i's bytes
            at = start = _align(end)
            for d, dparts in riders:
                self.seal(s, dparts, target=d)
                self._copy(body + at, self._out_addr, STAMP)
                for where, _, addr, nbytes in dparts:
                    self._copy(body + at + STAMP + where, addr, nbytes)
                at += STAMP + _align(_end(dparts))
            relay, end = (body + start, at - start), at
        ordered = self.seal(s, parts, relay=relay)
        self._copy(base, self._out_addr, STAMP)
        if ordered:  # the bytes, uncopied, then (once every peer's landed) the stamp: no hash of the bytes
            for where, piece, _, _ in parts:
                self._sent.append((i, self._start(g, slot + STAMP + where, piece, op)))
            stamps.append((i, g, slot, head))
            return
        for where, _, addr, nbytes in parts:  # stamp and bytes in one contiguous write (the native copy)
            self._copy(body + where, addr, nbytes)
        cut_end, cut = self._stage_cut[i]  # the write's bytes: the last step's cut again when it ends there too
        if cut_end != end:
            cut = stage[:STAMP + end]
            self._stage_cut[i] = (end, cut)
        self._sent.append((i, self._start(g, slot, cut, op)))

    def seal(self, s: int, parts: Sequence[Part], *, target: int = 0, relay: tuple[int, int] | None = None) -> bool:
        """Fill the outgoing stamp of step ``s`` for ``parts`` (:data:`Part`, at most two); True when the step is
        ordered (mode 1: its check covers the stamp only). ``target``: the member a relayed stamp is for (word 7);
        ``relay``: ``(address, bytes)`` of the riders' stamped steps behind the bytes (mode 2: word 7 says their
        length, and the check covers it and them)."""
        out = self._out
        words = [s, 0, 0, 0, 0, 0, 0, target if relay is None else relay[1]]
        end = 0
        for k, (where, _, _, nbytes) in enumerate(parts):
            words[1 + 2 * k], words[2 + 2 * k] = where, nbytes
            end = max(end, where + nbytes)
        ordered = relay is None and end > ORDERED
        words[5] = _MODE_ORDERED if ordered else _MODE_RELAY if relay is not None else 0
        out[:] = words  # one assignment: numpy's per-element stores cost a microsecond each
        check = self._hash(self._out_addr, 48, _SEED)
        for _, _, addr, nbytes in parts if not ordered else ():
            check = self._hash(addr, nbytes, check)
        if relay is not None:
            check = self._hash(self._out_addr + 56, 8, check)
            check = self._hash(relay[0], relay[1], check)
        out[6] = check
        return ordered

    def _staging(self, i: int) -> tuple[torch.Tensor, int, torch.Tensor]:
        """Member ``i``'s staging buffer (its last write landed: a step starts by waiting for the last one's), its
        address and its stamp's bytes."""
        stage = self._stage[i]
        if stage is None:
            buf = torch.empty(STAMP + min(ORDERED, self.slot), dtype=torch.uint8)
            stage = self._stage[i] = (buf, buf.data_ptr(), buf[:STAMP])
        return stage

    def track(self, i: int, write: Pending) -> None:
        """Make ``write`` (to member ``i``, started by the caller) one that ``wait(sent=True)`` waits for (the
        caller waits for it before its source changes). Only between steps: a step's own writes are tracked the
        same way and waited for when the next step starts."""
        self._sent.append((i, write))

    @contextlib.contextmanager
    def loopback(self) -> Iterator[None]:
        """For measurement only (``zbccl bench --hosts 2 --cpu``): within, each write of a step to the other member
        (on another host) lands in this member's own slot of that member instead, as if it had sent the same
        bytes: steps then run with no network and no peer, at this process's own CPU cost. Only for a mesh of two
        members whose steps are alike (each sends the other the same lengths), and for writes into the slots
        (an op's direct puts raise). What the op computes meanwhile is meaningless. Both members must run the same
        number of steps within, and meet outside the mesh (through the bootstrap store) after it, before either
        takes a real step: a member in loopback serves its own waits, so its peer's lockstep no longer holds it
        back, and a real write that came early would land in a slot the loopback still fills."""
        other = 1 - self.index
        if self.n != 2 or not self.stamped[other]:
            raise ZbcclInvalidUsageError("loopback: expected a mesh of two members on two hosts")
        real, lo, hi = self.t, self.regions[other], self.regions[other] + region_bytes(2, self.slot)
        mesh = self

        class _Loop:
            def __getattr__(self, name):
                return getattr(real, name)

            def put_async(self, rank: int, offset: int, src, *, op: str = "put") -> Pending:
                if not lo <= offset < hi:
                    raise AssertionError(f"loopback: a write at {offset}, outside the other member's region")
                k, x = divmod(offset - lo, mesh.pitch)  # its slot (parity, this member) there: ours of the other
                mesh._copy(mesh.own_addr + ((k // 2) * 2 + other) * mesh.pitch + x, src.data_ptr(), src.numel())
                return DONE

        self.t = _Loop()
        try:
            yield
        finally:
            self.t = real

    def drain(self, seconds: float) -> None:
        """Wait up to ``seconds`` for writes left in flight by a step that raised, so that their buffers are not
        freed under the engine; errors are the failed op's, already raised."""
        end = time.monotonic() + seconds
        while self._sent:
            try:
                if self._sent[-1][1].done():
                    self._sent.pop()
                    continue
            except ZbcclError:
                self._sent.pop()
                continue
            if time.monotonic() > end:
                return
            time.sleep(1e-3)

    def _stamp(self, parity: int, i: int) -> np.ndarray:
        return self._stamps[parity][i]

    def _landed(self, i: int, s: int) -> bool:
        """Whether member ``i``'s step ``s`` arrived here: its stamp says ``s`` and checks out (module docstring);
        the steps riding behind a relayed one are passed on first."""
        parity = s % 2
        if self._load(self._stamp_addr[parity][i]) != s:  # (one native load: the stamp's step word)
            return False
        st = self._snap  # what the check covers: a snapshot (more may still be landing)
        np.copyto(st, self._stamps[parity][i])
        w = st.tolist()  # its words as ints, read once
        mode = w[5]
        if w[0] != s or mode > _MODE_RELAY:
            return False
        check = self._hash(self._snap_addr, 48, _SEED)
        base = self.own_addr + self._local(parity, i)
        end = 0
        for where, n in ((w[1], w[2]), (w[3], w[4])) if mode != _MODE_ORDERED else ():
            if where + n > self.slot:
                return False  # a torn stamp: its check fails too, once the rest lands
            if n:
                check = self._hash(base + where, n, check)
                end = max(end, where + n)
        if mode == _MODE_RELAY:
            at, rlen = _align(end), w[7]
            if at + rlen > self.slot:
                return False
            check = self._hash(self._snap_addr + 56, 8, check)
            if rlen:
                check = self._hash(base + at, rlen, check)
        if check != w[6]:
            return False
        if mode == _MODE_RELAY:
            self._relay(i, s, at, rlen)
        self.got[i] = s
        return True

    def _relay(self, i: int, s: int, at: int, rlen: int) -> None:
        """Pass on the steps riding behind member ``i``'s verified step ``s`` (``rlen`` bytes from byte ``at`` of
        its slot): each rider's bytes, then its stamp, into the slot of ``i``'s bytes at that member of this host,
        as ``i``'s own write would have put them there (that member checks them as such)."""
        local = self._local(s % 2, i) + at
        off = 0
        while off < rlen:
            sub = self._own_np[local + off:local + off + STAMP].view(np.uint64) if off + STAMP <= rlen else None
            d = int(sub[7]) if sub is not None else -1
            end = max(int(sub[1]) + int(sub[2]), int(sub[3]) + int(sub[4])) if sub is not None else 0
            if (sub is None or int(sub[0]) != s or not 0 <= d < self.n or d == self.index or self.stamped[d]
                    or off + STAMP + end > rlen):
                raise AssertionError(f"hosts: member {i}'s step {s} carries a bad relayed step at byte {off} of "
                                     f"{rlen} (for member {d}, {end} bytes)")
            g, dst, src = self.members[d], self._slot_at(d, s % 2, i), local + off
            if end:
                self.t.put(g, dst + STAMP, self.own[src + STAMP:src + STAMP + end], op="hosts")
            self.t.put(g, dst, self.own[src:src + STAMP], op="hosts")
            off += STAMP + _align(end)

    def _here(self, i: int, s: int) -> bool:
        """Whether member ``i``'s step ``s`` arrived here (stamped, or signalled on this host)."""
        if self.got[i] >= s:
            return True
        if self.stamped[i]:
            return self._landed(i, s)
        v = self.t.load(self.me, self._arrived(i))
        if v >= s:
            self.got[i] = v
            return True
        return False

    def wait(self, need: Sequence[tuple[int, int]], *, op: str, timeout: float, sent: bool = False,
             hot: float = HOT) -> None:
        """Until member ``i``'s step ``target`` arrived here for each ``(i, target)`` (and, with ``sent``, this
        member's writes landed); the liveness rule meanwhile. This member's writes are polled either way, on
        every pass with ``sent``, else on every ``WRITES_EVERY``-th (a failed one is retried, or raises naming
        its peer, while this op still runs; each poll is a call into the engine). ``hot``: how long it yields
        before it naps (:data:`HOT`, :data:`HOT_SMALL`)."""
        start = time.monotonic()
        deadline, next_live, pause = start + timeout, start + self.watch.interval, 0.0
        writes, polls = self._sent, 0
        while True:
            late = [(i, target) for i, target in need if not self._here(i, target)]
            asked = bool(writes) and (sent or polls % WRITES_EVERY == 0)
            flying = sorted({i for i, w in writes if not self._done(w, op)}) if asked else []
            polls += 1
            if not late and not (sent and flying):
                if asked:
                    writes[:] = [(i, w) for i, w in writes if i in flying]
                return
            flying = flying if sent else []  # (only what this wait waits for is late)
            now = time.monotonic()
            if now >= next_live or now >= deadline:
                # a late member whose relay here is late too is not named (the relay is the cause), only watched,
                # as the relay of every late member is (it may be the one that never passed the step on)
                waiting = {i for i, _ in late}
                named = [(i, t) for i, t in late if self.relayed_by[i] not in waiting] or late
                watched = [self.members[i] for i, t in late if (i, t) not in named] + \
                    [self.members[self.relayed_by[i]] for i, _ in late if self.relayed_by[i] is not None]
                pending = list(dict.fromkeys([self.members[i] for i, _ in named] + [self.members[i] for i in flying]))
                self.watch.check(self.members, pending, op, waited=now - start, timeout=timeout, watched=watched)
                next_live = now + self.watch.interval
            if now >= deadline:
                label = self.watch.labels.get
                if not late:  # every step arrived, this member's own write never landed
                    names = [label(self.members[i], self.members[i]) for i in flying]
                    raise ZbcclTimeoutError(
                        f"{op}: timed out after {timeout:.1f}s waiting for this rank's write to ranks {names} to "
                        f"land, expected the transport to complete it, got no completion", ranks=tuple(names))
                late = named
                names = [label(self.members[i], self.members[i]) for i, _ in late]
                where = "; ".join(f"rank {label(self.members[i], self.members[i])} on "
                                  f"{self.watch.where(self.members[i])}" for i, _ in late)
                raise ZbcclTimeoutError(
                    f"{op}: timed out after {timeout:.1f}s waiting for ranks {names} ({where}), expected their "
                    f"step {need[0][1]} of this op, got none", ranks=tuple(names))
            pause = backoff(now - start, pause, hot=hot, left=deadline - now)
