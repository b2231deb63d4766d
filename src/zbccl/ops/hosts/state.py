"""A spanning communicator's state for the collectives across hosts: its meshes, its host group, agreement.

Made lazily and collectively on the communicator's first op (:func:`host_ops`), kept in its
``device_state["hosts"]`` and closed with it (destroy, finalize).

Setup (collective over the members, through the communicator's bootstrap store, sealed by the job
cookie when there is one): each rank reads its tuning table's inter-host choices (``tuner.hosts_settings``:
the defaults, or what its file's ``"hosts"`` section sets), proposes a chunk (``tuner.hosts_chunk``, at
most its tuned one), reserves its mesh regions in its heap, and all-gathers ``{"chunk", "world",
"column", "tune"}`` (or the error it hit, a bad tuning file included, so that every rank fails together).
Each record is parsed strictly; rank 0's choices are the communicator's (``HostOps.tune``), as rank 0's
table is on one host; the chunk is the smallest proposed, at most rank 0's; every region a peer announces
is checked against that peer's heap size. On a regular topology (every host holds the
same number L >= 2 of the members) the ranks of each host make a sub-communicator (``new_group``) for
the zero-buffer shm phases, and the ranks of one local index across the hosts form a column mesh.

Signal lines: the communicator's own comm slot in every rank's pad (its op channel never exists), from
line 16: the world mesh's n arrived words, then the column mesh's H.

**Agreement** (every op's first step on the world mesh): each rank puts a header (op, dtype, reduce op,
root, dim, sizes, its size vector, an error flag) in front of its first bytes to every peer. Every rank
reads every header and applies the same checks, so either every rank proceeds or every rank raises
:class:`~zbccl.errors.ZbcclInvalidUsageError` naming the disagreement (or the first rank's local error).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence

import numpy as np
import torch

from ...errors import ZbcclError, ZbcclInvalidUsageError, ZbcclOutOfMemoryError, ZbcclRemoteError
from ...heap import layout
from ...native.abi import OP_NAMES
from ..tuner import TuningTable, hosts_chunk, hosts_settings, validate_hosts
from .mesh import Mesh, Watch, region_bytes

__all__ = ["HostOps", "host_ops", "F", "NOTHING_BIG", "Got", "view_of"]

#: First line of the communicator's comm slot the meshes use (0-15: the op channel's lines, never used here).
LINE0 = 16
#: An offer in :meth:`HostOps.exchange`'s ``dests`` from a member that gets nothing over the direct threshold
#: from that peer: no place needed (and none to write: a put there is out of bounds).
NOTHING_BIG = -2
#: Seconds :meth:`HostOps.close` waits for writes a failed step left in flight (Mooncake fails a stalled
#: transfer within its own stall bound, 5 s).
DRAIN_S = 6.0
MAGIC = 0x7A62686F73740001  # "zbhost" + 1


class F:
    """Header words (int64), in front of a rank's first bytes to each peer."""

    MAGIC, OP, DTYPE, REDOP, ROOT, AUX, NUMEL, NUMEL_OUT, ERROR, ERRLEN, TO_YOU, MAXSEND, NVEC, SEQ, DEST, READY = \
        range(16)
    VEC = 16
    NAMES = {OP: "the op", DTYPE: "the dtype", REDOP: "the reduce op", ROOT: "the root (src)", AUX: "dim",
             NUMEL: "the size (elements)", NUMEL_OUT: "the output size (elements)"}


#: What :meth:`HostOps.exchange` hands ``consume`` per member: ``(address, bytes, base, offset)`` of bytes that
#: arrived from that member in a step, or of this rank's own; ``base`` (flat uint8) holds them from ``offset``
#: (:func:`view_of`). Addresses, so that a consumer copies or reduces them without making tensors.
Got = tuple[int, int, torch.Tensor, int]


def view_of(g: Got) -> torch.Tensor:
    """The bytes of ``g`` as a flat uint8 tensor (a view)."""
    return g[2][g[3]:g[3] + g[1]]


def _header_bytes(n: int) -> int:
    return (8 * (F.VEC + 2 * n) + 63) // 64 * 64


class HostOps:
    """See the module docstring. Not thread-safe: the communicator's op lock serialises its ops."""

    def __init__(self, comm, *, timeout: float) -> None:
        ctx = comm._ctx
        self.comm, self.ctx, self.t = comm, ctx, ctx.heap.transport
        n = self.n = comm.world_size
        self.me = comm.rank
        unreachable = [i for i, g in enumerate(comm.ranks) if not self.t.reachable(g)]
        if unreachable:
            raise ZbcclInvalidUsageError(
                f"collective: ranks {unreachable} are on other hosts and out of this transport's reach, expected "
                "the mooncake transport between hosts (pip install 'zbccl[internode]'), got none")
        topo = ctx.topology
        by_host: dict[int, list[int]] = {}
        for i, g in enumerate(comm.ranks):
            by_host.setdefault(topo.host_of(g), []).append(i)
        self.hosts = list(by_host.values())  # group ranks per host, hosts in order of their first member
        self.host_of = {i: h for h, rs in enumerate(self.hosts) for i in rs}
        H, L = len(self.hosts), len(self.hosts[0])
        self.regular = H >= 2 and L >= 2 and all(len(h) == L for h in self.hosts)
        self.H, self.L = H, L
        mine = self.hosts[self.host_of[self.me]]
        self.local_index = mine.index(self.me)
        self.column = [h[self.local_index] for h in self.hosts] if self.regular else []
        if LINE0 + n + H > layout.SLOT_BYTES // layout.LINE:
            raise ZbcclInvalidUsageError(
                f"collective: too many ranks for the collectives across hosts, expected at most "
                f"{layout.SLOT_BYTES // layout.LINE - LINE0 - 1} ranks and hosts together, got {n} ranks on {H} hosts")
        self.hdr = _header_bytes(n)
        self.labels = {g: i for i, g in enumerate(comm.ranks)}
        self.watch = Watch(ctx, self.labels)
        self.broken: str | None = None
        #: True once the current op failed on every rank together (its agreement): nothing is broken.
        self.together = False
        self.op_no = 0
        self.local = None
        self._blocks: list[int] = []
        self._plans: dict[tuple, _Plan] = {}
        #: The inter-host choices (``tuner.HOSTS_DEFAULTS``), rank 0's: set up in :meth:`_setup`.
        self.tune: dict = hosts_settings()
        self.direct_min = self.tune["direct_min"]
        #: Bytes this rank put straight into receivers' places (:meth:`exchange`'s ``dests``).
        self.direct_bytes = 0
        #: Whether the last :meth:`exchange` put pieces straight into places (they are there on return).
        self.direct_done = False
        self._heads = np.zeros((n, self.hdr // 8), dtype=np.int64)  # headers being agreed (exchange)
        try:
            self._setup(timeout)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------ setup
    def _setup(self, timeout: float) -> None:
        comm, ctx, n = self.comm, self.ctx, self.n
        ncol = len(self.column)
        record: dict = {}
        try:
            tune = hosts_settings(TuningTable.load().hosts)
            chunk = hosts_chunk(comm.heap_bytes, 2 * (n + ncol), tune["chunk"])
            record["chunk"], record["tune"] = chunk, tune
            for name, count, hdr in (("world", n, self.hdr), ("column", ncol, 0)):
                if not count:
                    record[name] = [-1, 0]
                    continue
                nbytes = region_bytes(count, hdr + chunk)
                off = ctx.sma.try_malloc(nbytes, kind="hosts")
                if off is None:
                    raise ZbcclOutOfMemoryError(
                        f"collective: the heap cannot hold this communicator's inter-host region, expected "
                        f"{nbytes} free bytes, got less (raise heap_size)")
                self._blocks.append(off)
                # zeroed before it is announced: no stamp of an earlier user of this memory can pass for a step
                self.t.zero(ctx.rank, off, nbytes, op="collective")
                record[name] = [off, nbytes]
        except ZbcclError as exc:
            record = {"error": f"{type(exc).__name__}: {exc}"}
        got = comm.bootstrap.all_gather(json.dumps(record).encode(), timeout=timeout, tag="hosts-setup",
                                        watch=comm.store_watch)
        recs = [self._parse(i, raw) for i, raw in enumerate(got)]
        bad = [(i, r["error"]) for i, r in enumerate(recs) if "error" in r]
        if bad:
            cls = ZbcclInvalidUsageError if bad[0][1].startswith(ZbcclInvalidUsageError.__name__) else \
                ZbcclOutOfMemoryError
            raise cls(f"collective: setting up the inter-host regions failed on rank {bad[0][0]}: {bad[0][1]}",
                      ranks=tuple(i for i, _ in bad))
        self.tune = recs[0]["tune"]
        self.direct_min = self.tune["direct_min"]
        self.chunk = min(min(r["chunk"] for r in recs), self.tune["chunk"])
        for i, r in enumerate(recs):  # every announced region must lie in that rank's heap and hold the slots
            for name, count, hdr in (("world", n, self.hdr), ("column", ncol, 0)):
                off, nbytes = r[name]
                need = region_bytes(count, hdr + self.chunk)
                size = self.t.size(comm.ranks[i])
                if count and (off < 0 or off % 64 or nbytes < need or off + nbytes > size):
                    raise ZbcclRemoteError(
                        f"collective: rank {i} announced a bad {name} region, expected {need}+ bytes at a 64-byte "
                        f"aligned offset within its heap of {size}, got offset {off} and {nbytes} bytes", ranks=(i,))
        slot_line = layout.slot_line
        self.world = Mesh(ctx, comm.ranks, [r["world"][0] for r in recs], self.hdr + self.chunk,
                          slot_line(comm.slot, LINE0), self.watch, relay=self.tune["relay"])
        # where each member's header lands in this rank's slots, per parity (int64 words; views, made once)
        self._came = [[self.world.view_np(parity, i, self.hdr).view(np.int64) for i in range(n)] for parity in (0, 1)]
        self._came_mv = [[memoryview(self.world.view_np(parity, i, self.hdr)) for i in range(n)] for parity in (0, 1)]
        self.col = None
        if self.regular:
            members = [comm.ranks[i] for i in self.column]
            self.col = Mesh(ctx, members, [recs[i]["column"][0] for i in self.column], self.chunk,
                            slot_line(comm.slot, LINE0 + n), self.watch)
            self.local = _host_group(comm, [comm.ranks[i] for i in self.hosts[self.host_of[self.me]]], timeout)

    def _parse(self, i: int, raw: bytes) -> dict:
        """Rank ``i``'s setup record, strictly: nothing from the store is trusted."""
        try:
            rec = json.loads(raw.decode())
        except (UnicodeDecodeError, ValueError):
            rec = None
        ok = isinstance(rec, dict)
        if ok and "error" in rec:
            ok = set(rec) == {"error"} and isinstance(rec["error"], str)
        elif ok:
            ok = (set(rec) == {"chunk", "world", "column", "tune"} and _int(rec["chunk"])
                  and 4096 <= rec["chunk"] <= 1 << 30 and rec["chunk"] % 64 == 0
                  and all(isinstance(rec[k], list) and len(rec[k]) == 2 and all(map(_int, rec[k]))
                          for k in ("world", "column")))
            try:
                ok = ok and bool(validate_hosts(rec["tune"], source=f"rank {i}'s setup record", whole=True))
            except ZbcclInvalidUsageError:
                ok = False
        if not ok:
            raise ZbcclRemoteError(f"collective: rank {i}'s inter-host setup record is malformed, expected "
                                   f"{{chunk, world, column, tune}}, got {raw[:80]!r}", ranks=(i,))
        return rec

    def settle(self, timeout: float) -> None:
        """Wait until this rank's writes still in flight from its last steps landed (a step returns once its
        peers' bytes arrived: ``mesh.py``'s protocol, step 3); what a reader of the transport's counters of
        completed transfers needs first. Not collective."""
        for mesh in (getattr(self, "world", None), getattr(self, "col", None)):
            if mesh is not None:
                mesh.wait([], op="settle", timeout=timeout, sent=True)

    def close(self) -> None:
        """Free the regions and end the host group (collectively at destroy; locally once finalized, where the
        meshes are drained and the regions freed once every op of this rank left: another thread may still be
        inside one, stepping the same meshes)."""
        local, self.local = self.local, None
        if self.ctx.forked:
            return
        if self.ctx.finalized:
            self.ctx.after_ops.append(self._release)
            return
        self._release()
        if local is not None and not local.destroyed:
            local.destroy()

    def _release(self) -> None:
        """Drain the meshes (writes a failed step left in flight read their staging buffers), free the regions."""
        for mesh in (getattr(self, "world", None), getattr(self, "col", None)):
            if mesh is not None:
                mesh.drain(DRAIN_S)
        blocks, self._blocks = self._blocks, []
        for off in blocks:
            self.ctx.sma.free(off)

    # ------------------------------------------------------------ the agreement step
    def exchange(self, op: str, opcode: int, fields: dict[int, int], vec: Sequence[int], error: str | None,
                 sends: list[torch.Tensor | None], consume: Callable | None, *, timeout: float,
                 same: Sequence[int] = (), same_vec: bool = False, pairwise: bool = False,
                 error_kind: int = 1, dests: Sequence[int] | None = None, heads: bool = False) -> list[np.ndarray]:
        """The flat exchange among all members with the agreement in its first step: ``sends[i]`` (flat uint8, or
        None) to member ``i`` (``sends[me]``: this rank's own part, handed to ``consume``), through the slots in
        chunks; ``consume(got, at)`` gets per member the bytes that arrived in a step (:data:`Got`, valid until the next
        step) and their byte offset in that member's bytes. Returns every member's header with ``heads`` (else
        nothing). Raises together on a disagreement or a rank's ``error``.

        ``dests``: given by the ops whose bytes land in place (all_gather, all_to_all, broadcast; None for the
        reductions), on every rank: per member, the offset in this rank's heap where that member's bytes for it
        go (-1: no such place; ``NOTHING_BIG``: none needed). A piece over ``direct_min`` bytes then skips the
        slots: once every member offered a place for everything it receives (the headers say), each such piece
        is one put into its place, and a step without bytes publishes them; otherwise they go through the slots,
        one step later than the rest (the agreement step did not carry them)."""
        mesh, n, me, chunk, H = self.world, self.n, self.me, self.chunk, self.hdr
        self.op_no += 1
        self._own_error = error
        if error is not None:
            raw = error.encode()[:chunk]
            sends = [torch.tensor(list(raw), dtype=torch.uint8) if raw else None] * n
        lens = [0 if s is None else s.numel() for s in sends]
        big = min(self.direct_min, chunk) if dests is not None else 1 << 62  # pieces over it: never eager
        places = [-1] * n if dests is None or error is not None else list(dests)
        ready = int(all(places[i] != -1 for i in range(n) if i != me))
        key = (opcode, tuple(fields.items()), tuple(vec), tuple(lens), tuple(places), big)
        plan = self._plans.get(key) if error is None else None
        if plan is None:
            plan = _Plan(H, n, me, opcode, fields, vec, lens, error, error_kind, places, ready)
            if error is None:
                if len(self._plans) >= _PLANS:
                    self._plans.clear()
                self._plans[key] = plan
        for words in plan.words:
            words[F.SEQ] = self.op_no
        first: list[torch.Tensor | None] = [None] * n  # the first chunk, uncopied (the mesh stages what it joins)
        for i in range(n):
            if i != me and 0 < lens[i] <= big:
                first[i] = sends[i] if lens[i] <= chunk else sends[i][:chunk]
        parity = mesh.step(plan.pieces, op=op, timeout=timeout, before=first, before_at=H)
        if not plan.matches(self._came_mv[parity], self.op_no):  # headers not seen and agreed on before
            got_heads, came = self._heads, self._came[parity]
            for i in range(n):
                np.copyto(got_heads[i], plan.own if i == me else came[i])
            try:
                self._agree(op, got_heads, same, same_vec, pairwise, parity)
            except (ZbcclInvalidUsageError, ZbcclOutOfMemoryError):
                self.together = True  # every rank raises it: the communicator stays in step
                raise
            to_me = got_heads[:, F.TO_YOU].tolist()
            late_out = [int(i != me and lens[i] > big) for i in range(n)]  # 1: not in the agreement step
            late_in = [int(i != me and to_me[i] > big) for i in range(n)]
            direct = (any(late_out) or any(late_in)) and all(got_heads[:, F.READY].tolist())
            most = max(got_heads[:, F.MAXSEND].tolist())
            plan.agree(got_heads, me, (to_me, late_out, late_in, direct,
                                       max(1, math.ceil(most / chunk) + int(most > big))))
        # (a function of the headers, ``big`` and ``chunk``, all fixed by the plan's key and agreed headers)
        to_me, late_out, late_in, self.direct_done, steps = plan.derived
        if self.direct_done:
            self._direct(op, sends, late_out, plan.agreed, timeout, consume, parity, to_me, big)
            return plan.heads(self.op_no) if heads else []
        own = sends[me]
        own_at = own.data_ptr() if own is not None else 0
        region, region_at = mesh.own, mesh.own_addr
        for k in range(steps):
            if k:
                part: list[torch.Tensor | None] = [None] * n
                for i, s in enumerate(sends):
                    lo = (k - late_out[i]) * chunk
                    if s is not None and i != me and 0 <= lo < lens[i]:
                        part[i] = s[lo:lo + chunk]
                parity = mesh.step(part, op=op, timeout=timeout, at=H)
            if consume is None:
                continue
            got: list[Got | None] = []
            at = [(k - late_in[i]) * chunk for i in range(n)]
            for i in range(n):
                m = max(0, min(chunk, to_me[i] - at[i])) if at[i] >= 0 else 0
                if i == me:
                    got.append(None if own is None else (own_at + at[i], m, own, at[i]))
                else:
                    off = mesh.offset(parity, i, m, at=H)
                    got.append((region_at + off, m, region, off))
            consume(got, at)
        return plan.heads(self.op_no) if heads else []

    def _direct(self, op: str, sends: list[torch.Tensor | None], late_out: list[int], heads: np.ndarray,
                timeout: float, consume: Callable | None, parity: int, to_me: list[int], big: int) -> None:
        """The rest of :meth:`exchange` once every member offered a place: what came in the agreement step is
        consumed, each late piece is put into its receiver's place (all in flight at once, until all landed),
        then a step without bytes tells every peer that this rank's pieces landed."""
        mesh, n, me = self.world, self.n, self.me
        if consume is not None:
            got: list[Got | None] = []
            for i in range(n):
                if i == me:
                    own = sends[me]
                    got.append(None if own is None else (own.data_ptr(), own.numel(), own, 0))
                elif 0 < to_me[i] <= big:
                    off = mesh.offset(parity, i, to_me[i], at=self.hdr)
                    got.append((mesh.own_addr + off, to_me[i], mesh.own, off))
                else:
                    got.append(None)
            consume(got, [0] * n)
        for i in range(n):  # every piece in flight at once, then all landed
            if late_out[i]:
                mesh.track(i, self.t.put_async(self.comm.ranks[i], int(heads[i, F.DEST]), sends[i], op=op))
                self.direct_bytes += sends[i].numel()
        mesh.wait([], op=op, timeout=timeout, sent=True)
        mesh.step([None] * n, op=op, timeout=timeout)

    def _agree(self, op: str, heads: np.ndarray, same: Sequence[int], same_vec: bool, pairwise: bool,
               parity: int) -> None:
        """Every rank applies these checks to the same headers: all raise, or none does."""
        n = self.n
        bad = [i for i, h in enumerate(heads) if h[F.MAGIC] != MAGIC or h[F.SEQ] != self.op_no]
        if bad:
            got = {i: (int(heads[i][F.MAGIC]), int(heads[i][F.SEQ])) for i in bad}
            raise ZbcclRemoteError(f"{op}: ranks {bad} are out of step, expected op #{self.op_no} of this "
                                   f"communicator, got (magic, op number) {got}", ranks=tuple(bad))
        errs = [i for i, h in enumerate(heads) if h[F.ERROR]]
        if errs:
            i = errs[0]
            cls = ZbcclOutOfMemoryError if heads[i][F.ERROR] == 2 else ZbcclInvalidUsageError
            if i == self.me:
                raise cls(self._own_error, ranks=tuple(errs))
            raw = self.world.view(parity, i, self.hdr + int(heads[i][F.ERRLEN]))[self.hdr:]
            text = bytes(raw.numpy()).decode(errors="replace")
            raise cls(f"{text} (on rank {i})", ranks=tuple(errs))
        ops = [int(h[F.OP]) for h in heads]
        if len(set(ops)) > 1:
            raise ZbcclInvalidUsageError(
                f"{op}: the ranks disagree on the op (they run different ops), expected the same collective on every "
                f"rank, got { {i: OP_NAMES.get(o, o) for i, o in enumerate(ops)} }", ranks=tuple(range(n)))
        for f in same:
            vals = [int(h[f]) for h in heads]
            if len(set(vals)) > 1:
                raise ZbcclInvalidUsageError(
                    f"{op}: the ranks disagree on {F.NAMES[f]}, expected one value on every rank, got "
                    f"{dict(enumerate(vals))}", ranks=tuple(i for i, v in enumerate(vals) if v != vals[0]))
        vecs = [h[F.VEC:F.VEC + int(h[F.NVEC])].tolist() for h in heads]
        if same_vec and any(v != vecs[0] for v in vecs):
            raise ZbcclInvalidUsageError(
                f"{op}: the ranks disagree on the sizes, expected one list on every rank, got {dict(enumerate(vecs))}",
                ranks=tuple(i for i, v in enumerate(vecs) if v != vecs[0]))
        if pairwise:  # all_to_all: q's input split for r equals r's output split for q
            for q in range(n):
                for r in range(n):
                    if vecs[q][r] != vecs[r][n + q]:
                        raise ZbcclInvalidUsageError(
                            f"{op}: splits disagree, expected rank {q}'s input split for rank {r} to equal rank "
                            f"{r}'s output split for rank {q}, got {vecs[q][r]} and {vecs[r][n + q]} elements",
                            ranks=(q, r))


#: Plans (:class:`_Plan`) a communicator keeps, one per distinct op signature; all dropped when full.
_PLANS = 64


class _Plan:
    """One op signature's headers (op, fields, sizes, this rank's error), built once: ``words[j]`` (int64) is
    the header for the ``j``-th peer, ``pieces`` the same memory as uint8 tensors for the mesh (``None`` for this
    rank), ``own`` this rank's own header; only ``F.SEQ`` changes from op to op. ``agreed``: every member's
    headers (``F.SEQ`` aside) the last time they passed the agreement: headers equal to them pass again,
    unchecked (:meth:`HostOps._agree` is a function of the headers alone), and what the exchange derives from them
    (``derived``) holds again; ``expect``: per peer, its agreed header's bytes before and after ``F.SEQ`` (what
    :meth:`matches` compares an arrived header with, without copying it)."""

    __slots__ = ("words", "pieces", "own", "agreed", "derived", "expect")

    def __init__(self, H: int, n: int, me: int, opcode: int, fields: dict[int, int], vec: Sequence[int],
                 lens: list[int], error: str | None, error_kind: int, places: list[int], ready: int) -> None:
        hdr = np.zeros(H // 8, dtype=np.int64)
        hdr[F.MAGIC], hdr[F.OP] = MAGIC, opcode
        for k, v in fields.items():
            hdr[k] = v
        if error is not None:
            hdr[F.ERROR], hdr[F.ERRLEN], vec = error_kind, lens[0], []
        hdr[F.NVEC] = len(vec)
        hdr[F.VEC:F.VEC + len(vec)] = vec
        hdr[F.MAXSEND] = max([lens[i] for i in range(n) if i != me] or [0])
        hdr[F.READY] = ready
        self.words, self.pieces = [], []
        for i in range(n):
            w = hdr.copy()
            w[F.TO_YOU], w[F.DEST] = lens[i], places[i]
            self.words.append(w)
            self.pieces.append(None if i == me else torch.from_numpy(w.view(np.uint8)))
        self.own = self.words[me]
        self.agreed: np.ndarray | None = None
        #: What :meth:`HostOps.exchange` derives from ``agreed``: (to_me, late_out, late_in, direct_done, steps).
        self.derived: tuple = ()
        self.expect: list[tuple[int, bytes, bytes]] = []

    def agree(self, heads: np.ndarray, me: int, derived: tuple) -> None:
        """Every member's headers (``heads``) passed the agreement: keep them, and what was derived from them."""
        self.agreed, self.derived = heads.copy(), derived
        k = F.SEQ * 8
        rows = [row.tobytes() for row in self.agreed]
        self.expect = [(i, row[:k], row[k + 8:]) for i, row in enumerate(rows) if i != me]

    def matches(self, came: list[memoryview], op_no: int) -> bool:
        """Whether the headers that arrived (``came[i]``: member ``i``'s, in this rank's slot) are the agreed ones of
        op ``op_no`` (this rank's own always is: it is this plan's)."""
        if self.agreed is None:
            return False
        seq = op_no.to_bytes(8, "little", signed=True)
        for i, pre, post in self.expect:
            if came[i].tobytes() != pre + seq + post:
                return False
        return True

    def heads(self, op_no: int) -> list[np.ndarray]:
        """Every member's header of op ``op_no`` (the agreed ones: the op passed :meth:`matches` or the agreement)."""
        out = self.agreed.copy()
        out[:, F.SEQ] = op_no
        return list(out)


def _int(x) -> bool:
    return type(x) is int


def _host_group(comm, members: list[int], timeout: float):
    """The members of this rank's host as a sub-communicator (collective over them: every host makes its own)."""
    from ...runtime.communicator import Communicator

    make = Communicator.new_group.__wrapped__  # the spanning communicator's op lock is held by this op
    local = make(comm, [comm.ranks.index(g) for g in members], timeout=timeout)
    assert local._single_host, "a host group spans hosts"
    return local


def host_ops(comm, *, timeout: float) -> HostOps:
    """``comm``'s :class:`HostOps`, made (collectively) on its first op across hosts."""
    state = comm.device_state.get("hosts")
    if state is None:
        state = comm.device_state["hosts"] = HostOps(comm, timeout=timeout)
    return state


