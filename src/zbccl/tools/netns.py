"""Hosts on one machine: Linux namespaces joined by veth pairs, for the inter-host tests and ``zbccl bench --hosts``.

``with NetnsHosts(2) as hosts:`` builds, as root:

* a bridge ``zbb<tag>`` in the root namespace, holding ``<net>.254``: the
  "store host" (the calling process, which hosts the rendezvous TCPStore there);
* per host ``i``, a network namespace ``zbh<tag><i>`` holding one end of a veth
  pair (``<net>.<i+1>/24``, named :meth:`NetnsHosts.ifname`), whose other end
  ``zbv<tag><i>`` sits on the bridge.

Each host's ranks run under ``ip netns exec zbh<tag><i> unshare --pid --ipc
--uts --mount --fork --mount-proc``, all the host's ranks in one such shell,
so that only the network connects two hosts: abstract sockets, pidfds,
``/proc`` and hostnames stay per host. ``tag`` and ``net`` are random, so two
sessions never collide on names or addresses. ``NetnsHosts(n, own_cores=True)``
also gives each host its own cores (the usable ones split into ``n`` disjoint
affinity sets, inherited by every process of the host), so that the hosts do not
compete for a core either, as separate machines would not.

:meth:`NetnsHosts.kill_host` SIGKILLs every process of a host (a host that
died); :meth:`NetnsHosts.cut` takes its link down (a partition). Leaving the
``with`` block (a failure too) kills what is left and deletes every
namespace, veth and the bridge. Where namespaces cannot be made (not root,
no ``ip``/``unshare``, a container without CAP_NET_ADMIN), entering raises
:class:`HostsUnavailable` with the reason; tests skip with it.

:func:`run_hosts` runs ``fn(ctx, **kwargs)`` in every rank, as ``tests/spawn.py``'s
``run_world`` does within one host: it checks every exit code, returns the
results by rank, and kills everything on timeout naming the ranks that had not
finished. A ``director`` runs in the calling process meanwhile (with the hosts
and the store) to kill or cut a host when the ranks ask for it through the store.
Each rank is ``python -m zbccl.tools.netns SPEC RANK`` (:func:`rank_main`): it needs
nothing but an importable zbccl and the module of ``fn``.
"""

from __future__ import annotations

import importlib
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
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ..errors import ZbcclRemoteError, ZbcclSystemError

__all__ = ["HostsUnavailable", "HostsFailure", "HostRank", "NetnsHosts", "run_hosts", "hosts_skip_reason",
           "rank_main"]

#: The folder that holds this zbccl package: every rank imports the same zbccl.
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]


class HostsUnavailable(ZbcclSystemError):
    """Namespace hosts cannot be made here; the message says why."""


class HostsFailure(ZbcclRemoteError, AssertionError):
    """A rank of a :func:`run_hosts` world raised, died, or had not finished by the timeout."""


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

    def __init__(self, n: int, *, own_cores: bool = False) -> None:
        if n < 1:
            raise ValueError(f"hosts: expected at least 1 host, got {n}")
        self.n = n
        #: Per host, the cores its processes may run on, ascending (None: all of this process's). ``own_cores``: the usable
        #: cores split into ``n`` disjoint sets, as separate machines would have them (only where there are at
        #: least as many cores as hosts; otherwise the hosts share them, and :attr:`cores` says so).
        self.cores: list[list[int] | None] = [None] * n
        usable = sorted(os.sched_getaffinity(0))
        if own_cores and len(usable) >= n and shutil.which("taskset"):
            per = len(usable) // n
            self.cores = [usable[i * per:(i + 1) * per] for i in range(n)]
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

    def ifname(self, i: int) -> str:
        """Host ``i``'s own end of its link, as seen inside the host (``GLOO_SOCKET_IFNAME``)."""
        return f"zbp{self.tag}{i}"

    def addr(self, i: int) -> str:
        return f"{self.net}.{i + 1}"

    @property
    def store_addr(self) -> str:
        """The bridge's address: where the calling process (the store host) is reached from every host."""
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
            ns, outer, inner = self.ns(i), self.veth(i), self.ifname(i)
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

    def popen(self, i: int, argvs: list[list[str]], *, env: dict[str, str], stdout, stderr,
              cwd: str | os.PathLike | None = None) -> subprocess.Popen:
        """Start ``argvs`` (one command each: a host's ranks) together in host ``i``'s namespaces."""
        quoted = " & ".join(" ".join(_sh_quote(a) for a in argv) for argv in argvs)
        # sh stays pid 1 of the host (a rank as pid 1 would be immune to its own host's signals).
        script = f"hostname {self.ns(i)}; {quoted} & wait"
        cores = self.cores[i]  # (taskset: util-linux, as unshare; every process of the host inherits the mask)
        pin = [] if cores is None else ["taskset", "-c", ",".join(map(str, cores))]
        proc = subprocess.Popen(
            [*pin, "ip", "netns", "exec", self.ns(i), "unshare", "--pid", "--ipc", "--uts", "--mount", "--fork",
             "--mount-proc", "sh", "-c", script], env=env, cwd=cwd, stdout=stdout, stderr=stderr,
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


# ----------------------------------------------------------------------------- running ranks in the hosts
@dataclass
class HostRank:
    """What a rank function gets by default: its rank, the world size, and the caller's store."""

    rank: int
    world_size: int
    host: str
    port: int

    def store(self, timeout: float = 60.0) -> dist.TCPStore:
        return dist.TCPStore(self.host, self.port, self.world_size, is_master=False,
                             timeout=timedelta(seconds=timeout))


def run_hosts(fn: Callable[..., Any], hosts: NetnsHosts, ranks_per_host: int = 1, *, timeout: float = 120.0,
              expect_exit: dict[int, bool] | None = None, director: Callable[[NetnsHosts, dist.Store], None] | None
              = None, env: dict[str, str] | None = None, context: str = "zbccl.tools.netns:HostRank",
              pythonpath: list[str] | None = None, cwd: str | os.PathLike | None = None, **kwargs) -> list[Any]:
    """Run ``fn(ctx, **kwargs)`` in ``hosts.n * ranks_per_host`` ranks (host ``i`` holds ranks
    ``i*ranks_per_host ...``); return the results by rank.

    ``ctx`` is ``context(rank, world_size, store_host, store_port)`` (``"module:Class"``, default
    :class:`HostRank`); its ``store()`` reaches the TCPStore this process hosts on the bridge. ``fn`` must
    be a module-level function (each rank imports it by name; ``pythonpath`` is put before zbccl's folder on
    the ranks' ``PYTHONPATH``); ``kwargs`` and the results are JSON. Each host's ranks get ``GLOO_SOCKET_IFNAME`` set
    to its veth (:meth:`NetnsHosts.ifname`) unless ``env`` sets it. ``expect_exit`` lists hosts (index ->
    True) that are expected not to finish (killed by the director): their ranks' results are None. Raises
    :class:`HostsFailure` with the failing rank's traceback and the hosts' logs, or naming the ranks that had
    not finished by ``timeout``.
    """
    world = hosts.n * ranks_per_host
    store = dist.TCPStore(hosts.store_addr, 0, world, is_master=True, timeout=timedelta(seconds=timeout),
                          wait_for_workers=False)
    work = Path(tempfile.mkdtemp(prefix="zbccl-hosts-"))
    spec = {"fn": f"{fn.__module__}:{fn.__qualname__}", "kwargs": kwargs, "world_size": world,
            "host": hosts.store_addr, "port": store.port, "out": str(work), "context": context}
    (work / "spec.json").write_text(json.dumps(spec))
    penv = dict(os.environ, **(env or {}))
    paths = [*(pythonpath or []), str(_PACKAGE_ROOT), penv.get("PYTHONPATH", "")]
    penv["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    expect = expect_exit or {}
    logs, procs = [], []
    try:
        for i in range(hosts.n):
            log = open(work / f"host-{i}.log", "wb")
            logs.append(log)
            argvs = [[sys.executable, "-m", "zbccl.tools.netns", str(work / "spec.json"),
                      str(i * ranks_per_host + k)] for k in range(ranks_per_host)]
            # gloo binds the host's veth (the hostname resolves to loopback inside the namespace)
            host_env = penv if "GLOO_SOCKET_IFNAME" in (env or {}) else {**penv, "GLOO_SOCKET_IFNAME": hosts.ifname(i)}
            procs.append(hosts.popen(i, argvs, env=host_env, stdout=log, stderr=subprocess.STDOUT, cwd=cwd or work))
        failure: list[BaseException] = []
        if director is not None:
            def direct() -> None:
                try:
                    director(hosts, store)
                except BaseException as exc:  # noqa: BLE001 - reported below
                    failure.append(exc)
            threading.Thread(target=direct, daemon=True).start()
        _wait(procs, work, time.monotonic() + timeout)
        return _collect(work, hosts.n, ranks_per_host, expect, failure, timeout)
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


def _wait(procs: list[subprocess.Popen], work: Path, deadline: float) -> None:
    """Until every host's shell exited, a rank reported an error (its peers would only wait for it until
    their own timeouts), or ``deadline``."""
    for proc in procs:
        while time.monotonic() < deadline:
            try:
                proc.wait(timeout=min(0.5, max(0.01, deadline - time.monotonic())))
                break
            except subprocess.TimeoutExpired:
                if any("error" in json.loads(p.read_text()) for p in work.glob("out-*.json")):
                    return


def _collect(work: Path, n_hosts: int, per_host: int, expect: dict[int, bool], failure: list[BaseException],
             timeout: float) -> list[Any]:
    """The ranks' results by rank (their ``out-<rank>.json``); raises naming the first failure."""
    results, missing = [], []
    for r in range(n_hosts * per_host):
        out, host = work / f"out-{r}.json", r // per_host
        if not out.exists():
            results.append(None)
            if not expect.get(host):
                missing.append(r)
            continue
        got = json.loads(out.read_text())
        if "error" in got:
            logs = "\n".join(f"--- host {i} log:\n{_tail(work / f'host-{i}.log')}" for i in range(n_hosts))
            raise HostsFailure(f"run_hosts: rank {r} (host {host}) failed:\n{got['error']}\n{logs}", ranks=(r,))
        results.append(got["ok"])
    if failure:
        raise HostsFailure(f"run_hosts: the director failed, expected it to return, got {failure[0]!r}")
    if missing:
        logs = "\n".join(f"--- host {h}:\n{_tail(work / f'host-{h}.log')}" for h in sorted({r // per_host
                                                                                              for r in missing}))
        raise HostsFailure(f"run_hosts: ranks {missing} did not finish within {timeout:.0f}s (or died), expected "
                           f"every rank to write its result\n{logs}", ranks=tuple(missing))
    return results


def _tail(path: Path, n: int = 3000) -> str:
    try:  # torch's store warnings repeat once a second while a rank waits: not worth the space
        lines = path.read_bytes().decode(errors="replace").splitlines()
        return "\n".join(ln for ln in lines if "waitForInput" not in ln)[-n:]
    except OSError:
        return "(no log)"


def _load(name: str) -> Any:
    module, qualname = name.split(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def rank_main(spec_path: str, rank: int) -> int:
    """One rank of a :func:`run_hosts` world: call the spec's function, write ``out-<rank>.json``
    (``{"ok": result}`` or ``{"error": traceback}``) into the spec's folder; the exit status."""
    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out"]) / f"out-{rank}.json"
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:  # (a background job of the host's sh): Ctrl-C as a
        signal.signal(signal.SIGINT, signal.default_int_handler)  # launcher's rank gets it, KeyboardInterrupt
    try:
        ctx = _load(spec.get("context", "zbccl.tools.netns:HostRank"))(rank, spec["world_size"], spec["host"],
                                                                        spec["port"])
        result, code = {"ok": _load(spec["fn"])(ctx, **spec["kwargs"])}, 0
    except BaseException:  # noqa: BLE001 - reported to the calling process
        result, code = {"error": traceback.format_exc()}, 1
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, out)
    return code


if __name__ == "__main__":
    sys.exit(rank_main(sys.argv[1], int(sys.argv[2])))
