"""CPU transport: one memfd segment per rank, shared over Unix-socket fd passing.

Why memfd and descriptor passing rather than named ``/dev/shm`` files that are
unlinked once every peer has mapped them: a named file exists in the
filesystem from creation until the unlink, and a SIGKILL inside that window
(or of the rank that was to unlink) leaves it behind for ever. A memfd never
has a path: its pages live exactly as long as some process maps it or holds
its descriptor, so no exit, exception or SIGKILL can leak it. Its name
(``zbccl-<job>-r<rank>``, shown in ``/proc/<pid>/maps``) carries the job id,
and it is ``fchmod``-ed to 0600.

Protocol (collective over the ranks of one host; the handout itself is in
:mod:`.handout`, the mappings in :mod:`.mapping`):

1. each rank creates and reserves its memfd (``posix_fallocate``, so a full
   machine gives a clear error now instead of SIGBUS later), maps it, writes a
   random cookie into its header, and binds the abstract socket
   ``\\0zbccl-<job>-<rank>-<token>`` (random token; abstract names vanish with
   their process, like the memfd);
2. bootstrap all-gather "listening", carrying each rank's pid, euid, token and
   cookie (or the error it hit, so every rank fails together);
3. each rank serves its descriptor to those pids only, connects to every local
   peer, checks the peer's credentials, receives the descriptor, checks its
   size, maps it and checks the cookie;
4. bootstrap all-gather "mapped" (again carrying any error); the server stops
   and is joined. The owner keeps its memfd descriptor (close-on-exec, closed
   at ``close`` and in a forked child) because growing needs it.

Growth (reservation design). Every rank maps each segment over its rank's
*maximum* size (``reserve_bytes``) from the start, though the memfd holds only
the current size; nothing ever touches the part beyond the published size
(every access is bounds-checked against it), so the pages past EOF never
fault. To grow, the owner ``posix_fallocate``-s the new range (extending the
memfd; on ENOSPC/ENOMEM nothing changes and the error names the reason),
prefaults it in its own mapping, and only then publishes the new size in its
signal pad (:meth:`ShmTransport.grow`, a release store). Peers need no new descriptor
and no new mapping: their reservation already covers the range, and they read
the owner's published size (acquire) when they bounds-check; their first touch
of a grown page is a minor fault (the page already exists). One linear offset
space per rank, so handles and the native paths keep addressing
``(rank, offset)``.

Death detection goes by the process, not by a socket: each rank holds a pidfd
of every local peer (its pid verified by ``SO_PEERCRED``), which becomes
readable when that process exits, even if a child it forked still holds every
descriptor it had.
"""

from __future__ import annotations

import errno
import math
import os
import secrets
import stat
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from .... import errors
from ....bootstrap.base import Bootstrap
from ....bootstrap.secret import JobSecret
from ....bootstrap.topology import Topology
from ....errors import ZbcclError, ZbcclOutOfMemoryError, ZbcclRemoteError, ZbcclSystemError
from ... import flags, layout
from ...releases import drain
from ..base import NativeHandle, Segment, SignalPad, Transport, ViewRelease, _as_bytes
from ..handout import FdServer, Member, agree, check_uids, member_of, os_error, receive_fd
from ..liveness import Pidfds
from .mapping import create_memfd, load_i64, map_fd, prefault, store_i64, tensor_at, unmap_addr

__all__ = ["ShmTransport"]

# Where the data segment starts in a rank's memfd: after its signal pad (heap/layout.py's control area).
_PAD = layout.CTRL_BYTES


def _store_i64(addr: int, value: int) -> None:
    """Writes the cookie (a seam the security tests use to forge one)."""
    store_i64(addr, value)


class ShmTransport(Transport):
    """Shared memory between processes of one host (see the module docstring)."""

    name = "shm"
    KERNEL_LINE = layout.KERNEL_AREA

    def __init__(self, *, device: torch.device | str = "cpu", populate: bool = True) -> None:
        super().__init__(device=device)
        if self.device.type != "cpu":
            raise errors.ZbcclInvalidUsageError(
                f"heap: the shm transport holds host memory, expected device cpu, got {self.device}")
        self.populate = populate
        #: Every mapped rank's data segment (sizes in data bytes).
        self.segments: dict[int, Segment] = {}
        self.rank = -1
        self._base: dict[int, int] = {}  # rank -> address of its memfd's byte 0 (its signal pad)
        self._size_word: dict[int, int] = {}  # peer rank -> address of its published size word
        self._fd = -1  # this rank's memfd, kept for growth
        self._live = Pidfds()
        self._gone_early: set[int] = set()  # local peers whose announced pid was gone before watch_peers
        self._prims = flags.primitives()
        self._memcpy = getattr(self._prims, "memcpy", None)  # None: the pure-Python fallback's torch copy
        self._native = _ShmNative(self)
        self.views = 0  # views of peers' data alive (finalize keeps the mappings while any is)
        self._own_flat: torch.Tensor | None = None  # this rank's live data as one uint8 view (_own_bytes)

    # ------------------------------------------------------------ lifecycle
    def establish(self, bootstrap: Bootstrap, topology: Topology, *, data_bytes: list[int], job_id: str,
                  timeout: float, reserve_bytes: list[int] | None = None) -> dict[int, Segment]:
        rank = self.rank = bootstrap.rank
        reserve = list(data_bytes) if reserve_bytes is None else list(reserve_bytes)
        peers = [r for r in topology.local_ranks if r != rank]
        fd, server, error = -1, None, None
        me = Member(rank, os.getpid(), os.geteuid(), secrets.token_hex(16), secrets.randbits(63) | 1)
        try:
            try:
                fd = self._create_own(rank, data_bytes[rank], reserve[rank], job_id, me.cookie)
                server = FdServer(job_id, rank, me.token, fd)
            except ZbcclError as exc:
                error = exc
            except OSError as exc:  # e.g. out of descriptors: every rank must hear it, not wait out the timeout
                error = os_error("heap: cannot create this rank's segment", exc, rank)
            got = agree(bootstrap, {"pid": me.pid, "uid": me.uid, "token": me.token, "cookie": me.cookie},
                         error, timeout=timeout, tag="shm-listen")
            members = {p: member_of(p, got[p]) for p in peers}  # _agree raised on any error
            error = check_uids(me, members)
            if error is None:
                server.serve([members[p] for p in peers])
                try:
                    for peer in peers:
                        self._connect(job_id, members[peer], data_bytes[peer], reserve[peer], timeout)
                except ZbcclError as exc:
                    error = exc
                except OSError as exc:
                    error = os_error("heap: cannot map the peers' segments", exc, rank)
            agree(bootstrap, {}, error, timeout=timeout, tag="shm-mapped")
            server.stop()
            if server.error is not None:
                raise ZbcclSystemError(f"heap: handing out the segment failed: {server.error}", ranks=(rank,))
        except BaseException:
            # The server stops before the descriptor closes, on every path: a
            # closed number may be reused at once, and must never be sent.
            if server is not None:
                server.stop()
            if fd >= 0:
                os.close(fd)
            self.close(unmap=True)
            raise
        self._fd = fd  # kept open (close-on-exec) for growth; closed by close()
        return dict(self.segments)

    def _create_own(self, rank: int, nbytes: int, reserve: int, job_id: str, cookie: int) -> int:
        fd = create_memfd(f"zbccl-{job_id}-r{rank}", layout.segment_bytes(nbytes))
        try:
            addr = map_fd(fd, layout.segment_bytes(nbytes), populate=self.populate,
                          reserve=layout.segment_bytes(reserve))
        except BaseException:
            os.close(fd)
            raise
        self._base[rank] = addr
        self.segments[rank] = Segment(rank, nbytes, "cpu", owner=True, reserved=reserve)
        # Written before the descriptor can reach anyone (the server is not up yet).
        _store_i64(addr + layout.H_COOKIE, cookie)
        # This rank's share of the job secret: never published, read only by holders of the segment.
        tensor_at(addr + layout.H_SECRET, layout.SECRET_BYTES).copy_(
            torch.frombuffer(bytearray(secrets.token_bytes(layout.SECRET_BYTES)), dtype=torch.uint8))
        store_i64(addr + layout.H_HEAP_BYTES, nbytes)  # the published size (grow raises it)
        return fd

    def _connect(self, job_id: str, peer: Member, nbytes: int, reserve: int, timeout: float) -> None:
        memfd, pidfd = receive_fd(job_id, peer, timeout=timeout)
        addr, lo, hi = 0, layout.segment_bytes(nbytes), layout.segment_bytes(reserve)
        try:
            st = os.fstat(memfd)
            # The peer may already have grown (it can finish init and allocate before we map).
            if not stat.S_ISREG(st.st_mode) or not lo <= st.st_size <= hi:
                raise ZbcclRemoteError(
                    f"heap: rank {peer.rank}'s segment is wrong, expected a memfd of {lo} to {hi} "
                    f"bytes, got {st.st_size} bytes (mode {stat.filemode(st.st_mode)}); not mapping it",
                    ranks=(peer.rank,))
            addr = map_fd(memfd, lo, populate=self.populate, reserve=hi)
            if load_i64(addr + layout.H_COOKIE) != peer.cookie:
                raise ZbcclRemoteError(
                    f"heap: rank {peer.rank}'s segment carries the wrong cookie, expected the one it published "
                    "through the store, got another (not its segment); unmapped it", ranks=(peer.rank,))
        except BaseException:
            if addr:
                unmap_addr(addr, hi)
            os.close(pidfd)
            raise
        finally:
            os.close(memfd)
        self._base[peer.rank] = addr
        self._size_word[peer.rank] = addr + layout.H_HEAP_BYTES
        self.segments[peer.rank] = Segment(peer.rank, nbytes, "cpu", owner=False, reserved=reserve)
        self._live.add(peer.rank, pidfd)

    def grow(self, nbytes: int) -> None:
        """Owner only: make this rank's data ``nbytes`` long (reserved now, prefaulted here), then
        publish the size in its signal pad (release: the range is backed before anyone sees it).

        Raises ZbcclOutOfMemoryError (beyond the reservation, or the machine is
        full) with nothing changed.
        """
        seg = self.segments.get(self.rank)
        if seg is None or self._fd < 0:
            raise ZbcclSystemError("heap: grow: this process holds no segment of its own to grow")
        old = seg.nbytes
        if nbytes <= old:
            return
        if nbytes > seg.reserved:
            raise ZbcclOutOfMemoryError(
                f"heap: grow: heap of {nbytes} bytes requested, expected at most the {seg.reserved} reserved")
        lo, hi = layout.segment_bytes(old), layout.segment_bytes(nbytes)
        try:
            os.posix_fallocate(self._fd, lo, hi - lo)  # extends the memfd, all or nothing
        except OSError as exc:
            try:
                os.ftruncate(self._fd, lo)
            except OSError:
                pass
            if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                raise ZbcclOutOfMemoryError(
                    f"heap: grow: cannot reserve {hi - lo} more bytes ({lo} -> {hi}): {exc.strerror}") from None
            raise ZbcclSystemError(f"heap: grow: extending the shared segment failed: {exc}") from None
        if self.populate:
            prefault(self._base[self.rank] + lo, hi - lo)  # best effort: older kernels fault lazily
        seg.nbytes = nbytes
        self._prims.signal(self._base[self.rank] + layout.H_HEAP_BYTES, nbytes)

    def close(self, *, unmap: bool) -> None:
        self._live.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._own_flat = None
        if unmap:
            for r, addr in self._base.items():
                unmap_addr(addr, layout.segment_bytes(self.segments[r].reserved))
            self._base.clear()
            self._size_word.clear()
            self.segments.clear()

    # ------------------------------------------------------------ geometry
    def reachable(self, rank: int) -> bool:
        return rank in self._base

    def size(self, rank: int) -> int:
        if rank == self.rank:
            seg = self.segments.get(rank)
            return seg.nbytes if seg is not None else 0
        word = self._size_word.get(rank)
        if word is None:
            return 0
        # Clamped: a peer's pad never makes us touch memory past its reservation.
        return min(self._prims.load_acquire(word), self.segments[rank].reserved)

    def signal_pad(self, rank: int) -> SignalPad:
        return SignalPad(rank, _PAD, self.LINE)

    # ------------------------------------------------------------ views
    def view(self, rank: int, offset: int, shape: Sequence[int], dtype: torch.dtype, *,
             stride: Sequence[int] | None = None, release: Callable[[], None] | None = None,
             op: str = "view") -> torch.Tensor:
        isz = dtype.itemsize
        if stride is None:
            span = isz * math.prod(shape)
        else:
            span = 0 if 0 in shape else (sum((n - 1) * st for n, st in zip(shape, stride)) + 1) * isz
        if offset % isz:
            raise errors.ZbcclInvalidUsageError(
                f"{op}: offset not aligned to {dtype}, expected a multiple of {isz}, got {offset}")
        base = self._base.get(rank)
        if base is None or offset < 0 or span < 0 or offset + span > self.size(rank):
            self.check_data(rank, offset, span, op=op)  # raises, naming what is wrong
        if rank == self.rank:  # own memory: the allocator's block under it is counted (not the view)
            if release is None:  # a slice of one view of the whole live range (no storage object per call)
                flat = self._own_bytes(offset + span)[offset:offset + span]
            else:  # a storage of its own, so that ``release`` runs when the last tensor on it dies
                flat = tensor_at(base + _PAD + offset, span, release)
        else:
            self.views += 1
            flat = tensor_at(base + _PAD + offset, span, ViewRelease(self, release))
        typed = flat.view(dtype)
        return typed.view(shape) if stride is None else typed.as_strided(shape, stride)

    def _own_bytes(self, end: int) -> torch.Tensor:
        """A uint8 view of this rank's data up to at least ``end`` (within its live size), made once per size."""
        flat = self._own_flat
        if flat is None or flat.numel() < end:
            flat = self._own_flat = tensor_at(self._base[self.rank] + _PAD, self.size(self.rank))
        return flat

    # ------------------------------------------------------------ put / get
    def put(self, rank: int, offset: int, src, *, op: str = "put") -> None:
        """:meth:`Transport.put` as one copy on the calling thread: torch's copy of a large tensor fans out to
        its intra-op threads, which then spin for a while, and on busy cores that spinning holds off the
        other ranks and the transports' threads (a 2 x 2 all_to_all of 1 MiB between namespace hosts took
        11.5 ms with torch's 2 threads per rank against 2.9 ms with one, ``docs/benchmarks.md`` A.15)."""
        data = _as_bytes(src)
        n = data.numel()
        if data.device.type != "cpu" or self._memcpy is None:
            super().put(rank, offset, data, op=op)
            return
        self.check_data(rank, offset, n, op=op)
        if n:
            self._memcpy(self._base[rank] + _PAD + offset, data.data_ptr(), n)

    def get_into(self, rank: int, offset: int, dst: torch.Tensor, *, op: str = "get") -> None:
        """:meth:`Transport.get_into` as one copy on the calling thread (see :meth:`put`) when ``dst`` is a
        contiguous CPU tensor."""
        n = dst.numel() * dst.element_size()
        if dst.device.type != "cpu" or not dst.is_contiguous() or self._memcpy is None:
            super().get_into(rank, offset, dst, op=op)
            return
        self.check_data(rank, offset, n, op=op)
        if n:
            self._memcpy(dst.data_ptr(), self._base[rank] + _PAD + offset, n)

    def pad_view(self, rank: int, line: int, nbytes: int, *, op: str = "signal pad") -> torch.Tensor:
        self.check_pad(rank, line, nbytes, op=op)
        return tensor_at(self._base[rank] + line, nbytes)

    def live_views(self) -> int:
        drain()  # views that died count once their releases ran
        return self.views

    def offset_of(self, rank: int, t: torch.Tensor) -> int:
        if t.device != self.device or rank not in self._base:
            return -1
        st = t.untyped_storage()
        lo = st.data_ptr() - (self._base[rank] + _PAD)
        if lo < 0 or st.nbytes() == 0 or lo + st.nbytes() > self.size(rank):
            return -1
        return lo + t.storage_offset() * t.element_size()

    # ------------------------------------------------------------ signals
    def _word(self, rank: int, line: int, op: str) -> int:
        if rank not in self._base or not 0 <= line <= _PAD - 8 or line % 8:
            self.check_pad(rank, line, 8, op=op)
        return self._base[rank] + line

    def signal(self, rank: int, line: int, value: int) -> None:
        self._prims.signal(self._word(rank, line, "signal"), value)

    def load(self, rank: int, line: int) -> int:
        return self._prims.load_acquire(self._word(rank, line, "load"))

    def fetch_add(self, rank: int, line: int, delta: int) -> int:
        return self._prims.fetch_add_signal(self._word(rank, line, "fetch_add"), delta)

    def wait_until(self, lines: Sequence[tuple[int, int]], target: int, *, timeout: float, op: str = "wait",
                   liveness: float = 1.0, labels: dict[int, int] | None = None) -> None:
        ranks = [r for r, _ in lines]
        addrs = np.asarray([self._word(r, line, op) for r, line in lines], dtype=np.uint64)
        prims, ptr, label = self._prims, int(addrs.ctypes.data), (labels or {}).get
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            budget = int(max(0.0, min(liveness, left)) * 1e9)
            if prims.wait_ge(ptr, len(ranks), target, 0, budget) < 0:
                return
            late = [(r, v) for r, a in zip(ranks, addrs.tolist()) if (v := prims.load_acquire(a)) < target]
            if not late:
                return
            dead = sorted({r for r, _ in late} & set(self.dead_peers()))
            if dead:
                names = [label(r, r) for r in dead]
                raise ZbcclRemoteError(f"{op}: peer lost while waiting: rank(s) {names} died (process exited)",
                                       ranks=tuple(names))
            if left <= 0:
                names = [label(r, r) for r, _ in late]
                got = ", ".join(f"{v} on rank {label(r, r)}" for r, v in late)
                raise errors.ZbcclTimeoutError(
                    f"{op}: timed out after {timeout:.1f}s waiting for ranks {names}, expected their signal >= "
                    f"{target}, got {got}", ranks=tuple(names))

    def job_secret(self, job_id: str, world_size: int) -> JobSecret | None:
        """Derived from every rank's share in its segment header: only holders of all the job's segments
        (processes of its uid that the handout served) can compute it."""
        if sorted(self._base) != list(range(world_size)):
            return None
        return JobSecret.from_shares([bytes(tensor_at(self._base[r] + layout.H_SECRET, layout.SECRET_BYTES).numpy())
                                      for r in range(world_size)], job_id)

    # ------------------------------------------------------------ liveness
    def watch_peers(self, topology: Topology) -> None:
        # A pidfd of each local peer's announced pid: its death during the rest of init is seen at once. The
        # pid is not verified yet (the store is not authenticated), so a wrong one can only fail init early;
        # the handout's verified pidfd (SO_PEERCRED) replaces it (_connect).
        for r in topology.local_ranks:
            if r == topology.rank or self._live.fd(r) >= 0:
                continue
            try:
                self._live.add(r, os.pidfd_open(topology.infos[r].pid))
            except ProcessLookupError:  # gone already: the next check names it
                self._gone_early.add(r)
            except (OSError, AttributeError):  # no pidfds here (the handout will say so): blind until then
                pass

    def dead_peers(self) -> list[int]:
        # A pidfd becomes readable when its process exits, whoever else still
        # holds the descriptors that process had.
        return sorted(set(self._live.dead()) | self._gone_early)

    def native(self) -> NativeHandle:
        return self._native



class _ShmNative(NativeHandle):
    """Native-core handle of the shm transport: addresses in this process, and the peers' pidfds."""

    __slots__ = ("_t",)

    def __init__(self, transport: ShmTransport) -> None:
        self._t = transport

    def data_addr(self, rank: int, offset: int = 0, nbytes: int = 0, *, op: str = "heap") -> int:
        t = self._t
        t.check_data(rank, offset, nbytes, op=op)
        return t._base[rank] + _PAD + offset

    def pad_addr(self, rank: int, line: int = 0) -> int:
        return self._t._word(rank, line, "signal pad")

    def liveness_fd(self, rank: int) -> int:
        """The pidfd of local peer ``rank`` (readable once it exited), or -1."""
        return self._t._live.fd(rank)
