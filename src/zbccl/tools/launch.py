"""Start N local ranks of a function, the way the demo and the benchmark need.

The launcher hosts a ``TCPStore`` on an OS-assigned port and starts each rank
with the ``spawn`` method (a fresh interpreter: no inherited OpenMP or torch
thread state). A rank that raises makes the launcher kill the others and
re-raise its traceback; a rank that hangs is killed at the timeout.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ..errors import ZbcclRemoteError, ZbcclTimeoutError

__all__ = ["launch_local", "rank_threads"]


def rank_threads(local_world_size: int) -> int:
    """Default intra-op threads per rank: usable cores divided by local ranks (at least 1)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, local_world_size))


def _entry(fn: Callable, rank: int, world_size: int, port: int, kwargs: dict, conn) -> None:
    try:
        import torch

        torch.set_num_threads(kwargs.pop("_threads"))
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timedelta(seconds=120))
        conn.send(("ok", fn(rank=rank, world_size=world_size, store=store, **kwargs)))
    except BaseException:  # noqa: BLE001
        conn.send(("err", traceback.format_exc()))
    finally:
        conn.close()


def launch_local(fn: Callable[..., Any], world_size: int, *, timeout: float = 600.0,
                 threads: int | None = None, **kwargs) -> list[Any]:
    """Run ``fn(rank=, world_size=, store=, **kwargs)`` in ``world_size`` processes; results by rank."""
    ctx = mp.get_context("spawn")
    server = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=timeout))
    nthreads = threads or rank_threads(world_size)
    procs, conns = [], []
    for r in range(world_size):
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_entry, args=(fn, r, world_size, server.port, {**kwargs, "_threads": nthreads}, send),
                        name=f"zbccl-rank{r}")
        p.start()
        send.close()
        procs.append(p)
        conns.append(recv)
    results: list[Any] = [None] * world_size
    deadline = time.monotonic() + timeout
    try:
        pending = set(range(world_size))
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ZbcclTimeoutError(f"launch: ranks {sorted(pending)} did not finish in {timeout:.0f}s",
                                        ranks=tuple(sorted(pending)))
            for c in mp.connection.wait([conns[r] for r in pending], timeout=min(left, 1.0)):
                r = conns.index(c)
                try:
                    status, value = c.recv()
                except EOFError:
                    status, value = "err", f"rank {r} exited with {procs[r].exitcode} without a result"
                pending.discard(r)
                if status == "err":
                    raise ZbcclRemoteError(f"launch: rank {r} failed:\n{value}", ranks=(r,))
                results[r] = value
        return results
    finally:
        for p in procs:
            p.join(5 if not p.is_alive() else 0.5)
            if p.is_alive():
                p.kill()
                p.join(5)
        del server
