"""Host identity and the rank-to-host map.

Two ranks are on the same "host" when they can share memory *and* reach each
other's abstract Unix sockets: the same running kernel (``boot_id``) and the
same network namespace. The hostname alone is not enough: containers often
share or fake it, and two containers on one machine may not share /dev/shm.

The host id is a hash of hostname, boot id and the network and IPC namespaces
(the namespaces are what the shm transport's descriptor handout needs: an
abstract socket reaches only its own network namespace), or ``ZBCCL_HOST_ID``
where set: tests make several hosts of one machine with it. Ranks with one
host id share memory (the shm transport); ranks on different hosts reach each
other through the inter-host transport (Mooncake), chosen by
``heap.transports.select`` from this map.
"""

from __future__ import annotations

import hashlib
import os
import platform
import socket
from dataclasses import dataclass, field

from .. import env

__all__ = ["HostInfo", "Topology", "local_host_info", "cpu_model", "usable_cores", "affinity", "format_cpus",
           "masks_oversubscribed"]


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _ns_inode(kind: str) -> str:
    try:
        return str(os.stat(f"/proc/self/ns/{kind}").st_ino)
    except OSError:
        return ""


def cpu_model() -> str:
    """The CPU's marketing name (``/proc/cpuinfo``), or the platform's processor string."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def affinity() -> tuple[int, ...]:
    """The CPUs this process may run on (its affinity mask), sorted."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - non-Linux
        return tuple(range(os.cpu_count() or 1))


def usable_cores() -> int:
    """Cores this process may run on (affinity mask, not the machine total)."""
    return len(affinity())


def format_cpus(cpus) -> str:
    """``0-3,8`` for CPUs {0, 1, 2, 3, 8}."""
    out, run = [], []
    for c in sorted(cpus):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def masks_oversubscribed(masks: list[frozenset[int]]) -> bool:
    """True when the ranks of one host with these affinity masks cannot each have a core.

    That is: more ranks than CPUs in the union of their masks, or some mask that
    more ranks are confined to (their mask lies inside it) than it has CPUs, such
    as two ranks pinned to the same core. Ranks pinned to their own cores (how
    vLLM and SGLang run on CPU) are not oversubscribed, however few cores each has.
    """
    known = [m for m in masks if m]
    if not known:
        return False
    if len(masks) > len(frozenset().union(*known)):
        return True
    return any(sum(1 for o in known if o <= m) > len(m) for m in set(known))


@dataclass(frozen=True)
class HostInfo:
    """What a rank says about where it runs, exchanged at rendezvous."""

    host_id: str
    hostname: str
    pid: int
    cores: int
    #: The rank's affinity mask (CPU ids), exchanged so that thread and spin decisions see every rank's.
    cpus: tuple[int, ...] = ()

    def to_dict(self) -> dict:
        return {"host_id": self.host_id, "hostname": self.hostname, "pid": self.pid, "cores": self.cores,
                "cpus": list(self.cpus)}

    @classmethod
    def from_dict(cls, d: dict) -> HostInfo:
        return cls(d["host_id"], d["hostname"], int(d["pid"]), int(d["cores"]), tuple(int(c) for c in d["cpus"]))


def local_host_info() -> HostInfo:
    """This process's :class:`HostInfo`; ``host_id`` hashes hostname, boot id, net and IPC namespaces
    (``ZBCCL_HOST_ID`` overrides it)."""
    hostname = socket.gethostname()
    host_id = env.HOST_ID.get()
    if not host_id:
        parts = [hostname, _read("/proc/sys/kernel/random/boot_id"), _ns_inode("net"), _ns_inode("ipc")]
        host_id = hashlib.sha1("|".join(parts).encode()).hexdigest()[:16]
    cpus = affinity()
    return HostInfo(host_id=host_id, hostname=hostname, pid=os.getpid(), cores=len(cpus), cpus=cpus)


@dataclass(frozen=True)
class Topology:
    """Ranks grouped by host, in the numbering of one communicator.

    ``hosts[i]`` lists the ranks of host ``i`` in increasing order; hosts are
    ordered by their lowest rank so every rank derives the same numbering.
    """

    rank: int
    infos: tuple[HostInfo, ...]
    hosts: tuple[tuple[int, ...], ...] = field(init=False)

    def __post_init__(self) -> None:
        groups: dict[str, list[int]] = {}
        for r, info in enumerate(self.infos):
            groups.setdefault(info.host_id, []).append(r)
        object.__setattr__(self, "hosts", tuple(tuple(g) for g in sorted(groups.values())))

    @property
    def world_size(self) -> int:
        return len(self.infos)

    @property
    def host_index(self) -> int:
        return self.host_of(self.rank)

    def host_of(self, rank: int) -> int:
        for i, ranks in enumerate(self.hosts):
            if rank in ranks:
                return i
        raise KeyError(rank)

    @property
    def local_ranks(self) -> tuple[int, ...]:
        """Ranks sharing this rank's host (including itself)."""
        return self.hosts[self.host_index]

    @property
    def local_rank(self) -> int:
        return self.local_ranks.index(self.rank)

    @property
    def local_world_size(self) -> int:
        return len(self.local_ranks)

    def is_local(self, rank: int) -> bool:
        return self.infos[rank].host_id == self.infos[self.rank].host_id

    @property
    def local_masks(self) -> list[frozenset[int]]:
        """Affinity masks of the ranks of this host, in local-rank order."""
        return [frozenset(self.infos[r].cpus) for r in self.local_ranks]

    @property
    def oversubscribed(self) -> bool:
        """This host's ranks cannot each have a core (see :func:`masks_oversubscribed`): waits yield at once.

        Decided from every local rank's affinity mask, not this rank's alone.
        """
        return masks_oversubscribed(self.local_masks)

    def describe(self) -> list[dict]:
        return [
            {"host": i, "hostname": self.infos[rs[0]].hostname, "host_id": self.infos[rs[0]].host_id,
             "ranks": list(rs), "cores": self.infos[rs[0]].cores,
             "cpus": {r: format_cpus(self.infos[r].cpus) for r in rs}}
            for i, rs in enumerate(self.hosts)
        ]
