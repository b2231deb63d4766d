"""The leak check: which processes of this test session still map a zbccl heap segment.

Heap segments are memfds (``/memfd:zbccl-<job>-r<rank>`` in ``/proc/<pid>/maps``),
never files in ``/dev/shm``: a segment lives exactly as long as some process maps
it, so a leak is a process that outlives its job while still mapping one.

Other test sessions may run on the same host at the same time, so only this
session's processes are looked at: the pytest process and every process that
inherited :data:`TAG_VAR` from it (forkserver ranks, spawned launchers, CLI
subprocesses, and orphans whose parent already exited).
"""

from __future__ import annotations

import os
import time

__all__ = ["TAG_VAR", "MARK", "describe", "mappings", "new_mappings", "processes_mapping", "segments_of"]

#: Environment variable that marks this session's processes (set by conftest.py).
TAG_VAR = "ZBT_LEAK_TAG"
#: What a zbccl heap segment looks like in /proc/<pid>/maps.
MARK = "/memfd:zbccl-"


def _carries(pid: int, tag: str) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"{TAG_VAR}={tag}".encode() in f.read().split(b"\0")
    except OSError:  # gone, or another user's
        return False


def segments_of(pid: int) -> frozenset[str]:
    """The zbccl segments process ``pid`` maps (empty once it unmapped them or exited)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return frozenset(ln[ln.index(MARK) + 1:].split(" ")[0] for ln in f if MARK in ln)
    except OSError:
        return frozenset()


def mappings(tag: str | None) -> dict[int, frozenset[str]]:
    """pid -> zbccl segments it maps, for this process and those carrying ``tag`` (all when None)."""
    out = {}
    me = os.getpid()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        if tag is not None and pid != me and not _carries(pid, tag):
            continue
        segs = segments_of(pid)
        if segs:
            out[pid] = segs
    return out


def new_mappings(before: dict[int, frozenset[str]], tag: str | None, *,
                 grace: float = 10.0) -> dict[int, frozenset[str]]:
    """Segments mapped now and not in ``before``, polled until none are left or ``grace`` s pass.

    The grace period covers ranks that are still exiting when a test returns;
    the poll stops as soon as they are gone.
    """
    deadline = time.monotonic() + grace
    pause = 0.01
    while True:
        now = mappings(tag)
        new = {pid: segs - before.get(pid, frozenset()) for pid, segs in now.items()}
        new = {pid: segs for pid, segs in new.items() if segs}
        if not new or time.monotonic() >= deadline:
            return new
        time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        pause = min(pause * 2, 0.2)


def processes_mapping(job_id: str) -> list[int]:
    """PIDs of any process that still maps a segment of job ``job_id``."""
    return sorted(pid for pid, segs in mappings(None).items()
                  if any(s.startswith(f"memfd:zbccl-{job_id}-") for s in segs))


def describe(found: dict[int, frozenset[str]]) -> str:
    """One line per process: pid, command line and the segments it maps."""
    lines = []
    for pid, segs in sorted(found.items()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            cmd = "?"
        lines.append(f"pid {pid} ({cmd[:120]}): {sorted(segs)}")
    return "\n".join(lines)
