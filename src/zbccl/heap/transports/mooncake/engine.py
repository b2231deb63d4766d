"""Mooncake Transfer Engine, loaded lazily, and what zbccl needs of it.

The engine (``mooncake.engine.TransferEngine``, the ``mooncake-transfer-engine``
wheels) does one-sided reads and writes of registered memory between
processes. Facts this transport relies on (``docs/mooncake.md``):

* ``P2PHANDSHAKE``: no metadata server; each engine serves its own
  handshake RPC, and a peer is addressed by its session id ``"ip:rpc_port"``;
* over TCP protocol v2 a completed write has landed in the target's memory,
  so a data write followed by a flag write is ordered;
* the target bounds-checks every remote address against its registered
  buffers (rc -1, nothing touched), one buffer per transfer: a transfer may
  not span two registrations;
* ``protocol="rdma"`` without an HCA falls back to TCP silently: the
  transport actually obtained is read back (:attr:`MooncakeEngine.transport`);
* a transfer to a dead process fails at once (connection refused); one over
  a cut link fails after ``MC_TCP_PROGRESS_TIMEOUT_SEC`` (zbccl sets 5 s when
  unset, Mooncake's default is 30 s).
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable

import torch

from .... import env, native
from ....errors import ZbcclSystemError

__all__ = ["INSTALL", "MooncakeEngine", "load", "missing_reason", "local_address", "probe"]

_log = logging.getLogger("zbccl")

#: How to install what the transport needs (said by every "cannot load" error).
INSTALL = ("pip install 'zbccl[internode]' (mooncake-transfer-engine-non-cuda; the CUDA wheel "
           "mooncake-transfer-engine on GPU nodes) and apt-get install -y libibverbs1")

#: Seconds a transfer over a silent link may hang before Mooncake fails it (set when unset).
STALL_SECONDS = 5
#: Bytes of the RDMA bounce buffer.
STAGE_BYTES = 4 << 20
#: A transfer's wait (``MooncakeEngine._await``): polls that only yield the core, then naps doubling from
#: ``_NAP_NS`` to ``_MAX_NAP_NS``; the bound Mooncake's synchronous calls apply (its transfer timeout, 30 s by
#: default, plus a second per GiB).
_YIELDS, _NAP_NS, _MAX_NAP_NS = 16, 5_000, 200_000
_GIVE_UP_EVERY = 0.1
_FAILED, _GAVE_UP, _UNSUBMITTED = -1, -2, -3
TRANSFER_TIMEOUT_S = 30.0
_NO_BATCH = (0, -1, (1 << 64) - 1)  # what a failed submission returns (batch_transfer_async: 0; submit: -1)


#: What Mooncake's ``initialize`` writes to stderr on every successful start (glog, error level, before the engine
#: has registered anything: its own lookup of a segment it is about to create), with glog's header of a first line.
_BENIGN = (b"transfer_metadata.cpp", b"Local segment descriptor not found"), \
    (b"WARNING: Logging before InitGoogleLogging() is written to STDERR",)


class _without:
    """Run a block with fd 2 into a temporary file, then write everything back to fd 2 except the lines that
    contain every part of one of ``lines`` (tuples of bytes). Where fd 2 cannot be redirected, a plain block."""

    def __init__(self, lines) -> None:
        self.lines, self.saved, self.tmp = lines, None, None

    def __enter__(self) -> None:
        import tempfile

        try:
            sys.stderr.flush()
            self.tmp = tempfile.TemporaryFile()
            self.saved = os.dup(2)
            os.dup2(self.tmp.fileno(), 2)
        except (OSError, ValueError):
            self._close()

    def __exit__(self, *exc) -> None:
        if self.saved is None:
            return
        os.dup2(self.saved, 2)
        self.tmp.seek(0)
        kept = [ln for ln in self.tmp.read().splitlines(keepends=True)
                if not any(all(part in ln for part in parts) for parts in self.lines)]
        try:
            if kept:
                os.write(2, b"".join(kept))
        except OSError:  # (stderr closed meanwhile: nothing to say it on)
            pass
        self._close()

    def _close(self) -> None:
        if self.saved is not None:
            os.close(self.saved)
        if self.tmp is not None:
            self.tmp.close()
        self.saved = self.tmp = None


def load():
    """The ``mooncake.engine`` module; a :class:`ZbcclSystemError` saying how to install it when it cannot load."""
    # Mooncake reads its settings when it loads (set here, before the first import; a launcher's own MC_*
    # values win): its log level (INFO lines on every connection otherwise), the stall timeouts, the ports.
    if "mooncake.engine" not in sys.modules:
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
        os.environ.setdefault("MC_TCP_PROGRESS_TIMEOUT_SEC", str(STALL_SECONDS))
        os.environ.setdefault("MC_TCP_STATUS_TIMEOUT_SEC", str(STALL_SECONDS))
        ports = env.MOONCAKE_PORTS.get()
        if ports is not None:
            os.environ["MC_MIN_RPC_PORT"], os.environ["MC_MAX_RPC_PORT"] = str(ports[0]), str(ports[1])
    try:
        from mooncake import engine  # noqa: PLC0415 - optional dependency, imported when chosen
    except ImportError as exc:
        text = str(exc)
        if "libibverbs" in text:
            raise ZbcclSystemError(
                f"heap: the mooncake transport cannot load, expected libibverbs1 installed (Mooncake needs it "
                f"even for TCP), got ImportError: {text}; install it: apt-get install -y libibverbs1") from None
        raise ZbcclSystemError(
            f"heap: the mooncake transport needs Mooncake Transfer Engine, expected the mooncake package, got "
            f"ImportError: {text}; install it: {INSTALL}") from None
    return engine


def missing_reason() -> str | None:
    """Why the mooncake transport cannot load here (for skips and ``zbccl info``), or None."""
    try:
        load()
    except ZbcclSystemError as exc:
        return str(exc)
    return None


def local_address(store_host: str | None, *, multi_host: bool) -> str:
    """The address peers reach this rank at: ``ZBCCL_MOONCAKE_HOST``, else the local end of the route to the
    store's host (no packet is sent), else the hostname's address.

    A loopback address cannot serve ranks on other hosts (the store's host may be ``localhost`` for the rank
    that runs it, and Debian maps the hostname to 127.0.1.1): then the route to any other address is tried,
    and a clear error says to set ``ZBCCL_MOONCAKE_HOST`` when there is none.
    """
    chosen = env.MOONCAKE_HOST.get()
    if chosen:
        return chosen
    found = _route_to(store_host) if store_host else None
    if found is None:
        try:
            found = socket.gethostbyname(socket.gethostname())
        except OSError:
            found = "127.0.0.1"
    # Hosts made by ZBCCL_HOST_ID share this machine (tests): loopback reaches them all.
    if found.startswith("127.") and multi_host and not env.HOST_ID.get():
        found = _route_to("192.0.2.1") or found  # TEST-NET-1: never contacted, only routed
        if found.startswith("127."):
            raise ZbcclSystemError(
                "heap: no address for Mooncake that other hosts can reach, expected a non-loopback address (the "
                f"route to the store's host {store_host!r} or a default route), got {found}; set ZBCCL_MOONCAKE_HOST")
    return found


def _route_to(host: str) -> str | None:
    """The local address of the route to ``host`` (a UDP socket's connect sends nothing), or None."""
    try:
        target = socket.gethostbyname(host)
        if target.startswith("127."):
            return "127.0.0.1"
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((target, 9))
            return s.getsockname()[0]
    except OSError:
        return None


def probe(ip: str, port: int, timeout: float) -> str:
    """What a TCP connect to a peer engine's handshake port says: ``"alive"``, ``"dead"`` (refused: its host
    answers, its process is gone) or ``"unreachable"`` (no answer: the host or the link is down)."""
    try:
        with socket.create_connection((ip, port), timeout=timeout):
            return "alive"
    except ConnectionRefusedError:
        return "dead"
    except OSError as exc:
        if exc.errno == errno.ECONNREFUSED:
            return "dead"
        return "unreachable"


class MooncakeEngine:
    """One ``TransferEngine`` of this process, initialised in P2P-handshake mode (no metadata server)."""

    def __init__(self, host: str, *, protocol: str, device: str = "") -> None:
        module = load()
        ports = env.MOONCAKE_PORTS.get()
        self._e = module.TransferEngine()
        self._pid = os.getpid()  # a forked child's copy must not call into it (:meth:`close`)
        self._spans: list[tuple[int, int]] = []  # registrations: (addr, bytes)
        self._bounce: torch.Tensor | None = None  # RDMA staging for buffers outside the registrations
        self._bounce_lock = threading.Lock()
        #: Bytes this engine's completed transfers moved: [written, read, transfers] (``counters``).
        self._moved = [0, 0, 0]
        self._moved_lock = threading.Lock()
        #: Tests: stage every transfer as RDMA would (the path then runs over TCP too).
        self.stage_all = False
        self.host = host
        self.protocol = protocol
        with _without(_BENIGN):
            rc = self._e.initialize(host, "P2PHANDSHAKE", protocol, device)
        if rc != 0:
            raise ZbcclSystemError(
                f"heap: Mooncake engine initialize failed, expected 0, got {rc} (host {host}, protocol {protocol}"
                f"{', ports ' + '-'.join(map(str, ports)) if ports else ''})")
        self.rpc_port = int(self._e.get_rpc_port())
        self._nap = native.core().nap
        #: ``lost(session id) -> bool``: whether that peer is known lost (dead, or its host unreachable); set by
        #: the transport once its liveness monitor runs. A transfer's wait asks it and gives up on a lost peer.
        self.lost: Callable[[str], bool] | None = None
        if ports is not None and not ports[0] <= self.rpc_port <= ports[1]:
            raise ZbcclSystemError(
                f"heap: the Mooncake handshake port is outside ZBCCL_MOONCAKE_PORTS, expected {ports[0]}-{ports[1]}, "
                f"got {self.rpc_port} (Mooncake reads its port range when it loads: set the variable before the "
                "first zbccl.init of the process)")
        #: The transport Mooncake actually runs: "rdma" only where it found an HCA (it falls back silently).
        self.transport = "rdma" if protocol == "rdma" and _has_hca(self._e.get_local_topology(device or None)) \
            else "tcp"
        if self.transport != protocol:
            _log.warning("zbccl: Mooncake was asked for %s but found no RDMA device; running over %s",
                         protocol, self.transport)
        else:
            _log.info("zbccl: Mooncake transport %s at %s", self.transport, self.session_id)

    @property
    def session_id(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    def register(self, addr: int, nbytes: int) -> None:
        """Register ``[addr, addr+nbytes)`` (once: unregistered by :meth:`close`)."""
        rc = self._e.register_memory(addr, nbytes)
        if rc != 0:
            raise ZbcclSystemError(f"heap: Mooncake could not register {nbytes} bytes, expected 0, got {rc}")
        self._spans.append((addr, nbytes))

    def registered(self, addr: int, nbytes: int) -> bool:
        """Whether ``[addr, addr+nbytes)`` lies within one registration of this engine."""
        return any(lo <= addr and addr + nbytes <= lo + n for lo, n in self._spans)

    def transfer(self, peer: str, write: bool, local: int, remote: int, nbytes: int) -> int:
        """One write (or read) of ``nbytes`` between ``local`` and a peer's registered ``remote``; Mooncake's rc.

        Over RDMA the local side must be registered too: a buffer outside this engine's registrations goes
        through a registered bounce buffer (``STAGE_BYTES`` at a time). TCP needs no staging.
        """
        op = self.write if write else self.read
        if not self.stage_all and (self.transport != "rdma" or self.registered(local, nbytes)):
            return op(peer, local, remote, nbytes)
        with self._bounce_lock:
            if self._bounce is None:
                self._bounce = torch.empty(STAGE_BYTES, dtype=torch.uint8)
                self.register(self._bounce.data_ptr(), STAGE_BYTES)
            stage = self._bounce.data_ptr()
            for at in range(0, nbytes, STAGE_BYTES):
                n = min(STAGE_BYTES, nbytes - at)
                if write:
                    ctypes.memmove(stage, local + at, n)
                rc = op(peer, stage, remote + at, n)
                if rc != 0:
                    return rc
                if not write:
                    ctypes.memmove(local + at, stage, n)
        return 0

    def close(self) -> None:
        """Unregister everything (no peer write lands in this process from now on) and drop the engine.

        In a process forked from the engine's, nothing is called: the engine's threads are not there (a call that
        needs them crashes the child), and its sockets are shared with the parent. The child's copy is kept alive
        to the end, so that its destructor never runs there either."""
        if os.getpid() != self._pid:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(self._e))  # never freed, even at interpreter exit
            self._spans.clear()
            self._e = None
            return
        self.unregister()
        self._bounce = None
        self._e = None

    def unregister(self) -> None:
        """Unregister everything: no peer write lands in this process from now on (transfers this process
        started may still complete). Nothing in a forked child (see :meth:`close`)."""
        if os.getpid() == self._pid:
            for addr, _ in self._spans:
                self._e.unregister_memory(addr)
        self._spans.clear()

    def counters(self) -> dict[str, int]:
        """What this engine's completed transfers moved since it started (all threads, the liveness
        monitor's reads included): ``{"written", "read", "transfers"}``, bytes and calls."""
        with self._moved_lock:
            written, read, calls = self._moved
        return {"written": written, "read": read, "transfers": calls}

    def _count(self, rc: int, write: bool, nbytes: int) -> int:
        if rc == 0:
            with self._moved_lock:
                self._moved[0 if write else 1] += nbytes
                self._moved[2] += 1
        return rc

    # Transfers: submitted asynchronously and awaited here. Mooncake's own synchronous calls poll the completion
    # in a loop that never yields, so a rank inside one keeps a whole core busy while the engine threads that
    # must run to move its bytes (its own, and the peer's on shared cores) wait for one; this wait yields, then
    # naps. A submission that fails is retried once through the synchronous call, which reconnects a segment
    # whose connection broke; a failed transfer is the caller's to retry (``MooncakeTransport._run`` asks the
    # liveness monitor first), and one given up on (``lost(peer)`` said its peer is lost) is not retried.
    # ``watch=False``: never ask :attr:`lost` (the liveness monitor's own probes, whose duration is its evidence,
    # and the atomic server's replies).
    def write(self, peer: str, local: int, remote: int, nbytes: int, *, watch: bool = True) -> int:
        return self.write_many(peer, [local], [remote], [nbytes], watch=watch)

    def read(self, peer: str, local: int, remote: int, nbytes: int, *, watch: bool = True) -> int:
        return self.read_many(peer, [local], [remote], [nbytes], watch=watch)

    def read_many(self, peer: str, locals_: list[int], remotes: list[int], sizes: list[int], *,
                  watch: bool = True) -> int:
        rc = self._await([self._e.batch_transfer_async_read(peer, [a], [b], [n])
                          for a, b, n in zip(locals_, remotes, sizes)], sum(sizes), peer if watch else None)
        if rc == _UNSUBMITTED:
            rc = self._e.batch_transfer_sync_read(peer, locals_, remotes, sizes) if len(sizes) > 1 else \
                self._e.transfer_sync_read(peer, locals_[0], remotes[0], sizes[0])
        return self._count(-1 if rc else 0, False, sum(sizes))

    def write_many(self, peer: str, locals_: list[int], remotes: list[int], sizes: list[int], *,
                   watch: bool = True) -> int:
        rc = self._await([self._e.transfer_submit_write(peer, a, b, n)
                          for a, b, n in zip(locals_, remotes, sizes)], sum(sizes), peer if watch else None)
        if rc == _UNSUBMITTED:
            rc = self._e.batch_transfer_sync_write(peer, locals_, remotes, sizes) if len(sizes) > 1 else \
                self._e.transfer_sync_write(peer, locals_[0], remotes[0], sizes[0])
        return self._count(-1 if rc else 0, True, sum(sizes))

    def submit_write(self, peer: str, local: int, remote: int, nbytes: int) -> int | None:
        """Start one write (never blocks); its batch for :meth:`status`, or None when it was not submitted."""
        batch = self._e.transfer_submit_write(peer, local, remote, nbytes)
        return None if batch in _NO_BATCH else batch

    def status(self, batch: int, nbytes: int) -> int:
        """A submitted write's state (never blocks): 1 landed (counted), 0 in flight, ``_FAILED``. Mooncake frees
        a batch once it reported it landed or failed: ask until then, never after."""
        st = self._e.transfer_check_status(batch)
        if st == 1:
            self._count(0, True, nbytes)
        return st if st in (0, 1) else _FAILED

    def _await(self, batches: list[int], nbytes: int, peer: str | None) -> int:
        """0 once every batch (one transfer each) completed; ``_UNSUBMITTED`` when one was not submitted;
        ``_FAILED`` when one failed; ``_GAVE_UP`` when :attr:`lost` (asked every ``_GIVE_UP_EVERY`` seconds
        unless ``peer`` is None) says ``peer`` is lost, or past the bound Mooncake's synchronous calls apply (``TRANSFER_TIMEOUT_S`` plus
        a second per GiB). A batch given up on before it completed stays allocated in the engine (Mooncake frees
        completed or failed batches only), and may still move its bytes if the link comes back: the price of
        never hanging, paid only on the way to an error that names the lost peer."""
        check, nap, lost = self._e.transfer_check_status, self._nap, self.lost
        pending = [b for b in batches if b not in _NO_BATCH]
        if len(pending) < len(batches):
            if pending:  # a submission failed: let the others finish (their buffers are the caller's)
                self._await(pending, nbytes, peer)
            return _UNSUBMITTED
        start = time.monotonic()
        deadline, ask = start + TRANSFER_TIMEOUT_S + nbytes / (1 << 30), start + _GIVE_UP_EVERY
        polls, pause = 0, 0
        while pending:
            st = check(pending[0])
            if st == 1:
                pending.pop(0)
                continue
            if st != 0:  # -1 failed (freed), -2 timed out
                if len(pending) > 1:
                    self._await(pending[1:], nbytes, peer)
                return _FAILED
            polls += 1
            if polls < _YIELDS:
                os.sched_yield()
                continue
            now = time.monotonic()
            if now > deadline:
                return _GAVE_UP
            if lost is not None and peer is not None and now > ask:
                if lost(peer):
                    return _GAVE_UP
                ask = now + _GIVE_UP_EVERY
            pause = min(2 * pause or _NAP_NS, _MAX_NAP_NS)
            nap(pause)
        return 0


def _has_hca(topology: str) -> bool:
    """Whether Mooncake's local topology (``{"cpu:0": [[preferred HCAs], [other HCAs]], ...}``) lists an HCA."""
    try:
        parsed = json.loads(topology)
    except (TypeError, ValueError):
        return False
    return any(any(hcas for hcas in lists if isinstance(hcas, list)) for lists in parsed.values()
               if isinstance(lists, list))
