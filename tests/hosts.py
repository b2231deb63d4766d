"""Hosts on one machine: Linux namespaces joined by veth pairs, for the inter-host tests and benchmarks.

``with NetnsHosts(2) as hosts:`` builds, as root:

* a bridge ``zbb<tag>`` in the root namespace, holding ``<net>.254``: the
  "store host" (the test process, which hosts the rendezvous TCPStore there);
* per host ``i``, a network namespace ``zbh<tag><i>`` holding one end of a veth
  pair (``<net>.<i+1>/24``), whose other end ``zbv<tag><i>`` sits on the bridge.

Each host's ranks run under ``ip netns exec zbh<tag><i> unshare --pid --ipc
--uts --mount --fork --mount-proc``, all the host's ranks in one such shell,
so that only the network connects two hosts: abstract sockets, pidfds,
``/proc`` and hostnames stay per host. ``tag`` and ``net`` are random, so two
sessions never collide on names or addresses.

:meth:`NetnsHosts.kill_host` SIGKILLs every process of a host (a host that
died); :meth:`NetnsHosts.cut` takes its link down (a partition). Leaving the
``with`` block (a failed test too) kills what is left and deletes every
namespace, veth and the bridge. Where namespaces cannot be made (not root,
no ``ip``/``unshare``, a container without CAP_NET_ADMIN), entering raises
:class:`HostsUnavailable` with the reason; tests skip with it.

:func:`run_hosts` runs ``fn(ctx, **kwargs)`` in every rank, as ``tests/spawn.py``'s
``run_world`` does within one host: it checks every exit code, returns the
results by rank, and kills everything on timeout naming the ranks that had not
finished. A ``director`` runs in the test process meanwhile (with the hosts and
the store) to kill or cut a host when the ranks ask for it through the store.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

__all__ = ["HostsUnavailable", "NetnsHosts", "run_hosts", "hosts_skip_reason"]

ROOT = Path(__file__).resolve().parent.parent


class HostsUnavailable(RuntimeError):
    """Namespace hosts cannot be made here; the message says why."""


def hosts_skip_reason() -> str | None:
    """Why namespace hosts cannot be made on this machine, or None when they can (cheap: no namespace made)."""
    if not sys.platform.startswith("linux"):
        return f"namespace hosts need Linux, got {sys.platform}"
    if os.geteuid() != 0:
        return f"namespace hosts need root (ip netns, unshare), got uid {os.geteuid()}"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"namespace hosts need `{tool}` (iproute2, util-linux), not found on PATH"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


class NetnsHosts:
    """``n`` namespace hosts on a bridge (see the module docstring). A context manager."""

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"hosts: expected at least 1 host, got {n}")
        self.n = n
        self.tag = secrets.token_hex(2)
        self.net = f"10.{secrets.randbelow(128) + 64}.{secrets.randbelow(256)}"
        self.bridge = f"zbb{self.tag}"
        self.procs: list[subprocess.Popen] = []
        self._made: list[tuple[str, str]] = []  # ("netns"|"link", name), in creation order

    def ns(self, i: int) -> str:
        return f"zbh{self.tag}{i}"

    def veth(self, i: int) -> str:
        """The root-side end of host ``i``'s link (down: the host is cut off)."""
        return f"zbv{self.tag}{i}"

    def addr(self, i: int) -> str:
        return f"{self.net}.{i + 1}"

    @property
    def store_addr(self) -> str:
        """The bridge's address: where the test process (the store host) is reached from every host."""
        return f"{self.net}.254"

    def __enter__(self) -> NetnsHosts:
        reason = hosts_skip_reason()
        if reason:
            raise HostsUnavailable(reason)
        try:
            self._setup()
        except BaseException as exc:
            self.teardown()
            if isinstance(exc, subprocess.CalledProcessError):
                raise HostsUnavailable(f"cannot make namespace hosts: `{' '.join(exc.cmd)}` failed: "
                                       f"{(exc.stderr or '').strip()}") from None
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()

    def _setup(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self._made.append(("link", self.bridge))
        _ip("addr", "add", f"{self.store_addr}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i in range(self.n):
            ns, outer, inner = self.ns(i), self.veth(i), f"zbp{self.tag}{i}"
            _ip("netns", "add", ns)
            self._made.append(("netns", ns))
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            self._made.append(("link", outer))
            _ip("link", "set", inner, "netns", ns)
            _ip("link", "set", outer, "master", self.bridge)
            _ip("link", "set", outer, "up")
            _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", inner)
            _ip("-n", ns, "link", "set", inner, "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def popen(self, i: int, argvs: list[list[str]], *, env: dict[str, str], stdout, stderr) -> subprocess.Popen:
        """Start ``argvs`` (one command each: a host's ranks) together in host ``i``'s namespaces."""
        quoted = " & ".join(" ".join(_sh_quote(a) for a in argv) for argv in argvs)
        # sh stays pid 1 of the host (a rank as pid 1 would be immune to its own host's signals).
        script = f"hostname {self.ns(i)}; {quoted} & wait"
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.ns(i), "unshare", "--pid", "--ipc", "--uts", "--mount", "--fork",
             "--mount-proc", "sh", "-c", script], env=env, cwd=ROOT, stdout=stdout, stderr=stderr,
            start_new_session=True)
        self.procs.append(proc)
        return proc

    def pids(self, i: int) -> list[int]:
        got = _ip("netns", "pids", self.ns(i), check=False)
        return [int(p) for p in got.stdout.split()]

    def kill_host(self, i: int) -> None:
        """SIGKILL every process of host ``i`` (the host died)."""
        for pid in self.pids(i):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def cut(self, i: int, *, up: bool = False) -> None:
        """Take host ``i``'s link down (a partition; ``up=True`` heals it)."""
        _ip("link", "set", self.veth(i), "up" if up else "down")

    def teardown(self) -> None:
        """Kill every process left in the hosts, then delete what was made (idempotent, never raises)."""
        for kind, name in self._made:
            if kind == "netns":
                for pid in _ip("netns", "pids", name, check=False).stdout.split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except (ProcessLookupError, ValueError):
                        pass
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for kind, name in reversed(self._made):
            if kind == "netns":
                _ip("netns", "del", name, check=False)
            else:
                _ip("link", "del", name, check=False)
        self._made.clear()
        self.procs.clear()


def _sh_quote(s: str) -> str:
    return "'" + s.replace("'", "'\"'\"'") + "'"


def run_hosts(fn: Callable[..., Any], hosts: NetnsHosts, ranks_per_host: int = 1, *, timeout: float = 120.0,
              expect_exit: dict[int, bool] | None = None, director: Callable[[NetnsHosts, dist.Store], None] | None
              = None, env: dict[str, str] | None = None, **kwargs) -> list[Any]:
    """Run ``fn(ctx, **kwargs)`` in ``hosts.n * ranks_per_host`` ranks (host ``i`` holds ranks
    ``i*ranks_per_host ...``); return the results by rank.

    ``ctx`` is a ``tests.spawn.RankContext`` whose ``store()`` reaches the TCPStore this process hosts on the
    bridge. ``fn`` must be a module-level function (it is imported by name in each rank); ``kwargs`` JSON.
    ``expect_exit`` lists hosts (index -> True) that are expected not to finish (killed by the director): their
    ranks' results are None. Raises AssertionError with the failing rank's traceback, or naming the ranks that
    had not finished by ``timeout``.
    """
    world = hosts.n * ranks_per_host
    store = dist.TCPStore(hosts.store_addr, 0, world, is_master=True, timeout=timedelta(seconds=timeout),
                          wait_for_workers=False)
    work = Path(tempfile.mkdtemp(prefix="zbccl-hosts-"))
    spec = {"fn": f"{fn.__module__}:{fn.__qualname__}", "kwargs": kwargs, "world_size": world,
            "host": hosts.store_addr, "port": store.port, "out": str(work)}
    (work / "spec.json").write_text(json.dumps(spec))
    penv = dict(os.environ, **(env or {}))
    penv["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), penv.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    expect = expect_exit or {}
    logs, procs = [], []
    try:
        for i in range(hosts.n):
            log = open(work / f"host-{i}.log", "wb")
            logs.append(log)
            argvs = [[sys.executable, "-m", "tests.hostrank", str(work / "spec.json"), str(i * ranks_per_host + k)]
                     for k in range(ranks_per_host)]
            procs.append(hosts.popen(i, argvs, env=penv, stdout=log, stderr=subprocess.STDOUT))
        failure: list[BaseException] = []
        if director is not None:
            def direct() -> None:
                try:
                    director(hosts, store)
                except BaseException as exc:  # noqa: BLE001 - reported below
                    failure.append(exc)
            thread = threading.Thread(target=direct, daemon=True)
            thread.start()
        deadline = time.monotonic() + timeout
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        results, missing = [], []
        for r in range(world):
            out = work / f"out-{r}.json"
            host = r // ranks_per_host
            if not out.exists():
                if expect.get(host):
                    results.append(None)
                    continue
                missing.append(r)
                results.append(None)
                continue
            got = json.loads(out.read_text())
            if "error" in got:
                logs_text = "\n".join(f"--- host {i} log:\n{_tail(work / f'host-{i}.log')}" for i in range(hosts.n))
                raise AssertionError(f"rank {r} (host {host}) failed:\n{got['error']}\n{logs_text}")
            results.append(got["ok"])
        if failure:
            raise AssertionError(f"the director failed: {failure[0]!r}")
        if missing:
            logs_text = "\n".join(f"--- host {r // ranks_per_host}:\n{_tail(work / f'host-{r // ranks_per_host}.log')}"
                                  for r in missing)
            raise AssertionError(f"ranks {missing} did not finish within {timeout:.0f}s (or died)\n{logs_text}")
        return results
    finally:
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for i in range(hosts.n):
            hosts.kill_host(i)
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for log in logs:
            log.close()
        shutil.rmtree(work, ignore_errors=True)


def _tail(path: Path, n: int = 3000) -> str:
    try:  # torch's store warnings repeat once a second while a rank waits: not worth the space
        lines = path.read_bytes().decode(errors="replace").splitlines()
        return "\n".join(ln for ln in lines if "waitForInput" not in ln)[-n:]
    except OSError:
        return "(no log)"
