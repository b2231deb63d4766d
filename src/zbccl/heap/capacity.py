"""Check, before anything is created, that the host can hold the heap segments.

The segments are memfds: shmem pages charged like ``/dev/shm`` files to the
machine's (or the container's cgroup's) memory. ``/dev/shm``'s free space is
the budget an operator declares for shared memory (``docker --shm-size``,
a Kubernetes ``emptyDir`` with ``medium: Memory``), so zbccl honours it too,
together with ``MemAvailable`` and the cgroup's remaining memory.
"""

from __future__ import annotations

import os

from ..env import format_size
from ..errors import ZbcclOutOfMemoryError

__all__ = ["shm_capacity", "check_capacity"]


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _cgroup_headroom() -> int | None:
    try:
        with open("/proc/self/cgroup") as f:
            rel = next((ln.split(":", 2)[2].strip() for ln in f if ln.startswith("0::")), None)
        if rel is None:
            return None
        base = os.path.join("/sys/fs/cgroup", rel.lstrip("/"))
        with open(os.path.join(base, "memory.max")) as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open(os.path.join(base, "memory.current")) as f:
            current = int(f.read().strip())
        return max(0, int(limit) - current)
    except (OSError, ValueError, StopIteration):
        return None


def shm_capacity(path: str = "/dev/shm") -> dict[str, int | None]:
    """Free bytes per limit: ``dev_shm`` (statvfs), ``mem_available``, ``cgroup``."""
    try:
        st = os.statvfs(path)
        dev_shm = st.f_bavail * st.f_frsize
    except OSError:
        dev_shm = None
    return {"dev_shm": dev_shm, "mem_available": _meminfo_available(), "cgroup": _cgroup_headroom()}


def check_capacity(needed: int, *, nranks: int, path: str = "/dev/shm") -> None:
    """Raise :class:`ZbcclOutOfMemoryError` if ``needed`` bytes cannot be placed."""
    cap = shm_capacity(path)
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
        f"init: not enough shared memory for the heap, expected at least {format_size(needed)} "
        f"({needed} bytes for {nranks} local rank segment(s)), got {format_size(avail)} {where[name]}. "
        f"Fix: lower heap_size / ZBCCL_HEAP_SIZE, or {fix}; ZBCCL_SKIP_SHM_CHECK=1 skips this check.")
