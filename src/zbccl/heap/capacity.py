"""Check, before anything is created, that the host can hold the heap segments.

The segments are memfds: shmem pages charged like ``/dev/shm`` files to the
machine's (or the container's cgroup's) memory. ``/dev/shm``'s free space is
the budget an operator declares for shared memory (``docker --shm-size``,
a Kubernetes ``emptyDir`` with ``medium: Memory``), so zbccl honours it too,
together with ``MemAvailable`` and the memory cgroup's remaining room
(cgroup v1 or v2, the tightest limit of the cgroup and its ancestors).
"""

from __future__ import annotations

import os
import resource

from ..env import format_size
from ..errors import ZbcclOutOfMemoryError

__all__ = ["shm_capacity", "check_capacity", "cgroup_headroom", "auto_heap_max"]

# ``ZBCCL_HEAP_MAX=auto`` never reserves more address space than this per rank.
_AUTO_MAX_CAP = 1 << 40
_AUTO_GRANULE = 2 << 20


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# cgroup v1 reports "no limit" as a huge page-rounded number (0x7FFFFFFFFFFFF000 on x86-64).
_V1_UNLIMITED = 1 << 60
CGROUP_ROOT = "/sys/fs/cgroup"
SELF_CGROUP = "/proc/self/cgroup"


def _read_int(path: str) -> int | None:
    """An integer file's value; None if it is missing, unreadable or says ``max``."""
    try:
        with open(path) as f:
            text = f.read().strip()
        return None if text == "max" else int(text)
    except (OSError, ValueError):
        return None


def _headroom(mount: str, rel: str, limit_file: str, usage_file: str) -> int | None:
    """Least ``limit - usage`` over the cgroup at ``mount/rel`` and its ancestors up to ``mount``.

    A parent's limit binds its children too. Inside a container without a cgroup
    namespace, ``rel`` names a host path that is not mounted; its ancestors that
    exist (at least the mount itself, the container's own cgroup) still count.
    """
    parts = [p for p in rel.strip("/").split("/") if p]
    best = None
    for depth in range(len(parts), -1, -1):
        d = os.path.join(mount, *parts[:depth])
        limit = _read_int(os.path.join(d, limit_file))
        if limit is None or limit >= _V1_UNLIMITED:
            continue
        usage = _read_int(os.path.join(d, usage_file)) or 0
        room = max(0, limit - usage)
        best = room if best is None else min(best, room)
    return best


def cgroup_headroom(root: str = CGROUP_ROOT, self_cgroup: str = SELF_CGROUP) -> int | None:
    """Bytes this process's memory cgroup may still charge, or None without a limit.

    cgroup v1 (a ``N:...memory...:/path`` line; ``memory.limit_in_bytes`` and
    ``memory.usage_in_bytes`` under ``root/memory``) and v2 (the ``0::/path`` line;
    ``memory.max`` and ``memory.current`` under ``root``). ``root`` and
    ``self_cgroup`` are parameters so tests can point them at a fake tree.
    """
    try:
        with open(self_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    v1 = v2 = None
    for ln in lines:
        fields = ln.split(":", 2)
        if len(fields) != 3:
            continue
        if "memory" in fields[1].split(","):
            v1 = fields[2]
        elif fields[0] == "0" and fields[1] == "":
            v2 = fields[2]
    if v1 is not None:  # a v1 memory controller wins (hybrid hosts mount v2 without memory)
        return _headroom(os.path.join(root, "memory"), v1, "memory.limit_in_bytes", "memory.usage_in_bytes")
    if v2 is not None:
        return _headroom(root, v2, "memory.max", "memory.current")
    return None


def shm_capacity(path: str = "/dev/shm", *, cgroup_root: str = CGROUP_ROOT,
                 self_cgroup: str = SELF_CGROUP) -> dict[str, int | None]:
    """Free bytes per limit: ``dev_shm`` (statvfs), ``mem_available``, ``cgroup`` (v1 or v2)."""
    try:
        st = os.statvfs(path)
        dev_shm = st.f_bavail * st.f_frsize
    except OSError:
        dev_shm = None
    return {"dev_shm": dev_shm, "mem_available": _meminfo_available(),
            "cgroup": cgroup_headroom(cgroup_root, self_cgroup)}


def auto_heap_max(heap_bytes: int, *, nranks: int, path: str = "/dev/shm", cgroup_root: str = CGROUP_ROOT,
                  self_cgroup: str = SELF_CGROUP) -> int:
    """``ZBCCL_HEAP_MAX=auto``: this rank's share of the tightest limit :func:`shm_capacity` reports now.

    ``nranks`` local ranks share it equally; never below ``heap_bytes`` (no
    growth then), never above 1 TiB nor above this rank's share of half the
    address space ``RLIMIT_AS`` still allows (every process maps every local
    rank's reservation), rounded down to 2 MiB. It bounds only the
    address range each rank reserves for a heap: every growth step checks the
    capacity again before it reserves memory.
    """
    limits = [v for v in shm_capacity(path, cgroup_root=cgroup_root, self_cgroup=self_cgroup).values()
              if v is not None]
    share = min(limits) // max(nranks, 1) if limits else heap_bytes
    va_room = _address_space_room()
    if va_room is not None:  # every process maps every local rank's reservation: keep half the room free
        share = min(share, va_room // (2 * max(nranks, 1)))
    share = min(share, _AUTO_MAX_CAP) // _AUTO_GRANULE * _AUTO_GRANULE
    return max(heap_bytes, share)


def _address_space_room() -> int | None:
    """Bytes of address space this process may still map under ``RLIMIT_AS`` (``ulimit -v``), or None."""
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        with open("/proc/self/statm") as f:
            used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        used = 0
    return max(0, soft - used)


def check_capacity(needed: int, *, nranks: int, path: str = "/dev/shm", cgroup_root: str = CGROUP_ROOT,
                   self_cgroup: str = SELF_CGROUP, op: str = "init") -> None:
    """Raise :class:`ZbcclOutOfMemoryError` if ``needed`` bytes cannot be placed (``op`` opens the message)."""
    cap = shm_capacity(path, cgroup_root=cgroup_root, self_cgroup=self_cgroup)
    limits = {k: v for k, v in cap.items() if v is not None}
    if not limits:
        return
    name, avail = min(limits.items(), key=lambda kv: kv[1])
    if needed <= avail:
        return
    where = {"dev_shm": f"free in {path}", "mem_available": "MemAvailable", "cgroup": "left in the cgroup"}
    fix = ("give the container more shared memory (docker run --shm-size=<size>, or a Kubernetes emptyDir "
           "with medium: Memory at /dev/shm)" if name == "dev_shm" else "free memory on the host")
    raise ZbcclOutOfMemoryError(
        f"{op}: not enough shared memory for the heap, expected at least {format_size(needed)} "
        f"({needed} bytes for {nranks} local rank segment(s)), got {format_size(avail)} {where[name]}. "
        f"Fix: lower heap_size / ZBCCL_HEAP_SIZE (or ZBCCL_HEAP_MAX for growth), or {fix}; "
        "ZBCCL_SKIP_SHM_CHECK=1 skips this check.")
