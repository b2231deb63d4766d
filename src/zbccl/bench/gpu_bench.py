"""The per-rank timing of the GPU check (``bench/gpu.py``): zbccl against the baselines, interleaved.

In the same processes, at every size, round by round (the order rotates each round): zbccl's
all_reduce (auto, one-shot, two-shot) and all_gather on heap tensors; torch SymmetricMemory's
``one_shot_all_reduce`` and ``two_shot_all_reduce_`` on its own symmetric tensors (rendezvous through the
gloo group: NCCL refuses several ranks on one GPU); a staged all_reduce on plain ``cudaMemcpy``
(``copy_`` into this rank's symmetric slot, device barrier, copy every peer's slot into a local
``[W, n]`` buffer, ``sum``, barrier: what a library without zero-copy reads does); and the device
memcpy of the same bytes (every rank at once). Timing: CUDA events around ``iters`` back-to-back
calls after a gloo barrier; the median over rounds, per rank; the report takes the slowest rank.
Each implementation's result is checked once per size (``#wrong``: elements that differ from the
reference, summed over ranks). bfloat16 throughout; all_reduce runs on zeros after its check, so
repeated in-place sums stay exact.
"""

from __future__ import annotations

import statistics
import time
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist

from .gpu_cases import DEV, Rank, payload

__all__ = ["SIZES", "bench", "bench_rank"]

SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
#: The staged baseline runs up to this size (it is a small-message latency baseline).
STAGED_MAX = 1 << 20
DT = torch.bfloat16


class _Symm:
    """torch SymmetricMemory on the gloo group (one symmetric tensor per size), or why it is unavailable."""

    def __init__(self) -> None:
        self.error: str | None = None
        try:
            import torch.distributed._symmetric_memory as symm_mem

            self.mod = symm_mem
            self.group = dist.group.WORLD.group_name
            enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
            if enable is not None:  # torch < 2.9 needs it; later ones ignore it
                enable(self.group)
        except Exception as exc:  # noqa: BLE001 - reported in the table
            self.error = f"{type(exc).__name__}: {exc}"

    def tensor(self, numel: int):
        t = self.mod.empty(numel, dtype=DT, device=DEV)
        hdl = self.mod.rendezvous(t, self.group)
        return t, hdl


def _time(rk: Rank, fn: Callable[[], object], iters: int) -> float:
    """Microseconds per call: CUDA events around ``iters`` calls, after a gloo barrier (every wait bounded)."""
    return _timed(rk, fn, iters)[0]


def _timed(rk: Rank, fn: Callable[[], object], iters: int) -> tuple[float, float]:
    """``(device, host)`` microseconds per call: CUDA events around ``iters`` calls, and the host's own time
    to issue them (the launch path; it is the op's time wherever it exceeds the kernel's)."""
    rk.finish()
    dist.barrier()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    host = time.perf_counter() - t0
    b.record()
    rk.finish()
    return a.elapsed_time(b) * 1e3 / iters, host * 1e6 / iters


def _iters(rk: Rank, fn, quick: bool) -> int:
    """Calls per timed batch (about 20 ms of work), decided by rank 0 from one timed call, same everywhere."""
    t = torch.tensor([_time(rk, fn, 1)], dtype=torch.float64)
    dist.broadcast(t, 0)
    budget = 10e3 if quick else 20e3
    return int(max(3, min(200, budget // max(t.item(), 1.0))))


def _impls(rk: Rank, symm: _Symm, op: str, nbytes: int) -> dict[str, tuple[Callable, Callable[[], int]]]:
    """``{name: (call, wrong)}``: ``wrong()`` runs one checked call and counts wrong elements (this rank)."""
    W, r, zb = rk.world, rk.rank, rk.zbccl
    n = nbytes // 2
    out: dict = {}
    if op == "all_reduce":
        want = sum(payload(q, (n,), torch.float32) for q in range(W)).to(DT).to(DEV)
        t = rk.empty((n,), DT)
        ops = rk.comm.device_ops("cuda")

        def zb_check(algo=None):
            def check():
                t.copy_(payload(r, (n,), DT))
                ops.all_reduce(t, "sum", algo=algo) if algo else zb.all_reduce(t)
                rk.finish()
                wrong = int((t != want).sum())
                t.zero_()
                return wrong
            return check

        out["zbccl"] = (lambda: zb.all_reduce(t), zb_check())
        if nbytes <= STAGED_MAX:  # device time alone: GRAPH_OPS all_reduces captured once, replayed
            out["zb_graph"] = _graphed(rk, lambda: zb.all_reduce(t), zb_check())
        out["zb_1shot"] = (lambda: ops.all_reduce(t, "sum", algo="one_shot"), zb_check("one_shot"))
        out["zb_2shot"] = (lambda: ops.all_reduce(t, "sum", algo="two_shot"), zb_check("two_shot"))
        if symm.error is None:
            s, hdl = symm.tensor(n)

            def s1():
                s.copy_(payload(r, (n,), DT))
                got = torch.ops.symm_mem.one_shot_all_reduce(s, "sum", symm.group)
                rk.finish()
                s.zero_()
                return int((got != want).sum())

            def s2():
                s.copy_(payload(r, (n,), DT))
                torch.ops.symm_mem.two_shot_all_reduce_(s, "sum", symm.group)
                rk.finish()
                wrong = int((s != want).sum())
                s.zero_()
                return wrong

            out["symm_1shot"] = (lambda: torch.ops.symm_mem.one_shot_all_reduce(s, "sum", symm.group), s1)
            out["symm_2shot"] = (lambda: torch.ops.symm_mem.two_shot_all_reduce_(s, "sum", symm.group), s2)
            if nbytes <= STAGED_MAX:
                out["symm_graph"] = _graphed(
                    rk, lambda: torch.ops.symm_mem.one_shot_all_reduce(s, "sum", symm.group), s1)
                out["staged"] = _staged(rk, hdl, n, want)
    else:  # all_gather
        inp, o = rk.empty((n,), DT), rk.empty((W * n,), DT)
        want = torch.cat([payload(q, (n,), DT) for q in range(W)]).to(DEV)

        def ag_check():
            inp.copy_(payload(r, (n,), DT))
            zb.all_gather_into_tensor(o, inp)
            rk.finish()
            return int((o != want).sum())

        out["zbccl"] = (lambda: zb.all_gather_into_tensor(o, inp), ag_check)
        if nbytes >= SMALL_TILES_FROM:
            out["zb_8k"] = (_small_tiles(lambda: zb.all_gather_into_tensor(o, inp)), _small_tiles(ag_check))
        mine = o[r * n:(r + 1) * n]  # in place: the input is this rank's part of the output (nothing to copy)

        def inplace_check():
            o.zero_()
            mine.copy_(payload(r, (n,), DT))
            zb.all_gather_into_tensor(o, mine)
            rk.finish()
            return int((o != want).sum())

        out["zb_inplace"] = (lambda: zb.all_gather_into_tensor(o, mine), inplace_check)
    return out


#: From this size the bench also times zbccl's all_gather with the small ops' 8 KiB tiles (``zb_8k``), in the
#: same processes: the A/B of ``device_args.BIG_TILE_BYTES``.
SMALL_TILES_FROM = 16 << 20


def _small_tiles(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` run with the small ops' tiles at every size (every rank runs the same, so the shapes agree)."""
    from ..ops import device_args

    def call():
        big = device_args.BIG_TILE_BYTES
        device_args.BIG_TILE_BYTES = device_args.TILE_BYTES
        try:
            return fn()
        finally:
            device_args.BIG_TILE_BYTES = big
    return call


#: Ops per captured graph of the ``*_graph`` implementations (their time is per op).
GRAPH_OPS = 8


class _Graphed:
    """``GRAPH_OPS`` calls captured in one CUDA graph at the first check (after an eager warm-up inside the
    check), replayed by each call: the device time of the op without the host's launch cost."""

    per = GRAPH_OPS

    def __init__(self, rk: Rank, call: Callable[[], object]) -> None:
        self.rk, self.call, self.graph = rk, call, None

    def capture(self) -> None:
        self.call()  # every rank's device ops and tables exist before the capture
        self.rk.finish()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(GRAPH_OPS):
                self.call()
        self.graph = g

    def __call__(self) -> None:
        self.graph.replay()


def _graphed(rk: Rank, call: Callable[[], object], check: Callable[[], int]):
    """``(replay, check)`` for a graph of ``call``: the check captures it (once), then checks ``check``'s
    eager result (the captured graph replays the same op on the same tensors)."""
    g = _Graphed(rk, call)

    def checked() -> int:
        if g.graph is None:
            g.capture()
        return check()

    return g, checked


def _staged(rk: Rank, hdl, n: int, want: torch.Tensor):
    """The staged all_reduce on plain cudaMemcpy over SymmetricMemory slots (see the module docstring)."""
    W, r = rk.world, rk.rank
    x = torch.zeros(n, dtype=DT, device=DEV)
    stage = torch.empty(W, n, dtype=DT, device=DEV)
    slots = [hdl.get_buffer(q, (n,), DT) for q in range(W)]
    out = torch.empty(n, dtype=DT, device=DEV)

    def call():
        slots[r].copy_(x)
        hdl.barrier(channel=0)
        for q in range(W):
            stage[q].copy_(slots[q])
        torch.sum(stage, dim=0, out=out)
        hdl.barrier(channel=1)

    def check():
        x.copy_(payload(r, (n,), DT))
        call()
        rk.finish()
        x.zero_()
        return int((out != want).sum())

    return call, check


def _memcpy(rk: Rank, nbytes: int, quick: bool) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    fn = lambda: dst.copy_(src)  # noqa: E731
    iters = _iters(rk, fn, quick)
    return statistics.median(_time(rk, fn, iters) for _ in range(3))


def bench(rk: Rank, *, quick: bool, sizes: list[int] | None = None) -> dict:
    """``{"rows": [...], "errors": [...]}`` of this rank: per (op, size) the median us of each impl."""
    symm = _Symm()
    rows, errors = [], [] if symm.error is None else [f"torch SymmetricMemory unavailable: {symm.error}"]
    rounds = 3 if quick else 5
    for nbytes in sizes or SIZES:
        if rk.agree(rk.broken):
            errors.append(f"{nbytes}: {rk.broken}")
            continue
        memcpy_us = _memcpy(rk, nbytes, quick)
        for op in ("all_reduce", "all_gather"):
            impls, error = {}, None
            try:
                impls = _impls(rk, symm, op, nbytes)
            except Exception as exc:  # noqa: BLE001 - the cell is recorded as an error, the sweep goes on
                error = f"{op} {nbytes}: setup: {type(exc).__name__}: {exc}"
            if _any_failed(error, errors):
                continue
            row = {"op": op, "bytes": nbytes, "memcpy_us": memcpy_us, "us": {}, "wrong": {}}
            live = {}
            for name, (call, check) in impls.items():  # the same names on every rank
                error = None
                try:
                    row["wrong"][name] = check()
                except Exception as exc:  # noqa: BLE001
                    error = f"{op} {nbytes} {name}: {type(exc).__name__}: {exc}"
                    if type(exc).__name__ != "ZbcclInvalidUsageError":
                        # a peer may still wait in a kernel or barrier for this rank (a kernel that failed to
                        # compile here, a CUDA error): the sweep stops at the next size on every rank
                        rk.broken = error
                        print(f"ERROR [rank {rk.rank}] bench {error}\n{traceback.format_exc(limit=8)}", flush=True)
                if not _any_failed(error, errors):
                    live[name] = (call, _iters(rk, call, quick))
            samples: dict[str, list[float]] = {k: [] for k in live}
            host: dict[str, list[float]] = {k: [] for k in live}
            names = list(live)
            for i in range(rounds):
                for name in names[i % len(names):] + names[:i % len(names)] if names else []:
                    call, iters = live[name]
                    dev_us, host_us = _timed(rk, call, iters)
                    samples[name].append(dev_us / getattr(call, "per", 1))
                    host[name].append(host_us / getattr(call, "per", 1))
            row["us"] = {k: statistics.median(v) for k, v in samples.items() if v}
            row["host_us"] = {k: statistics.median(v) for k, v in host.items() if v}
            rows.append(row)
            del impls, live  # this cell's heap tensors return to the heap before the next one
    return {"rows": rows, "errors": errors}


def _any_failed(error: str | None, errors: list[str]) -> bool:
    """Whether any rank failed this step (every rank learns it: the ranks stay in step)."""
    if error:
        errors.append(error)
    flag = torch.tensor([1 if error else 0], dtype=torch.int32)
    dist.all_reduce(flag)
    return bool(flag.item())


def bench_rank(*, rank: int, world_size: int, store, quick: bool, heap_bytes: int,
               deadline: float = float("inf")) -> dict:
    """One rank of a bench world (``tools.launch.launch_local``)."""
    rk = Rank(rank, world_size, store, heap_bytes=heap_bytes, timeout=10.0, deadline=deadline)
    try:
        return bench(rk, quick=quick)
    finally:
        rk.close()
