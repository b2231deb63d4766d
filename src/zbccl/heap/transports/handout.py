"""Authenticated handout of a segment descriptor over an abstract Unix socket.

Threat: every abstract socket name is listed to every user in
``/proc/net/unix``, and passing a descriptor bypasses its file mode. So:

* the server sends the descriptor only to a connection whose kernel-verified
  credentials (``SO_PEERCRED``: pid and effective uid at ``connect``) are
  those of a member of the job, as published through the store; anybody else
  is disconnected at once, without reading a byte from them;
* the server never reads from a client, so a silent or hostile connection
  cannot hold it up: one ``poll`` loop accepts, checks and answers;
* the client checks the server's credentials the same way (``SO_PEERCRED`` of
  a connected socket is the listener's), so a process that bound a rank's
  name first (a squatter) is refused before anything is received;
* names carry a random per-rank token, so a squatter cannot bind a name
  before its owner (it is visible only once bound, and then it is taken);
* every descriptor is close-on-exec, received ones included
  (``MSG_CMSG_CLOEXEC``).

Who sends what: rank ``r`` listens on ``\\0zbccl-<job>-<r>-<token>``; each
local peer connects, the server answers with its *offer* and closes the
connection. The shm transport offers one byte carrying its memfd; the cuda
transport a small JSON payload (its chunk sizes) carrying several descriptors
(a host control memfd, its signal pad's and its data chunks' VMM descriptors),
and keeps serving (``persistent``) so that a peer can fetch the chunks a
growth added. Nothing else flows. Around it, :func:`agree` all-gathers what
each rank publishes (or the error it hit, so every rank fails together) and
:func:`check_uids` keeps other users out.

Shared by the transports of one host (shm, cuda), as is :mod:`.liveness`.
"""

from __future__ import annotations

import array
import errno
import json
import os
import select
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass

from ...bootstrap.base import Bootstrap
from ...bootstrap.store import in_range, parse_record
from ...errors import ZbcclError, ZbcclRemoteError, ZbcclSystemError

__all__ = ["Member", "FdServer", "sock_name", "peer_cred", "receive", "receive_fd", "member_of", "agree", "check_uids",
           "os_error", "MAX_FDS"]

_UCRED = struct.Struct("3i")  # pid, uid, gid
_SEND_TIMEOUT_S = 5.0  # one byte into a fresh socket: only a dead peer makes it wait
_ACCEPT_BATCH = 64
#: Most descriptors one answer carries (the kernel's SCM_MAX_FD is 253).
MAX_FDS = 250


@dataclass(frozen=True)
class Member:
    """What a local rank publishes through the store for the handout."""

    rank: int
    pid: int
    uid: int
    token: str
    cookie: int


def sock_name(job_id: str, rank: int, token: str) -> str:
    return f"\0zbccl-{job_id}-{rank}-{token}"


def peer_cred(sock: socket.socket) -> tuple[int, int]:
    """``(pid, euid)`` of the process at the other end of ``sock``, as the kernel recorded it."""
    pid, uid, _ = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return pid, uid


class FdServer(threading.Thread):
    """Hands ``fd`` (or ``offer()``'s payload and descriptors) to each expected member that connects,
    once (``persistent``: every time it connects, until :meth:`stop`); see the module docstring.

    Binding happens in the constructor (a taken name raises a clear error at
    once); serving starts with :meth:`serve`, when the members are known.
    :meth:`stop` closes the listener and joins the thread, and must run before
    ``fd`` (or any offered descriptor) is closed so that a closed (and reused)
    descriptor number is never sent. ``offer`` runs on the server thread: it
    must be thread-safe against whoever changes what it offers.
    """

    def __init__(self, job_id: str, rank: int, token: str, fd: int = -1, *,
                 offer: Callable[[], tuple[bytes, list[int]]] | None = None, persistent: bool = False) -> None:
        super().__init__(name=f"zbccl-fdserver-{rank}", daemon=True)
        self.fd = fd
        self.offer = offer if offer is not None else (lambda: (b"z", [self.fd]))
        self.persistent = persistent
        self.pid = os.getpid()  # a forked child's copy must not wake (stop) its parent's thread
        self.expected: dict[int, Member] = {}
        self.served: set[int] = set()
        self.rejected = 0
        self.error: BaseException | None = None
        try:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
        except OSError as exc:
            raise os_error("heap: cannot listen for segment requests", exc, rank) from None
        try:
            self.sock.bind(sock_name(job_id, rank, token))
            self.sock.listen(128)
        except OSError as exc:
            self.sock.close()
            if exc.errno == errno.EADDRINUSE:
                raise ZbcclSystemError(
                    f"heap: the socket name of rank {rank} (job {job_id}) is already bound by another "
                    "process, expected it free (a squatter, or two jobs sharing an id)", ranks=(rank,)) from None
            raise ZbcclSystemError(f"heap: cannot listen for segment requests: {exc}", ranks=(rank,)) from None
        try:
            self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as exc:
            self.sock.close()
            raise os_error("heap: cannot listen for segment requests", exc, rank) from None

    def serve(self, members: list[Member]) -> None:
        """Start answering ``members`` (by pid), each once."""
        self.expected = {m.pid: m for m in members}
        self.start()

    def run(self) -> None:
        poller = select.poll()
        try:
            poller.register(self.sock.fileno(), select.POLLIN)
            poller.register(self._wake_r, select.POLLIN)
        except ValueError:  # -1: stop() ran before this thread did (an interrupt inside serve()'s start)
            self.sock.close()
            return
        try:
            while self.persistent or len(self.served) < len(self.expected):
                events = dict(poller.poll())
                if self._wake_r in events:
                    return
                self._accept_all()
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            self.error = exc
        finally:
            # Every member is served (or we were stopped): the name goes away at once,
            # and anyone still queued is refused rather than left waiting.
            self.sock.close()

    def _accept_all(self) -> None:
        # A bounded batch, so that a flood of connections cannot keep stop() waiting.
        for _ in range(_ACCEPT_BATCH):
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            with conn:
                self._answer(conn)

    def _answer(self, conn: socket.socket) -> None:
        pid, uid = peer_cred(conn)
        member = self.expected.get(pid)
        if member is None or member.uid != uid or (member.rank in self.served and not self.persistent):
            self.rejected += 1  # not a member (or a second try): hang up, read nothing
            return
        conn.settimeout(_SEND_TIMEOUT_S)
        payload, fds = self.offer()
        try:
            socket.send_fds(conn, [payload], fds)
        except OSError:
            return  # the peer went away; it reports its own failure
        self.served.add(member.rank)

    def stop(self) -> None:
        """Stop accepting and join the thread (idempotent). Safe before :meth:`serve`.

        In a process forked from the server's, only this copy's descriptors close: the
        parent's thread (which shares the wake-up pipe) keeps serving.
        """
        if os.getpid() != self.pid:
            self.sock.close()
            for fd in (self._wake_r, self._wake_w):
                if fd >= 0:
                    os.close(fd)
            self._wake_r = self._wake_w = -1
            return
        if self._wake_w >= 0:
            try:
                os.write(self._wake_w, b"x")
            except OSError:
                pass
        if self.is_alive() or self.ident is not None:
            self.join()
        self.sock.close()
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1


def os_error(what: str, exc: OSError, rank: int | None = None) -> ZbcclSystemError:
    """``exc`` as this rank's :class:`ZbcclSystemError`; out of descriptors says which limit and how to raise it."""
    if exc.errno in (errno.EMFILE, errno.ENFILE):
        return ZbcclSystemError(
            f"{what}: out of file descriptors, expected room for the heap's (a memfd and a pidfd per local "
            f"peer, a socket while they are handed out), got {exc} (raise `ulimit -n`, RLIMIT_NOFILE)",
            ranks=(rank,) if rank is not None else ())
    return ZbcclSystemError(f"{what}: {exc}", ranks=(rank,) if rank is not None else ())


def receive_fd(job_id: str, peer: Member, *, timeout: float) -> tuple[int, int]:
    """Connect to ``peer``'s server, check it is ``peer``; return ``(memfd, pidfd)``.

    Both descriptors are close-on-exec; the caller owns them.
    """
    _, fds, pidfd = receive(job_id, peer, timeout=timeout, maxfds=1, to_eof=False)
    if len(fds) != 1:
        for fd in fds:
            os.close(fd)
        os.close(pidfd)
        raise ZbcclRemoteError(f"heap: rank {peer.rank} sent no segment descriptor, expected 1, got {len(fds)}",
                               ranks=(peer.rank,))
    return fds[0], pidfd


def receive(job_id: str, peer: Member, *, timeout: float, maxfds: int = MAX_FDS, pidfd: bool = True,
            to_eof: bool = True) -> tuple[bytes, list[int], int]:
    """Connect to ``peer``'s server, check it is ``peer``; return ``(payload, descriptors, pidfd)``.

    The payload is read to the end (the server closes the connection after its
    answer; ``to_eof=False``: only its first segment, for one-byte answers); every descriptor is close-on-exec and the caller's to close; the
    pidfd (-1 unless ``pidfd``) watches the process verified at connect time.
    """
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    except OSError as exc:
        raise os_error(f"heap: cannot open a socket to rank {peer.rank}'s segment server", exc) from None
    s.settimeout(timeout)
    watch, fds = -1, []
    try:
        try:
            s.connect(sock_name(job_id, peer.rank, peer.token))
        except OSError as exc:
            raise ZbcclRemoteError(f"heap: could not reach rank {peer.rank}'s segment server: {exc}",
                                   ranks=(peer.rank,)) from None
        pid, uid = peer_cred(s)
        if (pid, uid) != (peer.pid, peer.uid):
            raise ZbcclSystemError(
                f"heap: the socket of rank {peer.rank} is held by another process, expected pid {peer.pid} "
                f"uid {peer.uid}, got pid {pid} uid {uid}; refusing its descriptor (or the ranks do not share "
                "one pid namespace, which zbccl needs)", ranks=(peer.rank,))
        if pidfd:
            watch = _pidfd_of(pid, peer.rank)
        msg, fds = _recv_fds(s, peer.rank, maxfds)
        if not fds and not msg:
            raise ZbcclRemoteError(f"heap: rank {peer.rank} sent no segment descriptor, expected at least 1, "
                                   "got 0 (message b'')", ranks=(peer.rank,))
        while to_eof:
            try:
                more = s.recv(1 << 16)
            except OSError as exc:
                raise ZbcclRemoteError(f"heap: could not read rank {peer.rank}'s answer: {exc}",
                                       ranks=(peer.rank,)) from None
            if not more:
                break
            msg += more
    except BaseException:
        for fd in fds:
            os.close(fd)
        if watch >= 0:
            os.close(watch)
        raise
    finally:
        s.close()
    return msg, fds, watch


def _pidfd_of(pid: int, rank: int) -> int:
    """A pidfd of ``rank``'s process, opened while its verified connection is up (no pid reuse yet)."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        raise ZbcclRemoteError(f"heap: rank {rank} (pid {pid}) exited during the handshake",
                               ranks=(rank,)) from None
    except OSError as exc:
        if exc.errno in (errno.EMFILE, errno.ENFILE):
            raise os_error(f"heap: cannot watch rank {rank} (pidfd_open)", exc) from None
        raise ZbcclSystemError(f"heap: pidfd_open failed, expected Linux >= 5.3, got {exc}") from None
    except AttributeError as exc:
        raise ZbcclSystemError(f"heap: pidfd_open failed, expected Linux >= 5.3, got {exc}") from None


def _recv_fds(s: socket.socket, rank: int, maxfds: int) -> tuple[bytes, list[int]]:
    fds = array.array("i")
    try:
        msg, anc, flags, _ = s.recvmsg(1 << 16, socket.CMSG_SPACE(maxfds * fds.itemsize), socket.MSG_CMSG_CLOEXEC)
    except OSError as exc:
        raise ZbcclRemoteError(f"heap: could not get rank {rank}'s segment: {exc}", ranks=(rank,)) from None
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    if flags & socket.MSG_CTRUNC:  # the kernel dropped descriptors: this process is at its limit (or too many)
        for fd in fds:
            os.close(fd)
        raise os_error(f"heap: cannot receive rank {rank}'s segment descriptors (at most {maxfds})",
                       OSError(errno.EMFILE, os.strerror(errno.EMFILE)))
    return msg, list(fds)


def member_of(rank: int, raw: bytes) -> Member:
    """The :class:`Member` rank ``rank`` published (its ``agree`` payload), parsed strictly: the store is
    not authenticated yet when it is read."""
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


def agree(bootstrap: Bootstrap, payload: dict, error: ZbcclError | None, *, timeout: float,
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


def check_uids(me: Member, members: dict[int, Member]) -> ZbcclError | None:
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
