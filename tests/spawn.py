"""The one helper every multi-process test uses to run a world of ranks.

``run_world(fn, world_size)`` starts ``world_size`` processes (forkserver:
cheap forks of a clean, torch-preloaded server, never of the pytest process),
hosts a ``TCPStore`` on an OS-assigned port in the parent, calls
``fn(rank_ctx, **kwargs)`` in each rank and returns their results by rank.

It checks every exit code, re-raises the first failing rank's traceback,
kills every other rank on failure, and enforces a wall-clock timeout naming
the ranks that had not finished.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["RankContext", "RankFailure", "run_world"]

_CTX = None


def _mp():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "zbccl", "tests.spawn"])
    return _CTX


class RankFailure(AssertionError):
    """A rank raised, exited badly, or the world timed out."""


@dataclass
class RankContext:
    """What a rank function gets: its rank, the world size, and the parent's store."""

    rank: int
    world_size: int
    host: str
    port: int
    env: dict = field(default_factory=dict)

    def store(self) -> dist.TCPStore:
        return dist.TCPStore(self.host, self.port, self.world_size, is_master=False,
                             timeout=timedelta(seconds=60))

    def agent_store_env(self) -> dict[str, str]:
        """torchrun's environment with the parent's store as the agent store.

        For tests of ``MASTER_ADDR``/``MASTER_PORT`` or ``tcp://`` rendezvous:
        every rank connects to the parent's store (as under torchrun's elastic
        agent), so no port is probed, released and raced for.
        """
        return {"MASTER_ADDR": self.host, "MASTER_PORT": str(self.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}

    def init(self, **kwargs):
        """``zbccl.init`` through the parent's store (kwargs passed on)."""
        import zbccl

        kwargs.setdefault("timeout", 30)
        return zbccl.init(store=self.store(), rank=self.rank, world_size=self.world_size, **kwargs)


def _child(fn: Callable, ctx: RankContext, kwargs: dict, conn) -> None:
    try:
        os.environ.update(ctx.env)
        result = fn(ctx, **kwargs)
        conn.send(("ok", result))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        conn.send(("err", traceback.format_exc()))
        conn.close()
        os._exit(1)
    conn.close()


def run_world(fn: Callable[..., Any], world_size: int, *, timeout: float = 90.0,
              expect_exit: dict[int, int] | None = None, env: dict[str, str] | None = None,
              **kwargs) -> list[Any]:
    """Run ``fn(RankContext, **kwargs)`` on ``world_size`` ranks; return results by rank.

    ``expect_exit`` maps ranks to the exit code they must end with (``-9`` for
    a rank that SIGKILLs itself); their results are ``None``. ``env`` entries
    are set in each rank before ``fn`` runs.
    """
    expect_exit = expect_exit or {}
    ctx = _mp()
    server = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=timeout))
    procs, conns = [], []
    for r in range(world_size):
        parent_conn, child_conn = ctx.Pipe(duplex=False)
        rc = RankContext(r, world_size, "127.0.0.1", server.port, dict(env or {}))
        p = ctx.Process(target=_child, args=(fn, rc, kwargs, child_conn), name=f"zbccl-test-rank{r}")
        p.start()
        child_conn.close()
        procs.append(p)
        conns.append(parent_conn)
    try:
        return _collect(procs, conns, timeout=timeout, expect_exit=expect_exit)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
        del server


def _collect(procs, conns, *, timeout: float, expect_exit: dict[int, int]) -> list[Any]:
    deadline = time.monotonic() + timeout
    results: list[Any] = [None] * len(procs)
    done = [False] * len(procs)
    while not all(done):
        for r, (p, c) in enumerate(zip(procs, conns)):
            if done[r]:
                continue
            msg = _try_recv(c, 0)
            if msg is None and p.exitcode is None:
                continue
            if msg is None:
                msg = _try_recv(c, 0.2)
            p.join(10)
            done[r] = True
            if msg is not None and msg[0] == "err":
                _kill_all(procs)
                raise RankFailure(f"rank {r} raised:\n{msg[1]}")
            if p.exitcode != expect_exit.get(r, 0):
                _kill_all(procs)
                raise RankFailure(
                    f"rank {r} exited with {p.exitcode}, expected {expect_exit.get(r, 0)}"
                    + ("" if msg else " (it returned no result)"))
            results[r] = msg[1] if msg else None
        if time.monotonic() > deadline:
            late = [r for r in range(len(procs)) if not done[r]]
            _kill_all(procs)
            raise RankFailure(f"world timed out after {timeout:.0f}s; ranks {late} never finished")
        if not all(done):
            mp.connection.wait([c for c, d in zip(conns, done) if not d]
                               + [p.sentinel for p, d in zip(procs, done) if not d], timeout=0.2)
    return results


def _try_recv(conn, wait: float):
    """The rank's message if one is there, else None (also at EOF: the rank died)."""
    try:
        return conn.recv() if conn.poll(wait) else None
    except (EOFError, OSError):
        return None


def _kill_all(procs) -> None:
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
    for p in procs:
        p.join(5)
