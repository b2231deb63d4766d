"""CPU transport: one memfd segment per rank, shared over Unix-socket fd passing.

Why memfd and descriptor passing rather than named ``/dev/shm`` files that are
unlinked once every peer has mapped them: a named file exists in the
filesystem from creation until the unlink, and a SIGKILL inside that window
(or of the rank that was to unlink) leaves it behind for ever. A memfd never
has a path: its pages live exactly as long as some process maps it or holds
its descriptor, so no exit, exception or SIGKILL can leak it. Its name
(``zbccl-<job>-r<rank>``, shown in ``/proc/<pid>/maps``) carries the job id,
and it is ``fchmod``-ed to 0600.

Protocol (collective over the ranks of one host):

1. each rank creates and reserves its memfd (``posix_fallocate``, so a full
   machine gives a clear error now instead of SIGBUS later), maps it, and
   listens on the abstract socket ``\\0zbccl-<job>-<rank>`` (abstract names
   vanish with their process, like the memfd);
2. bootstrap all-gather "listening";
3. each rank connects to every local peer, sends its rank, and receives the
   peer's descriptor with ``SCM_RIGHTS``; it maps it and closes the fd;
4. bootstrap all-gather "mapped"; the listeners stop.

The connections of step 3 stay open for the life of the job: a peer's death
closes them (the kernel does it, even on SIGKILL), which is how the others
notice within one liveness interval instead of waiting out a timeout.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import select
import socket
import struct
import threading

from ..bootstrap.base import Bootstrap
from ..bootstrap.topology import Topology
from ..errors import ZbcclOutOfMemoryError, ZbcclRemoteError, ZbcclSystemError
from .base import Segment, Transport

__all__ = ["ShmTransport", "map_fd", "unmap_addr"]

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0x8000)


def map_fd(fd: int, nbytes: int, *, populate: bool) -> int:
    """``mmap`` a shared, read-write view of ``fd``; returns its address."""
    flags = mmap.MAP_SHARED | (_MAP_POPULATE if populate else 0)
    addr = _libc.mmap(None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, 0)
    if addr in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise ZbcclSystemError(f"heap: mmap of {nbytes} bytes failed: {os.strerror(err)}")
    return int(addr)


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


def _sock_name(job_id: str, rank: int) -> str:
    return f"\0zbccl-{job_id}-{rank}"


class _FdServer(threading.Thread):
    """Hands our descriptor to each expected local peer that connects."""

    def __init__(self, job_id: str, rank: int, fd: int, expected: set[int], timeout: float) -> None:
        super().__init__(name=f"zbccl-fdserver-{rank}", daemon=True)
        self.fd = fd
        self.expected = set(expected)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self.sock.bind(_sock_name(job_id, rank))
        self.sock.listen(max(8, len(expected)))
        self.sock.settimeout(timeout)
        self.conns: dict[int, socket.socket] = {}
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while self.expected:
                conn, _ = self.sock.accept()
                conn.settimeout(self.sock.gettimeout())
                (peer,) = struct.unpack("<q", _recv_exact(conn, 8))
                if peer not in self.expected:
                    conn.close()
                    continue
                socket.send_fds(conn, [b"z"], [self.fd])
                self.conns[peer] = conn
                self.expected.discard(peer)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            self.error = exc
        finally:
            self.sock.close()


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        part = conn.recv(n - len(buf))
        if not part:
            raise ConnectionError("peer closed the connection during the handshake")
        buf += part
    return buf


class ShmTransport(Transport):
    """Shared memory between processes of one host (see the module docstring)."""

    device = "cpu"

    def __init__(self, *, populate: bool = True) -> None:
        self.populate = populate
        self.segments: dict[int, Segment] = {}
        self._conns: dict[int, socket.socket] = {}
        self._accepted: dict[int, socket.socket] = {}
        self._poll = select.poll()
        self._fd_to_rank: dict[int, int] = {}

    def establish(self, bootstrap: Bootstrap, topology: Topology, *, segment_bytes: list[int],
                  job_id: str, timeout: float) -> dict[int, Segment]:
        rank = bootstrap.rank
        peers = [r for r in topology.local_ranks if r != rank]
        nbytes = segment_bytes[rank]
        fd = _create_memfd(f"zbccl-{job_id}-r{rank}", nbytes)
        try:
            addr = map_fd(fd, nbytes, populate=self.populate)
            self.segments[rank] = Segment(rank, addr, nbytes, "cpu", owner=True)
            server = _FdServer(job_id, rank, fd, set(peers), timeout)
            server.start()
            bootstrap.all_gather(b"listening", timeout=timeout, tag="shm-listen")
            for peer in peers:
                self._connect(job_id, rank, peer, segment_bytes[peer], timeout)
            bootstrap.all_gather(b"mapped", timeout=timeout, tag="shm-mapped")
            server.join(timeout)
            if server.error is not None:
                raise ZbcclSystemError(f"heap: handing out the segment failed: {server.error}")
            self._accepted = server.conns
        finally:
            os.close(fd)
        return dict(self.segments)

    def _connect(self, job_id: str, rank: int, peer: int, nbytes: int, timeout: float) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        s.settimeout(timeout)
        try:
            s.connect(_sock_name(job_id, peer))
            s.sendall(struct.pack("<q", rank))
            _, fds, _, _ = socket.recv_fds(s, 1, 1)
        except OSError as exc:
            s.close()
            raise ZbcclRemoteError(f"heap: could not get rank {peer}'s segment: {exc}",
                                   ranks=(peer,)) from None
        if len(fds) != 1:
            s.close()
            raise ZbcclRemoteError(f"heap: rank {peer} sent no segment descriptor", ranks=(peer,))
        try:
            size = os.fstat(fds[0]).st_size
            if size != nbytes:
                raise ZbcclRemoteError(
                    f"heap: rank {peer}'s segment has {size} bytes, expected {nbytes}", ranks=(peer,))
            addr = map_fd(fds[0], nbytes, populate=self.populate)
        finally:
            os.close(fds[0])
        self.segments[peer] = Segment(peer, addr, nbytes, "cpu", owner=False)
        s.setblocking(False)
        self._conns[peer] = s
        self._fd_to_rank[s.fileno()] = peer
        self._poll.register(s.fileno(), select.POLLIN | select.POLLHUP | select.POLLERR
                            | getattr(select, "POLLRDHUP", 0x2000))

    def dead_peers(self) -> list[int]:
        # Nothing is ever sent after the handshake, so any event on a peer's
        # connection means the peer closed it: it exited or was killed.
        return sorted({self._fd_to_rank[fd] for fd, _ in self._poll.poll(0) if fd in self._fd_to_rank})

    def liveness_fd(self, rank: int) -> int:
        conn = self._conns.get(rank)
        return conn.fileno() if conn is not None else -1

    def close(self, *, unmap: bool) -> None:
        for s in list(self._conns.values()) + list(self._accepted.values()):
            try:
                s.close()
            except OSError:
                pass
        self._conns.clear()
        self._accepted.clear()
        self._fd_to_rank.clear()
        self._poll = select.poll()
        if unmap:
            for seg in self.segments.values():
                unmap_addr(seg.addr, seg.nbytes)
        self.segments.clear()
