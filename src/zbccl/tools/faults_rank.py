"""One rank of a fault-injection trial (:mod:`zbccl.tools.faults`): the workloads and the injector.

Every rank loops one workload (``WHERE``) until an op raises. The victim also runs an injector
thread: after a random delay it waits (polling with back-off) until the main thread's Python stack
is inside the workload's op function (``_op_<where>``), writes the moment (``time.monotonic()``,
one clock for the whole host) to the store, and sends the signal to its own process. A survivor
records the error it got, how long after the signal, and whether it names the victim; then it
finalizes, checks that it maps no heap segment and holds no more descriptors than before init, and
runs again: a fresh ``init`` of the same world (the victim, or its replacement after a SIGKILL),
one all_reduce checked against its reference, ``finalize``.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["WHERE", "trial_rank", "rerun_rank"]

MiB = 1 << 20
WHERE = ("collective", "p2p", "ep", "group", "growth", "init", "finalize")
_SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "int": signal.SIGINT}


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _segments() -> list[str]:
    """The zbccl heap segments this process maps (``memfd:zbccl-<job>-r<rank>``)."""
    with open("/proc/self/maps") as f:
        return sorted({ln[ln.index("/memfd:zbccl-") + 1:].split()[0] for ln in f if "/memfd:zbccl-" in ln})


def _inside(thread_id: int, name: str) -> bool:
    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        if frame.f_code.co_name == name:
            return True
        frame = frame.f_back
    return False


def _injector(store, kind: str, target: str, delay: float, started: threading.Event) -> None:
    """Signal this process once the main thread is inside ``target``, ``delay`` s after the loop began."""
    main = threading.main_thread().ident

    def run() -> None:
        started.wait()
        time.sleep(delay)
        pause = 0.0005
        deadline = time.monotonic() + 120
        while not _inside(main, target):
            if time.monotonic() > deadline:
                return
            time.sleep(pause)
            pause = min(pause * 2, 0.005)
        store.set("fault/signal", repr(time.monotonic()))
        os.kill(os.getpid(), _SIGNALS[kind])

    threading.Thread(target=run, daemon=True, name="zbccl-fault-injector").start()


def _payload(rank: int, n: int, salt: int) -> torch.Tensor:
    return ((torch.arange(n) * 7 + rank * 13 + salt) % 61 - 30).to(torch.float32) / 4


class _Workload:
    """The loop of one ``where``; every op passes ``timeout`` (short in SIGSTOP trials)."""

    def __init__(self, where: str, store, rank: int, world: int, timeout: float) -> None:
        self.where, self.store, self.rank, self.world, self.timeout = where, store, rank, world, timeout
        self.comm = self.buffer = self.p2p = None
        self.k = 0
        self.kept: list[torch.Tensor] = []
        self.held: dict = {}

    def start(self) -> None:
        import zbccl

        if self.where not in ("init", "finalize"):
            heap = 2 * MiB if self.where == "growth" else 32 * MiB
            self.comm = zbccl.init(store=dist.PrefixStore("w", self.store), rank=self.rank, world_size=self.world,
                                   heap_size=heap, heap_max="1G", timeout=self.timeout)
        if self.where == "ep":
            import zbccl.ep as deep_ep

            self.buffer = deep_ep.Buffer(self.comm, explicitly_destroy=True, timeout=self.timeout)
        if self.where == "p2p":
            from ..adapters.p2p import PointToPoint

            self.p2p = PointToPoint(self.comm)

    def step(self) -> None:
        self.k += 1
        getattr(self, "_op_" + self.where)()

    # ---------------------------------------------------------------- the ops
    def _op_collective(self) -> None:
        import zbccl

        t = self.kept[0] if self.kept else zbccl.zeros(16384)
        self.kept = [t]
        c, w, to = self.comm, self.world, self.timeout
        op = self.k % 6
        if op == 0:
            zbccl.all_reduce(t, comm=c, timeout=to)
        elif op == 1:
            zbccl.all_gather_into_tensor(torch.empty(w * 1024), t[:1024], comm=c, timeout=to)
        elif op == 2:
            zbccl.reduce_scatter_tensor(torch.empty(1024), t[:w * 1024], comm=c, timeout=to)
        elif op == 3:
            zbccl.all_to_all_single(torch.empty(w * 512), t[:w * 512], comm=c, timeout=to)
        elif op == 4:
            zbccl.broadcast(t, self.k % w, comm=c, timeout=to)
        else:
            zbccl.barrier(comm=c, timeout=to)

    def _op_p2p(self) -> None:
        """A ring: even ranks send then receive, odd ranks the other way round."""
        nxt, prev = (self.rank + 1) % self.world, (self.rank - 1) % self.world
        got = torch.empty(4096)
        for phase in (0, 1) if self.rank % 2 == 0 else (1, 0):
            if phase == 0:
                self.p2p.send([_payload(self.rank, 4096, self.k)], nxt, 0).wait(self.timeout)
            else:
                self.p2p.recv([got], prev, 0).wait(self.timeout)
        if not torch.equal(got, _payload(prev, 4096, self.k)):
            raise AssertionError(f"p2p: wrong payload from rank {prev} in round {self.k}")

    def _op_ep(self) -> None:
        g = torch.Generator().manual_seed(self.k * 31 + self.rank)
        E, T = 2 * self.world, 32
        idx = torch.topk(torch.rand(T, E, generator=g), 2, dim=-1).indices
        x = torch.randn(T, 256, generator=g).to(torch.bfloat16)
        w = torch.rand(T, 2, generator=g)
        ntpr, _, ntpe, in_rank, _ = self.buffer.get_dispatch_layout(idx, E)
        rx, _, _, _, handle, _ = self.buffer.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=in_rank,
                                                      num_tokens_per_expert=ntpe, topk_idx=idx, topk_weights=w)
        self.buffer.combine(rx, handle)

    def _op_group(self) -> None:
        g = self.comm.new_group(list(range(self.world)), timeout=self.timeout)
        g.barrier(timeout=self.timeout)
        g.destroy(timeout=self.timeout)

    def _op_growth(self) -> None:
        """Each round keeps one more MiB (the heap grows) and all-reduces it."""
        import zbccl

        t = zbccl.zeros(MiB // 4 * min(self.k, 48))
        self.kept.append(t)
        zbccl.all_reduce(t, comm=self.comm, timeout=self.timeout)

    def _op_init(self) -> None:
        """init, a barrier, finalize: the "init" and "finalize" trials signal inside the first or the last."""
        import zbccl

        self._init_inside()
        zbccl.barrier(timeout=self.timeout)
        self._finalize_inside()

    _op_finalize = _op_init

    def _init_inside(self) -> None:
        import zbccl

        zbccl.init(store=dist.PrefixStore(f"i{self.k}", self.store), rank=self.rank, world_size=self.world,
                   heap_size=4 * MiB, timeout=self.timeout)

    @staticmethod
    def _finalize_inside() -> None:
        import zbccl

        zbccl.finalize()

    def close(self) -> None:
        """Drop every heap tensor this workload holds (a Buffer's included), then finalize: live heap
        tensors would keep the segments mapped until the process exits, by design."""
        import gc

        import zbccl

        self.kept, self.buffer = [], None
        if self.p2p is not None:
            self.p2p.close()
            self.p2p = None
        gc.collect()
        if zbccl.is_initialized():  # what finalize will find still alive (it keeps those mapped)
            from ..heap.views import live_views

            comm = zbccl.get_default()
            self.held = {"active_blocks": zbccl.memory_stats()["active_blocks"], "views": live_views(comm.heap)}
        zbccl.finalize()


_TARGETS = {w: f"_op_{w}" for w in WHERE} | {"init": "_init_inside", "finalize": "_finalize_inside"}


def trial_rank(*, rank: int, world: int, port: int, where: str, victim: int, kind: str, delay: float,
               timeout: float) -> dict:
    """The faulted round. Returns what this rank saw (survivors: the error, its delay, leaks)."""
    import faulthandler

    import zbccl

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent asks for stacks before it kills a hang
    store = dist.TCPStore("127.0.0.1", port, world + 1, is_master=False, timeout=timedelta(seconds=120))
    fds_before = _fds()
    work = _Workload(where, store, rank, world, timeout)
    started = threading.Event()
    if rank == victim:
        _injector(store, kind, _TARGETS[where], delay, started)
    out: dict = {"rank": rank, "pid": os.getpid()}
    try:
        work.start()
        out["job"] = zbccl.get_default().job_id if zbccl.is_initialized() else None
        started.set()
        for _ in range(1_000_000):
            work.step()
        out["error"] = "the loop ended without an error"
    except zbccl.ZbcclError as exc:
        out["t_error"] = time.monotonic()
        out.update(error=f"{type(exc).__name__}: {exc}"[:400], ranks=list(exc.ranks or ()),
                   named=victim in (exc.ranks or ()) or f"rank {victim}" in str(exc))
    except KeyboardInterrupt:
        out["interrupted"] = True
    except Exception as exc:  # noqa: BLE001 - anything else is a failure of the trial, reported
        out["t_error"] = time.monotonic()
        out.update(error=f"{type(exc).__name__}: {exc}"[:400], ranks=[], named=False, foreign=True)
    work.kept = []
    try:
        work.close()
    except Exception as exc:  # noqa: BLE001
        out["finalize_error"] = f"{type(exc).__name__}: {exc}"[:300]
        zbccl.finalize()
    out["segments_after_finalize"] = _segments()
    out["held_at_finalize"] = work.held
    out["fd_growth"] = _fds() - fds_before
    store.set(f"fault/done/{rank}", b"1")
    out["rerun"] = rerun_rank(rank=rank, world=world, store=store, victim=victim)
    return out


def rerun_rank(*, rank: int, world: int, victim: int, store=None, port: int | None = None) -> dict:
    """After the fault: a fresh init of the same world, one checked all_reduce, finalize. It starts
    once every survivor is done with the faulted round (an event on the store, not a deadline)."""
    import zbccl

    if store is None:
        store = dist.TCPStore("127.0.0.1", port, world + 1, is_master=False, timeout=timedelta(seconds=120))
    try:
        store.wait([f"fault/done/{r}" for r in range(world) if r != victim], timedelta(seconds=120))
        comm = zbccl.init(store=dist.PrefixStore("rerun", store), rank=rank, world_size=world, heap_size=4 * MiB,
                          timeout=60)
        t = zbccl.empty(1000)
        t.copy_(_payload(rank, 1000, 0))
        zbccl.all_reduce(t, comm=comm)
        want = sum((_payload(r, 1000, 0) for r in range(world)), torch.zeros(1000))
        ok = torch.equal(t, want)
        job = comm.job_id
        del t
        zbccl.finalize()
        return {"ok": ok, "job": job, "segments": _segments()}
    except Exception as exc:  # noqa: BLE001
        zbccl.finalize()
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
