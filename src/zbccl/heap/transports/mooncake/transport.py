"""The mooncake transport: ranks on other hosts, reached by one-sided Mooncake reads and writes.

Every rank runs one Mooncake Transfer Engine (P2P handshake: no metadata
server) and registers, once each, its signal pad, its data segment's initial
range, each growth step and its control region (``memory.py``). Nothing of a
peer is mapped here: every access to a remote rank is a transfer, bounds-checked
twice (here against the peer's published size, and by the peer's engine
against its registrations, so a bad address touches nothing).

Protocol (collective over the ranks served; ``establish``):

1. each rank reserves its memory (or adopts the shm segment it already has,
   :meth:`MooncakeTransport.attach`), starts its engine on the address that
   routes to the store's host (``ZBCCL_MOONCAKE_HOST`` overrides), registers
   and writes its growth table;
2. bootstrap all-gather of ``{session id, ip, port, hostname, pad, data,
   ctrl, reserve}`` (or the error it hit, so every rank fails together),
   sealed with the job cookie's key when ``ZBCCL_JOB_COOKIE`` is set (a
   record the cookie does not open is refused on every rank);
3. each rank reads every peer's growth table once (the handshake, and a
   check that the peer's engine answers), then all-gather again with any
   error; the liveness and fetch_add threads start.

Verbs on a remote rank:

* ``put``/``get``/``get_into``/``zero``: one write/read each, split at the
  peer's registration boundaries (a transfer may not span two); complete when
  the call returns (TCP protocol v2: the bytes landed). Submitted
  asynchronously and awaited without spinning (``MooncakeEngine._await``),
  giving up on a peer the monitor finds lost. ``put_many``: every piece
  checked, then all in flight at once (no order among them).
* ``signal``: an 8-byte write into the peer's pad, ordered after every
  earlier write of this process to that peer (v2 completion). ``load``: an
  8-byte read. ``wait_until``: polls local words in place and remote words by
  one batched read per peer, backing off to 1 ms, checking liveness every
  ``liveness`` seconds (dead: :class:`~zbccl.errors.ZbcclRemoteError`;
  unreachable for ``STALL`` seconds: :class:`~zbccl.errors.ZbcclTimeoutError`
  naming the host). ``fetch_add``: executed by the owner (``atomics.py``).
* Views of a remote rank are impossible (its memory is not in this process):
  :meth:`view`, :meth:`pad_view` and the native addresses raise
  :class:`~zbccl.errors.ZbcclInvalidUsageError` saying so; views of this
  rank's own memory work as on shm. :meth:`viewable` tells them apart.

Liveness: ``liveness.Monitor`` (no pidfds across hosts). The store records: ``records.py``.
"""

from __future__ import annotations

import ctypes
import math
import socket
import threading
import time
from collections.abc import Callable, Sequence

import torch

from .... import env
from ....bootstrap.base import Bootstrap
from ....bootstrap.secret import JobSecret
from ....bootstrap.topology import Topology
from ....errors import (
    ZbcclError,
    ZbcclInvalidUsageError,
    ZbcclOutOfMemoryError,
    ZbcclRemoteError,
    ZbcclSystemError,
    ZbcclTimeoutError,
)
from ... import flags, layout
from ..base import DONE, NativeHandle, Pending, Segment, SignalPad, Transport, _as_bytes
from ..shm.mapping import prefault, tensor_at
from .atomics import AtomicServer
from .engine import MooncakeEngine, load, local_address
from .liveness import STALL, Monitor, Peer, backoff
from .memory import CTRL_MAIL, CTRL_TABLE, MAX_STEPS, ctrl_layout, parse_table, release, reserve, split_at
from .records import cookie_secret, exchange, peer_of, store_host

__all__ = ["MooncakeTransport"]

_PAD = layout.CTRL_BYTES
# The control region's scratch: [monitor word][atomic-server words][staged words ...][a growth table read].
_S_MONITOR, _S_SERVER, _S_WORDS, _S_TABLE = 0, 64, 128, 2048
_WORDS = (_S_TABLE - _S_WORDS) // 8
_ZERO_CHUNK = 1 << 20
#: Retries of a transfer that failed while its peer still answers (a reset connection).
_RETRIES = 2
#: Seconds :meth:`MooncakeTransport.close` waits for its monitor and atomics server to end (each ends at once,
#: unless inside a transfer to a host behind a cut link: then the engine is retired after it, see ``close``).
STOP_WAIT_S = 1.0


class MooncakeTransport(Transport):
    """Ranks reached through Mooncake Transfer Engine (see the module docstring)."""

    name = "mooncake"

    def __init__(self, *, device: torch.device | str = "cpu", populate: bool = True) -> None:
        super().__init__(device=device)
        if self.device.type != "cpu":
            raise ZbcclInvalidUsageError(
                f"heap: the mooncake transport holds host memory here, expected device cpu, got {self.device}")
        load()  # a missing wheel or libibverbs1 fails here, saying how to install it
        self.populate = populate
        self.rank = -1
        self.engine: MooncakeEngine | None = None
        self.peers: dict[int, Peer] = {}
        self.segments: dict[int, Segment] = {}
        self._pad = self._data = self._ctrl = 0
        self._own_map: tuple[int, int] | None = None  # (addr, bytes) of memory this transport reserved
        self._ctrl_map: tuple[int, int] | None = None
        self._reply = 0
        self._ends: dict[int, list[int]] = {}  # rank -> data ends after each registration (own: exact)
        self._lock = threading.Lock()  # the scratch words
        self._pending_lock = threading.Lock()  # polls of the writes put_async started (_Write.done)
        self._amo_lock = threading.Lock()
        self._amo_seq = 0
        self._prims = flags.primitives()
        self._monitor: Monitor | None = None
        self._server: AtomicServer | None = None
        self._secret: JobSecret | None = None
        self._own_flat: torch.Tensor | None = None
        self._native = _MooncakeNative(self)
        self._rank_of_sid: dict[str, int] = {}
        #: Data bytes this rank moved to and from remote ranks through put/zero and get/get_into (not the signal
        #: words, nor the growth tables): what crossed the network for the protocols above, for tests and benchmarks.
        self.bytes_put = self.bytes_got = 0

    # ------------------------------------------------------------ lifecycle
    def establish(self, bootstrap: Bootstrap, topology: Topology, *, data_bytes: list[int], job_id: str,
                  timeout: float, reserve_bytes: list[int] | None = None) -> dict[int, Segment]:
        reserve_ = list(data_bytes) if reserve_bytes is None else list(reserve_bytes)
        me = bootstrap.rank
        addr, error = 0, None
        try:
            addr = reserve(layout.segment_bytes(reserve_[me]))
            self._own_map = (addr, layout.segment_bytes(reserve_[me]))
            if self.populate:
                prefault(addr, _PAD + data_bytes[me])
        except ZbcclError as exc:
            error = exc
        peers = [r for r in range(bootstrap.world_size) if r != me]
        return self.attach(bootstrap, topology, pad=addr, data=addr + _PAD, data_bytes=data_bytes,
                           reserve_bytes=reserve_, peers=peers, job_id=job_id, timeout=timeout, error=error)

    def attach(self, bootstrap: Bootstrap, topology: Topology, *, pad: int, data: int, data_bytes: list[int],
               reserve_bytes: list[int], peers: list[int], job_id: str, timeout: float,
               error: ZbcclError | None = None) -> dict[int, Segment]:
        """Collective over every rank of ``bootstrap``: serve this rank's memory at ``pad``/``data`` (its own,
        or an shm segment the caller owns) through Mooncake, and reach ``peers``. Fails on every rank together."""
        me = self.rank = bootstrap.rank
        world = bootstrap.world_size
        self._secret = cookie_secret(job_id)
        key = f"zbccl/mooncake/{job_id}"
        try:
            record = None
            if error is None:
                try:
                    record = self._open(bootstrap, pad, data, data_bytes[me], reserve_bytes[me], world,
                                        multi_host=len(topology.hosts) > 1)
                except ZbcclError as exc:
                    error = exc
            got = exchange(bootstrap, self._secret, record, error, timeout=timeout, key=f"{key}/up", tag="mooncake")
            self.segments[me] = Segment(me, data_bytes[me], "cpu", owner=True, reserved=reserve_bytes[me])
            for r in peers:
                self.peers[r] = peer_of(r, got[r], reserve_bytes[r])
                self.segments[r] = Segment(r, data_bytes[r], "cpu", owner=False, reserved=reserve_bytes[r])
            self._monitor = Monitor(self.engine, self.peers, self._ctrl + self._scratch() + _S_MONITOR,
                                    period=max(env.LIVENESS_INTERVAL.get(), 0.25), stall=STALL)
            self._rank_of_sid = {p.sid: r for r, p in self.peers.items()}
            self.engine.lost = self._lost
            try:
                for r in peers:  # the handshake with each peer, and its first growth table
                    self._refresh(r, op="heap: connecting to a peer's engine")
            except ZbcclError as exc:
                error = exc
            exchange(bootstrap, self._secret, {}, error, timeout=timeout, key=f"{key}/reached", tag="mooncake-reached")
            self._start_threads(world)
        except BaseException:
            self.close(unmap=True)
            raise
        return dict(self.segments)

    def _open(self, bootstrap: Bootstrap, pad: int, data: int, nbytes: int, reserved: int, world: int, *,
              multi_host: bool) -> dict:
        """Engine up, this rank's memory registered, its growth table written; the record peers need."""
        self.engine = MooncakeEngine(local_address(store_host(bootstrap), multi_host=multi_host),
                                     protocol=env.MOONCAKE_PROTOCOL.get(), device=env.MOONCAKE_DEVICE.get())
        self._reply, _, ctrl_bytes = ctrl_layout(world)
        self._ctrl = reserve(ctrl_bytes)
        self._ctrl_map = (self._ctrl, ctrl_bytes)
        prefault(self._ctrl, ctrl_bytes)
        self._pad, self._data = pad, data
        for addr, n in ((pad, _PAD), (data, nbytes), (self._ctrl, ctrl_bytes)):
            if n:
                self.engine.register(addr, n)
        self._ends[self.rank] = [nbytes]
        self._prims.store_release(self._ctrl + CTRL_TABLE + 8, nbytes)
        self._prims.store_release(self._ctrl + CTRL_TABLE, 1)
        return {"sid": self.engine.session_id, "ip": self.engine.host, "port": self.engine.rpc_port,
                "hostname": socket.gethostname(), "pad": pad, "data": data, "ctrl": self._ctrl,
                "transport": self.engine.transport}

    def _start_threads(self, world: int) -> None:
        if not self.peers:
            return
        self._monitor.start()
        self._server = AtomicServer(self.engine, self.peers, ctrl=self._ctrl, reply_offset=self._reply,
                                    scratch=self._ctrl + self._scratch() + _S_SERVER, word_addr=self._own_word,
                                    prims=self._prims, load=self._prims.load_acquire)
        self._server.start()

    def _scratch(self) -> int:
        return self._reply + layout.PAGE

    def grow(self, nbytes: int) -> None:
        """Owner only: back ``nbytes`` of data (reserved at establish), register the new range, publish it."""
        seg = self.segments.get(self.rank)
        if seg is None or self._own_map is None:
            raise ZbcclSystemError("heap: grow: this transport holds no segment of its own to grow")
        if nbytes <= seg.nbytes:
            return
        if nbytes > seg.reserved:
            raise ZbcclOutOfMemoryError(
                f"heap: grow: heap of {nbytes} bytes requested, expected at most the {seg.reserved} reserved")
        self.check_growth()
        if self.populate:
            prefault(self._data + seg.nbytes, nbytes - seg.nbytes)
        self.register_growth(nbytes)
        self._prims.signal(self._pad + layout.H_HEAP_BYTES, nbytes)

    def check_growth(self) -> None:
        """Raise :class:`~zbccl.errors.ZbcclOutOfMemoryError` when no growth step is left to register."""
        if len(self._ends[self.rank]) >= MAX_STEPS:
            raise ZbcclOutOfMemoryError(
                f"heap: grow: too many growth steps, expected at most {MAX_STEPS - 1} (Mooncake registrations), "
                f"got one more; start with a larger heap_size")

    def register_growth(self, nbytes: int) -> None:
        """Register ``[old size, nbytes)`` of this rank's data (backed already) and publish the new size."""
        self.check_growth()
        ends = self._ends[self.rank]
        old = ends[-1]
        self.engine.register(self._data + old, nbytes - old)
        # The end first, then the count: a peer that reads the count reads every end below it.
        self._prims.store_release(self._ctrl + CTRL_TABLE + 8 * (len(ends) + 1), nbytes)
        ends.append(nbytes)
        self._prims.store_release(self._ctrl + CTRL_TABLE, len(ends))
        self.segments[self.rank].nbytes = nbytes

    def close(self, *, unmap: bool) -> None:
        """Local. The liveness monitor and the atomics server are stopped, and the engine unregisters everything
        (no peer write lands here from now on). The engine and the control region (where those threads' transfers
        land) go once the threads ended; a thread still inside a transfer to a host behind a cut link after
        ``STOP_WAIT_S`` (Mooncake may hold it for minutes) is left to end on its own, and a daemon thread ends the
        engine after it: closing never waits for an unreachable host."""
        threads = [t for t in (self._monitor, self._server) if t is not None]
        self._monitor = self._server = None
        stuck = [t for t in threads if not t.stop(STOP_WAIT_S)]
        engine, ctrl = self.engine, self._ctrl_map
        self.engine, self._ctrl_map, self._own_flat = None, None, None
        if engine is not None:
            engine.unregister()

        def finish() -> None:
            for t in stuck:
                t.join()
            if engine is not None:
                engine.close()
            if ctrl is not None:  # nobody views the control region: it goes with the engine
                release(*ctrl)

        if stuck:
            threading.Thread(target=finish, name="zbccl-mooncake-retire", daemon=True).start()
        else:
            finish()
        if unmap:
            if self._own_map is not None:
                release(*self._own_map)
                self._own_map = None
            self.peers.clear()
            self.segments.clear()
            self._ends.clear()

    # ------------------------------------------------------------ geometry
    def reachable(self, rank: int) -> bool:
        return rank == self.rank and self.engine is not None or rank in self.peers

    def viewable(self, rank: int) -> bool:
        """Only this rank's own memory can be viewed: a remote rank's is not in this process."""
        return rank == self.rank and rank in self.segments

    def size(self, rank: int) -> int:
        if rank == self.rank:
            seg = self.segments.get(rank)
            return seg.nbytes if seg is not None else 0
        if rank not in self.peers:
            return 0
        return self._refresh(rank, op="size")[-1]

    def signal_pad(self, rank: int) -> SignalPad:
        return SignalPad(rank, _PAD, self.LINE)

    def _known_size(self, rank: int, end: int, op: str) -> int:
        """A size of ``rank`` covering ``end`` if its owner published one (the cached size first: sizes only grow)."""
        if rank == self.rank:
            return self.size(rank)
        ends = self._ends.get(rank)
        if ends and end <= ends[-1]:
            return ends[-1]
        return self._refresh(rank, op=op)[-1] if rank in self.peers else 0

    def _refresh(self, rank: int, *, op: str) -> list[int]:
        """Read ``rank``'s growth table (acquire: covers every size its owner published before a signal we saw)."""
        peer = self.peers[rank]
        with self._lock:
            local = self._ctrl + self._scratch() + _S_TABLE
            self._run(rank, op, "a read of its growth table",
                      lambda: self.engine.read(peer.sid, local, peer.ctrl + CTRL_TABLE, 8 * (MAX_STEPS + 1)))
            words = list((ctypes.c_int64 * (MAX_STEPS + 1)).from_address(local))
        ends = parse_table(words, peer.reserve)
        if ends is None:
            raise ZbcclRemoteError(
                f"{op}: rank {rank}'s growth table is corrupt, expected 1 to {MAX_STEPS} increasing sizes up to "
                f"{peer.reserve}, got count {words[0]} and sizes {words[1:9]}", ranks=(rank,))
        self._ends[rank] = ends
        self.segments[rank].nbytes = ends[-1]
        return ends

    def _check(self, rank: int, offset: int, nbytes: int, op: str) -> None:
        if not self.reachable(rank):
            self.check_data(rank, offset, nbytes, op=op)  # raises, naming the rank
        size = self._known_size(rank, offset + max(nbytes, 0), op)
        if offset < 0 or nbytes < 0 or offset + nbytes > size:
            raise ZbcclInvalidUsageError(
                f"{op}: out of bounds of rank {rank}'s heap, expected [offset, offset+nbytes) within "
                f"[0, {size}), got offset={offset} nbytes={nbytes}")

    def _pieces(self, rank: int, offset: int, nbytes: int) -> list[tuple[int, int]]:
        return split_at(self._ends[rank], offset, nbytes)

    def _xfer(self, rank: int, write: bool, local: int, remote: int, nbytes: int, op: str, what: str) -> None:
        """One transfer between ``local`` (this process) and ``remote`` (registered memory of ``rank``)."""
        sid = self.peers[rank].sid
        self._run(rank, op, what,
                  lambda: self.engine.transfer(sid, write, local, remote, nbytes))

    # ------------------------------------------------------------ views (this rank's own memory only)
    def _no_view(self, rank: int, what: str, op: str) -> ZbcclInvalidUsageError:
        return ZbcclInvalidUsageError(
            f"{op}: a view of rank {rank}'s {what} is impossible here, expected a rank whose memory is in this "
            f"process (rank {self.rank}), got rank {rank}, reached through Mooncake on another host: copy with "
            "get/get_into and write with put")

    def view(self, rank: int, offset: int, shape: Sequence[int], dtype: torch.dtype, *,
             stride: Sequence[int] | None = None, release: Callable[[], None] | None = None,
             op: str = "view") -> torch.Tensor:
        isz = dtype.itemsize
        if stride is None:
            span = isz * math.prod(shape)
        else:
            span = 0 if 0 in shape else (sum((n - 1) * st for n, st in zip(shape, stride)) + 1) * isz
        if offset % isz:
            raise ZbcclInvalidUsageError(
                f"{op}: offset not aligned to {dtype}, expected a multiple of {isz}, got {offset}")
        if rank != self.rank or offset < 0 or span < 0 or offset + span > self.size(rank):
            self._check(rank, offset, span, op)  # raises when out of bounds (or the rank is unknown)
            raise self._no_view(rank, "heap", op)
        if release is None:
            flat = self._own_bytes(offset + span)[offset:offset + span]
        else:
            flat = tensor_at(self._data + offset, span, release)
        typed = flat.view(dtype)
        return typed.view(shape) if stride is None else typed.as_strided(shape, stride)

    def _own_bytes(self, end: int) -> torch.Tensor:
        flat = self._own_flat
        if flat is None or flat.numel() < end:
            flat = self._own_flat = tensor_at(self._data, self.size(self.rank))
        return flat

    def pad_view(self, rank: int, line: int, nbytes: int, *, op: str = "signal pad") -> torch.Tensor:
        self.check_pad(rank, line, nbytes, op=op)
        if rank != self.rank:
            raise self._no_view(rank, "signal pad", op)
        return tensor_at(self._pad + line, nbytes)

    def offset_of(self, rank: int, t: torch.Tensor) -> int:
        if rank != self.rank or t.device != self.device or rank not in self.segments:
            return -1
        st = t.untyped_storage()
        lo = st.data_ptr() - self._data
        if lo < 0 or st.nbytes() == 0 or lo + st.nbytes() > self.size(rank):
            return -1
        return lo + t.storage_offset() * t.element_size()

    # ------------------------------------------------------------ put / get
    def put(self, rank: int, offset: int, src, *, op: str = "put") -> None:
        data = _as_bytes(src.cpu() if isinstance(src, torch.Tensor) else src)
        n = data.numel()
        self._check(rank, offset, n, op)
        if not n:
            return
        if rank == self.rank:
            ctypes.memmove(self._data + offset, data.data_ptr(), n)
            return
        peer, base = self.peers[rank], data.data_ptr()
        for off, length in self._pieces(rank, offset, n):
            self._xfer(rank, True, base + off - offset, peer.data + off, length, op, "a write")
        self.bytes_put += n

    def put_async(self, rank: int, offset: int, src, *, op: str = "put") -> Pending:
        """One write submitted (TCP); the blocking :meth:`put` to this rank, over RDMA, across a growth boundary,
        when staging is forced or when the submission fails. A failed write is retried by :meth:`put` when
        polled (which asks the liveness monitor, as every put does)."""
        data = _as_bytes(src)
        n = data.numel()
        self._check(rank, offset, n, op)
        e = self.engine
        if rank == self.rank or not n or e.transport == "rdma" or e.stage_all or len(self._pieces(rank, offset, n)) > 1:
            self.put(rank, offset, data, op=op)
            return DONE
        batch = e.submit_write(self.peers[rank].sid, data.data_ptr(), self.peers[rank].data + offset, n)
        if batch is None:
            self.put(rank, offset, data, op=op)
            return DONE
        self.bytes_put += n
        return _Write(self, rank, offset, data, batch, op)

    def put_many(self, rank: int, pieces, *, op: str = "put") -> None:
        """Every piece checked first, then every write in flight at once (the pieces land in no promised order).
        Over RDMA, or when staging is forced, each piece goes through :meth:`put` (its bounce buffer)."""
        datas = [(offset, _as_bytes(src.cpu() if isinstance(src, torch.Tensor) else src)) for offset, src in pieces]
        for offset, data in datas:
            self._check(rank, offset, data.numel(), op)
        if rank == self.rank or self.engine.transport == "rdma" or self.engine.stage_all:
            for offset, data in datas:
                self.put(rank, offset, data, op=op)
            return
        peer, locs, remotes, sizes = self.peers[rank], [], [], []
        for offset, data in datas:
            base = data.data_ptr()
            for off, length in self._pieces(rank, offset, data.numel()) if data.numel() else ():
                locs.append(base + off - offset)
                remotes.append(peer.data + off)
                sizes.append(length)
        if locs:
            self._run(rank, op, "a batched write",
                      lambda: self.engine.write_many(peer.sid, locs, remotes, sizes))
            self.bytes_put += sum(sizes)

    def _read(self, rank: int, offset: int, dst: int, nbytes: int, op: str) -> None:
        self._check(rank, offset, nbytes, op)
        if not nbytes:
            return
        if rank == self.rank:
            ctypes.memmove(dst, self._data + offset, nbytes)
            return
        peer = self.peers[rank]
        for off, length in self._pieces(rank, offset, nbytes):
            self._xfer(rank, False, dst + off - offset, peer.data + off, length, op, "a read")
        self.bytes_got += nbytes

    def get(self, rank: int, offset: int, nbytes: int, *, op: str = "get") -> bytes:
        buf = bytearray(nbytes)
        if nbytes:
            self._read(rank, offset, ctypes.addressof(ctypes.c_char.from_buffer(buf)), nbytes, op)
        else:
            self._check(rank, offset, 0, op)
        return bytes(buf)

    def get_into(self, rank: int, offset: int, dst: torch.Tensor, *, op: str = "get") -> None:
        nbytes = dst.numel() * dst.element_size()
        if dst.device.type == "cpu" and dst.is_contiguous():
            self._read(rank, offset, dst.data_ptr(), nbytes, op)
            return
        tmp = torch.empty(nbytes, dtype=torch.uint8)
        self._read(rank, offset, tmp.data_ptr(), nbytes, op)
        if nbytes:
            dst.copy_(tmp.view(dst.dtype).view(dst.shape))

    def zero(self, rank: int, offset: int, nbytes: int, *, op: str = "zero") -> None:
        self._check(rank, offset, nbytes, op)
        if rank == self.rank:
            ctypes.memset(self._data + offset, 0, nbytes)
            return
        zeros = torch.zeros(min(nbytes, _ZERO_CHUNK), dtype=torch.uint8)
        for at in range(offset, offset + nbytes, _ZERO_CHUNK):
            self.put(rank, at, zeros[:min(_ZERO_CHUNK, offset + nbytes - at)], op=op)

    def clear_pad(self, rank: int, line: int, nbytes: int) -> None:
        self.check_pad(rank, line, nbytes, op="clear_pad")
        if rank == self.rank:
            ctypes.memset(self._pad + line, 0, nbytes)
            return
        zeros = torch.zeros(nbytes, dtype=torch.uint8)
        if nbytes:
            self._xfer(rank, True, zeros.data_ptr(), self.peers[rank].pad + line, nbytes, "clear_pad", "a write")

    # ------------------------------------------------------------ signals
    def _line_ok(self, rank: int, line: int, op: str) -> None:
        if not (rank == self.rank or rank in self.peers) or not 0 <= line <= _PAD - 8 or line % 8:
            self.check_pad(rank, line, 8, op=op)  # raises, naming what is wrong

    def _own_word(self, line: int) -> int | None:
        return self._pad + line if 0 <= line <= _PAD - 8 and not line % 8 else None

    def signal(self, rank: int, line: int, value: int) -> None:
        self._line_ok(rank, line, "signal")
        if rank == self.rank:
            self._prims.signal(self._pad + line, value)
            return
        peer = self.peers[rank]
        with self._lock:
            word = self._ctrl + self._scratch() + _S_WORDS
            self._prims.store_release(word, value)
            self._run(rank, "signal", "a signal write", lambda: self.engine.write(peer.sid, word, peer.pad + line, 8))

    def load(self, rank: int, line: int) -> int:
        self._line_ok(rank, line, "load")
        if rank == self.rank:
            return self._prims.load_acquire(self._pad + line)
        return self._read_words(rank, [line], "load")[0]

    def _read_words(self, rank: int, lines: list[int], op: str) -> list[int]:
        """The words at ``lines`` of remote ``rank``'s pad, read in batches of at most ``_WORDS``."""
        peer, out = self.peers[rank], []
        for at in range(0, len(lines), _WORDS):
            chunk = lines[at:at + _WORDS]
            with self._lock:
                base = self._ctrl + self._scratch() + _S_WORDS
                locals_ = [base + 8 * i for i in range(len(chunk))]
                remotes = [peer.pad + ln for ln in chunk]
                self._run(rank, op, "a read of its signal words",
                          lambda lo=locals_, re=remotes: self.engine.read_many(peer.sid, lo, re, [8] * len(lo)))
                out.extend(self._prims.load_acquire(a) for a in locals_)
        return out

    def fetch_add(self, rank: int, line: int, delta: int) -> int:
        self._line_ok(rank, line, "fetch_add")
        if rank == self.rank:
            return self._prims.fetch_add_signal(self._pad + line, delta)
        peer, mail = self.peers[rank], self.peers[rank].ctrl + CTRL_MAIL + 64 * self.rank
        with self._amo_lock:
            self._amo_seq += 1
            seq, reply = self._amo_seq, self._ctrl + self._reply
            with self._lock:
                word = self._ctrl + self._scratch() + _S_WORDS
                self._prims.store_release(word, line)
                self._prims.store_release(word + 8, delta)
                self._prims.store_release(word + 16, seq)
                # [line, delta] first, then seq: the owner acts on the seq.
                self._run(rank, "fetch_add", "a request write", lambda: self.engine.write(peer.sid, word, mail + 8, 16))
                self._run(rank, "fetch_add", "a request write", lambda: self.engine.write(peer.sid, word + 16, mail, 8))
            self._wait_local([reply], [rank], seq, timeout=env.TIMEOUT.get(), op="fetch_add")
            return self._prims.load_acquire(reply + 8)

    def _wait_local(self, addrs: list[int], owners: list[int], target: int, *, timeout: float, op: str) -> None:
        """Wait for local words that remote ``owners`` write (liveness of the writers checked)."""
        start = time.monotonic()
        deadline, pause, next_live = start + timeout, 0.0, start + 0.25
        while any(self._prims.load_acquire(a) < target for a in addrs):
            now = time.monotonic()
            if now >= next_live:
                self._raise_lost(owners, op, target)
                next_live = now + 0.25
            if now >= deadline:
                raise ZbcclTimeoutError(f"{op}: timed out after {timeout:.1f}s waiting for ranks {owners}, "
                                        f"expected their answer, got none", ranks=tuple(owners))
            pause = backoff(now - start, pause, remote=False, cap=1e-3, left=deadline - now)

    def wait_until(self, lines: Sequence[tuple[int, int]], target: int, *, timeout: float, op: str = "wait",
                   liveness: float = 1.0, labels: dict[int, int] | None = None) -> None:
        label = (labels or {}).get
        local, remote = [], {}
        for r, ln in lines:
            self._line_ok(r, ln, op)
            if r == self.rank:
                local.append(self._pad + ln)
            else:
                remote.setdefault(r, []).append(ln)
        start = time.monotonic()
        deadline, next_live, pause = start + timeout, start + liveness, 0.0
        cap = 1e-3 if remote else 200e-6
        while True:
            late = [(self.rank, v) for a in local if (v := self._prims.load_acquire(a)) < target]
            for r, lns in remote.items():
                late.extend((r, v) for v in self._read_words(r, lns, op) if v < target)
            if not late:
                return
            now = time.monotonic()
            if now >= next_live or now >= deadline:
                self._raise_lost(sorted({r for r, _ in late}), op, target, label)
                next_live = now + liveness
            if now >= deadline:
                names = [label(r, r) for r, _ in late]
                got = ", ".join(f"{v} on rank {label(r, r)}" for r, v in late)
                raise ZbcclTimeoutError(
                    f"{op}: timed out after {timeout:.1f}s waiting for ranks {names}, expected their signal >= "
                    f"{target}, got {got}", ranks=tuple(names))
            pause = backoff(now - start, pause, remote=bool(remote), cap=cap, left=deadline - now)

    def _raise_lost(self, ranks: list[int], op: str, target: int, label=None) -> None:
        """Raise when one of ``ranks`` died (remote error) or its host stopped answering (timeout)."""
        if self._monitor is not None:
            error = self._monitor.lost(ranks, op, label or (lambda r, d: d))
            if error is not None:
                raise error

    def _lost(self, sid: str) -> bool:
        """The engine's :attr:`~.engine.MooncakeEngine.lost`: whether the monitor found the peer at session id
        ``sid`` dead or its host unreachable (never blocks)."""
        rank, monitor = self._rank_of_sid.get(sid), self._monitor
        return rank is not None and monitor is not None and any(monitor.verdict([rank]))

    def _run(self, rank: int, op: str, what: str, transfer: Callable[[], int]) -> None:
        """``transfer()`` (a Mooncake call returning its rc), retried while its peer still answers (a reset
        connection); raises when the peer died, its host is unreachable, or it keeps refusing."""
        for attempt in range(_RETRIES + 1):
            if transfer() == 0:
                return
            verdict = self._monitor.settled(rank) if self._monitor is not None else "alive"
            if attempt == _RETRIES or verdict != "alive":
                if self._monitor is None:
                    raise ZbcclRemoteError(f"{op}: {what} to rank {rank} failed, expected rc 0, got -1", ranks=(rank,))
                raise self._monitor.failure(rank, op, what, verdict)

    # ------------------------------------------------------------ liveness, trust, native
    def dead_peers(self) -> list[int]:
        return self._monitor.dead() if self._monitor is not None else []

    def unreachable_peers(self) -> list[int]:
        """Remote ranks whose host has not answered for ``STALL`` seconds (a partition, or a host down)."""
        return self._monitor.verdict(list(self.peers))[1] if self._monitor is not None else []

    def where(self, rank: int) -> str:
        peer = self.peers.get(rank)
        return peer.where() if peer is not None else "this host"

    def job_secret(self, job_id: str, world_size: int) -> JobSecret | None:
        """The key derived from ``ZBCCL_JOB_COOKIE`` (Mooncake itself authenticates nothing); None without it."""
        if len(self.peers) + 1 != world_size:
            return None
        return self._secret

    def traffic(self) -> dict[str, int]:
        """What this rank moved to and from other hosts: every byte its Mooncake engine's completed transfers
        moved (``MooncakeEngine.counters``: ``written``, ``read``, ``transfers``; signals, growth tables and
        the liveness monitor's reads included; zeros before the engine starts), and the data bytes alone
        (``data_put``, ``data_got``: put/zero and get/get_into, :attr:`bytes_put` / :attr:`bytes_got`)."""
        e = self.engine
        moved = e.counters() if e is not None else {"written": 0, "read": 0, "transfers": 0}
        return {**moved, "data_put": self.bytes_put, "data_got": self.bytes_got}

    def describe(self) -> dict:
        """What ``zbccl info`` shows: the protocol asked for and the transport Mooncake actually runs."""
        e = self.engine
        return {"asked": env.MOONCAKE_PROTOCOL.get(), "transport": e.transport if e else None,
                "session": e.session_id if e else None, "peers": {r: p.sid for r, p in self.peers.items()}}

    def native(self) -> NativeHandle:
        return self._native


class _Write(Pending):
    """A write in flight (:meth:`MooncakeTransport.put_async`)."""

    __slots__ = ("_t", "_rank", "_offset", "_data", "_batch", "_op")

    def __init__(self, t: MooncakeTransport, rank: int, offset: int, data: torch.Tensor, batch: int, op: str) -> None:
        self._t, self._rank, self._offset, self._data, self._batch, self._op = t, rank, offset, data, batch, op

    def done(self) -> bool:
        if self._batch is None:
            return True
        with self._t._pending_lock:  # one asker at a time: Mooncake frees the batch once it answered
            if self._batch is None:
                return True
            st = self._t.engine.status(self._batch, self._data.numel())
            if st == 0:
                return False
            self._batch = None  # landed or failed: Mooncake freed the batch
        if st != 1:  # a reset connection, or a lost peer: put retries while it answers, else raises naming it
            self._t.bytes_put -= self._data.numel()
            self._t.put(self._rank, self._offset, self._data, op=self._op)
        return True


class _MooncakeNative(NativeHandle):
    """Addresses of this rank's own memory only: a remote rank's memory is not in this process."""

    __slots__ = ("_t",)

    def __init__(self, transport: MooncakeTransport) -> None:
        self._t = transport

    def data_addr(self, rank: int, offset: int = 0, nbytes: int = 0, *, op: str = "heap") -> int:
        t = self._t
        t._check(rank, offset, nbytes, op)
        if rank != t.rank:
            raise t._no_view(rank, "heap", op)
        return t._data + offset

    def pad_addr(self, rank: int, line: int = 0) -> int:
        t = self._t
        t._line_ok(rank, line, "signal pad")
        if rank != t.rank:
            raise t._no_view(rank, "signal pad", "signal pad")
        return t._pad + line

    def liveness_fd(self, rank: int) -> int:
        return -1
