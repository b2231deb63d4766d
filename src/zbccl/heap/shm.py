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
:mod:`.handout`):

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
header (``GlobalHeap.grow``, a release store). Peers need no new descriptor
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

import ctypes
import errno
import json
import mmap
import os
import secrets
import select
import stat

from ..bootstrap.base import Bootstrap
from ..bootstrap.secret import JobSecret
from ..bootstrap.store import in_range, parse_record
from ..bootstrap.topology import Topology
from ..errors import ZbcclError, ZbcclOutOfMemoryError, ZbcclRemoteError, ZbcclSystemError
from . import layout
from .base import Segment, Transport
from .handout import FdServer, Member, os_error, receive_fd

__all__ = ["ShmTransport", "map_fd", "unmap_addr"]

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0x8000)
_MAP_FIXED = getattr(mmap, "MAP_FIXED", 0x10)
_MADV_POPULATE_WRITE = 23  # Linux 5.14+


def map_fd(fd: int, nbytes: int, *, populate: bool, reserve: int | None = None) -> int:
    """``mmap`` a shared, read-write view of ``fd`` over ``reserve`` bytes (default ``nbytes``).

    Only the first ``nbytes`` (the memfd's size) are populated; the rest of the
    reservation lies past EOF until the owner grows the memfd.
    """
    reserve = nbytes if reserve is None else reserve
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    addr = _libc.mmap(None, reserve, prot, mmap.MAP_SHARED | (_MAP_POPULATE if populate and reserve == nbytes else 0),
                      fd, 0)
    if addr in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise ZbcclSystemError(f"heap: mmap of {reserve} bytes failed: {os.strerror(err)}")
    if populate and reserve != nbytes:
        # Populate the live range only (MAP_POPULATE over the whole reservation would try
        # every page past EOF): the same pages mapped again in place, fixed, populated.
        fixed = _libc.mmap(addr, nbytes, prot, mmap.MAP_SHARED | _MAP_FIXED | _MAP_POPULATE, fd, 0)
        if fixed != addr:
            err = ctypes.get_errno()
            _libc.munmap(addr, reserve)
            raise ZbcclSystemError(f"heap: populating {nbytes} bytes failed: {os.strerror(err)}")
    return int(addr)


def prefault(addr: int, nbytes: int) -> bool:
    """Fault ``[addr, addr+nbytes)`` in for writing now; False where the kernel lacks MADV_POPULATE_WRITE."""
    return _libc.madvise(addr, nbytes, _MADV_POPULATE_WRITE) == 0


def unmap_addr(addr: int, nbytes: int) -> None:
    _libc.munmap(addr, nbytes)


def _create_memfd(name: str, nbytes: int) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, nbytes)
        # Reserve the pages now: tmpfs otherwise overcommits and a later first
        # touch on a full machine kills the process with SIGBUS.
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.ENOSPC, errno.ENOMEM):
            raise ZbcclOutOfMemoryError(
                f"heap: cannot reserve a {nbytes}-byte shared segment: {exc.strerror}; "
                "lower heap_size or free memory") from None
        raise ZbcclSystemError(f"heap: creating the shared segment failed: {exc}") from None
    return fd


def _store_i64(addr: int, value: int) -> None:
    ctypes.c_int64.from_address(addr).value = value


def _load_i64(addr: int) -> int:
    return ctypes.c_int64.from_address(addr).value


def _member_of(rank: int, raw: bytes) -> Member:
    """A peer's "listening" record, parsed strictly (the store is not authenticated yet)."""
    def check(d) -> Member:
        token = d["token"]
        if not isinstance(token, str) or len(token) != 32 or token.strip("0123456789abcdef"):
            raise ValueError(token)
        return Member(rank, in_range(d["pid"], 1, 1 << 22), in_range(d["uid"], 0, (1 << 32) - 1), token,
                      in_range(d["cookie"], 1, (1 << 63) - 1))

    return parse_record(raw, check, op="heap", rank=rank,
                        what="{pid, uid, token (32 hex digits), cookie} of a listening segment server")


def _error_of(d) -> str | None:
    error = d.get("error")
    if error is not None and not isinstance(error, str):
        raise TypeError(error)
    return error


def _agree(bootstrap: Bootstrap, payload: dict, error: ZbcclError | None, *, timeout: float,
           tag: str) -> list[bytes]:
    """All-gather ``payload`` (or this rank's error); raise on every rank if any rank failed."""
    if error is not None:
        payload = {"error": str(error)}
    got = bootstrap.all_gather(json.dumps(payload).encode(), timeout=timeout, tag=tag)
    if error is not None:
        raise error
    failed = [(r, parse_record(b, _error_of, op="heap", rank=r, what="a JSON object with an optional error"))
              for r, b in enumerate(got)]
    failed = [(r, e) for r, e in failed if e]
    if failed:
        names = getattr(bootstrap, "members", range(bootstrap.world_size))
        what = "; ".join(f"rank {names[r]}: {e}" for r, e in failed)
        raise ZbcclRemoteError(f"heap: a peer could not set up the shared heap: {what}",
                               ranks=tuple(names[r] for r, _ in failed))
    return got


class ShmTransport(Transport):
    """Shared memory between processes of one host (see the module docstring)."""

    device = "cpu"

    def __init__(self, *, populate: bool = True) -> None:
        self.populate = populate
        self.segments: dict[int, Segment] = {}
        self._fd = -1  # this rank's memfd, kept for growth
        self._pidfds: dict[int, int] = {}
        self._poll = select.poll()
        self._fd_to_rank: dict[int, int] = {}

    def establish(self, bootstrap: Bootstrap, topology: Topology, *, segment_bytes: list[int],
                  job_id: str, timeout: float, reserve_bytes: list[int] | None = None) -> dict[int, Segment]:
        rank = bootstrap.rank
        reserve = list(segment_bytes) if reserve_bytes is None else list(reserve_bytes)
        peers = [r for r in topology.local_ranks if r != rank]
        fd, server, error = -1, None, None
        me = Member(rank, os.getpid(), os.geteuid(), secrets.token_hex(16), secrets.randbits(63) | 1)
        try:
            try:
                fd = self._create_own(rank, segment_bytes[rank], reserve[rank], job_id, me.cookie)
                server = FdServer(job_id, rank, me.token, fd)
            except ZbcclError as exc:
                error = exc
            except OSError as exc:  # e.g. out of descriptors: every rank must hear it, not wait out the timeout
                error = os_error("heap: cannot create this rank's segment", exc, rank)
            got = _agree(bootstrap, {"pid": me.pid, "uid": me.uid, "token": me.token, "cookie": me.cookie},
                         error, timeout=timeout, tag="shm-listen")
            members = {p: _member_of(p, got[p]) for p in peers}  # _agree raised on any error
            error = _check_uids(me, members)
            if error is None:
                server.serve([members[p] for p in peers])
                try:
                    for peer in peers:
                        self._connect(job_id, members[peer], segment_bytes[peer], reserve[peer], timeout)
                except ZbcclError as exc:
                    error = exc
                except OSError as exc:
                    error = os_error("heap: cannot map the peers' segments", exc, rank)
            _agree(bootstrap, {}, error, timeout=timeout, tag="shm-mapped")
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
            raise
        self._fd = fd  # kept open (close-on-exec) for growth; closed by close()
        return dict(self.segments)

    def _create_own(self, rank: int, nbytes: int, reserve: int, job_id: str, cookie: int) -> int:
        fd = _create_memfd(f"zbccl-{job_id}-r{rank}", nbytes)
        try:
            addr = map_fd(fd, nbytes, populate=self.populate, reserve=reserve)
        except BaseException:
            os.close(fd)
            raise
        self.segments[rank] = Segment(rank, addr, nbytes, "cpu", owner=True, reserved=reserve)
        # Written before the descriptor can reach anyone (the server is not up yet).
        _store_i64(addr + layout.H_COOKIE, cookie)
        ctypes.memmove(addr + layout.H_SECRET, secrets.token_bytes(layout.SECRET_BYTES), layout.SECRET_BYTES)
        return fd

    def _connect(self, job_id: str, peer: Member, nbytes: int, reserve: int, timeout: float) -> None:
        memfd, pidfd = receive_fd(job_id, peer, timeout=timeout)
        addr = 0
        try:
            st = os.fstat(memfd)
            # The peer may already have grown (it can finish init and allocate before we map).
            if not stat.S_ISREG(st.st_mode) or not nbytes <= st.st_size <= reserve:
                raise ZbcclRemoteError(
                    f"heap: rank {peer.rank}'s segment is wrong, expected a memfd of {nbytes} to {reserve} "
                    f"bytes, got {st.st_size} bytes (mode {stat.filemode(st.st_mode)}); not mapping it",
                    ranks=(peer.rank,))
            addr = map_fd(memfd, nbytes, populate=self.populate, reserve=reserve)
            if _load_i64(addr + layout.H_COOKIE) != peer.cookie:
                raise ZbcclRemoteError(
                    f"heap: rank {peer.rank}'s segment carries the wrong cookie, expected the one it published "
                    "through the store, got another (not its segment); unmapped it", ranks=(peer.rank,))
        except BaseException:
            if addr:
                unmap_addr(addr, reserve)
            os.close(pidfd)
            raise
        finally:
            os.close(memfd)
        self.segments[peer.rank] = Segment(peer.rank, addr, nbytes, "cpu", owner=False, reserved=reserve)
        self._pidfds[peer.rank] = pidfd
        self._fd_to_rank[pidfd] = peer.rank
        self._poll.register(pidfd, select.POLLIN)

    def grow(self, rank: int, nbytes: int) -> None:
        """Owner only: make this rank's segment ``nbytes`` long (reserved now, prefaulted here).

        Raises ZbcclOutOfMemoryError (beyond the reservation, or the machine is
        full) with nothing changed. Publishing the new size is the caller's job.
        """
        seg = self.segments[rank]
        old = seg.nbytes
        if nbytes <= old:
            return
        if not seg.owner or self._fd < 0:
            raise ZbcclSystemError(f"heap: grow: rank {rank}'s segment is not this process's to grow")
        if nbytes > seg.reserved:
            raise ZbcclOutOfMemoryError(
                f"heap: grow: segment of {nbytes} bytes requested, expected at most the {seg.reserved} reserved")
        try:
            os.posix_fallocate(self._fd, old, nbytes - old)  # extends the memfd, all or nothing
        except OSError as exc:
            try:
                os.ftruncate(self._fd, old)
            except OSError:
                pass
            if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                raise ZbcclOutOfMemoryError(
                    f"heap: grow: cannot reserve {nbytes - old} more bytes ({old} -> {nbytes}): "
                    f"{exc.strerror}") from None
            raise ZbcclSystemError(f"heap: grow: extending the shared segment failed: {exc}") from None
        if self.populate:
            prefault(seg.addr + old, nbytes - old)  # best effort: older kernels fault lazily
        seg.nbytes = nbytes

    def job_secret(self, job_id: str, world_size: int) -> JobSecret | None:
        """Derived from every rank's share in its segment header: only holders of all the job's segments
        (processes of its uid that the handout served) can compute it."""
        if sorted(self.segments) != list(range(world_size)):
            return None
        return JobSecret.from_shares([ctypes.string_at(self.segments[r].addr + layout.H_SECRET, layout.SECRET_BYTES)
                                      for r in range(world_size)], job_id)

    def dead_peers(self) -> list[int]:
        # A pidfd becomes readable when its process exits, whoever else still
        # holds the descriptors that process had.
        return sorted({self._fd_to_rank[fd] for fd, _ in self._poll.poll(0) if fd in self._fd_to_rank})

    def liveness_fd(self, rank: int) -> int:
        """The pidfd of local peer ``rank`` (readable once it exited), or -1."""
        return self._pidfds.get(rank, -1)

    def close(self, *, unmap: bool) -> None:
        for fd in self._pidfds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._pidfds.clear()
        self._fd_to_rank.clear()
        self._poll = select.poll()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if unmap:
            for seg in self.segments.values():
                unmap_addr(seg.addr, seg.reserved)
        self.segments.clear()


def _check_uids(me: Member, members: dict[int, Member]) -> ZbcclError | None:
    """Every local rank must run as our effective uid.

    The store is not authenticated (any local user can write a TCPStore key),
    so a uid published there proves nothing; requiring our own uid, which the
    kernel vouches for at connect time, keeps other users out even then.
    """
    other = {r: m.uid for r, m in members.items() if m.uid != me.uid}
    if other:
        return ZbcclSystemError(
            f"heap: local ranks must share one user, expected uid {me.uid}, got {other} (rank: uid)",
            ranks=tuple(other))
    return None
