"""The implementations a cell is timed on, and the memory-copy limit.

An implementation (:class:`Impl`) allocates the cell's tensors, binds an op
to them as a zero-argument call, and offers its own barrier for the timing
loop. :class:`GlooImpl` is torch.distributed's gloo backend on private
tensors; the zbccl implementation lives in ``runner.py`` (it needs zbccl).

The memcpy limit (:func:`copy_call`, :func:`memcpy_solo`) is ``dst.copy_(src)`` of the cell's
per-rank byte count, timed two ways:

- ``all``: every rank copies at once, with the ranks' intra-op threads, and a
  repetition counts the slowest rank. This is the **fair limit** and the
  table's ``memcpy_GB/s``: during a collective every rank moves data at the
  same time through the same memory system, and busbw (nccl-tests) is the
  per-rank rate of that data movement, so ``busbw / memcpy`` near 1 means the
  op runs at the speed of a plain copy on a busy machine.
- ``solo``: rank 0 alone, one thread, while the others block on the store:
  the single-core copy rate, kept in the JSON for reference. It is higher
  than ``all`` once the copy leaves the caches (the 2 cores share DRAM).

``busbw / memcpy`` can exceed 1 where not every rank moves data (broadcast:
the root only waits, so its peers get the whole memory system) or where an
op avoids a copy's write-allocate read (reducing into a destination already
in the cache).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import IO, Protocol

import torch

from .timing import LocalControl, Timed, TimingConfig, time_calls

__all__ = ["OPS", "Impl", "silence_deprecations", "GlooImpl", "op_numel", "op_buffers", "copy_call", "memcpy_solo",
           "VLLM_OPS", "find_vllm_python", "run_vllm_baseline"]

OPS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
#: Opt-in variants: all_gather whose input is this rank's slice of the output (the zero-copy way
#: inference engines call it: no copy of the rank's own block).
EXTRA_OPS: tuple[str, ...] = ("all_gather_inplace",)



def silence_deprecations() -> None:
    """Hide torch 2.13's FutureWarnings for ``all_gather_into_tensor`` / ``reduce_scatter_tensor``.

    They are deprecated in favour of ``*_single`` but gloo still implements
    them; called in each rank process, never at import.
    """
    for name in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        warnings.filterwarnings("ignore", message=rf".*{name}.*", category=FutureWarning)


class Impl(Protocol):
    """What the runner needs from one implementation of the collectives."""

    name: str

    def supports(self, op: str) -> bool: ...

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor: ...

    def bind(self, op: str, out: torch.Tensor, inp: torch.Tensor) -> Callable[[], object]: ...

    def sync(self) -> None: ...

    def staged_bytes(self) -> int: ...


def op_numel(op: str, nbytes: int, itemsize: int, world_size: int) -> int:
    """Per-rank input elements for a cell of ``nbytes`` per rank (0: the cell is skipped).

    reduce_scatter and all_to_all cut the input into ``world_size`` equal
    chunks, so their count is rounded down to a multiple of ``world_size``.
    """
    numel = nbytes // itemsize
    if op in ("reduce_scatter", "all_to_all"):
        numel -= numel % world_size
    return numel


def op_buffers(impl: Impl, op: str, numel: int, dtype: torch.dtype,
               world_size: int, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, inp)`` for ``op``: inp ``[numel]``; out ``[world_size * numel]`` for all_gather,
    ``[numel / world_size]`` for reduce_scatter, ``[numel]`` for all_to_all, and ``inp`` itself
    for the in-place ops (all_reduce, broadcast)."""
    if op == "all_gather_inplace":
        out = impl.empty(numel * world_size, dtype)
        return out, out[rank * numel:(rank + 1) * numel]
    inp = impl.empty(numel, dtype)
    if op in ("all_reduce", "broadcast"):
        return inp, inp
    out_numel = {"all_gather": numel * world_size, "reduce_scatter": numel // world_size}.get(op, numel)
    return impl.empty(out_numel, dtype), inp


class GlooImpl:
    """torch.distributed on ``group`` (gloo), private tensors, ``dist.barrier`` as sync."""

    name = "gloo"

    def __init__(self, group=None) -> None:
        self.group = group

    def supports(self, op: str) -> bool:
        return op in OPS or op in EXTRA_OPS

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    def bind(self, op: str, out: torch.Tensor, inp: torch.Tensor) -> Callable[[], object]:
        import torch.distributed as dist

        g = self.group
        calls: dict[str, Callable[[], object]] = {
            "all_reduce": lambda: dist.all_reduce(inp, group=g),
            "all_gather": lambda: dist.all_gather_into_tensor(out, inp, group=g),
            "all_gather_inplace": lambda: dist.all_gather_into_tensor(out, inp, group=g),
            "reduce_scatter": lambda: dist.reduce_scatter_tensor(out, inp, group=g),
            "all_to_all": lambda: dist.all_to_all_single(out, inp, group=g),
            "broadcast": lambda: dist.broadcast(inp, src=0, group=g),
        }
        return calls[op]

    def sync(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self.group)

    def staged_bytes(self) -> int:
        return 0


def copy_call(nbytes: int) -> Callable[[], object]:
    """``dst.copy_(src)`` of ``nbytes`` private bytes, bound: time it on every rank for the ``all`` limit."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    return lambda: dst.copy_(src)


def memcpy_solo(nbytes: int, *, cfg: TimingConfig) -> Timed:
    """One process, one thread: ``dst.copy_(src)`` of ``nbytes`` (the ``solo`` reference)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return time_calls(copy_call(nbytes), ctl=LocalControl(), sync=lambda: None, cfg=cfg)
    finally:
        torch.set_num_threads(threads)


# ----------------------------------------------------------------------------- vLLM (its own venv)
VLLM_OPS: tuple[str, ...] = ("all_reduce", "all_gather")
VLLM_SETUP = "scripts/setup_vllm_baseline.sh"


def find_vllm_python() -> Path | None:
    """``.venv-vllm/bin/python`` in the repository root (or the working directory), if built."""
    repo_root = Path(__file__).resolve().parents[3]
    for base in (repo_root, Path.cwd()):
        py = base / ".venv-vllm" / "bin" / "python"
        if py.exists():
            return py
    return None


def _run_worker(cmd: list[str], *, cwd: str, timeout: float) -> tuple[int | str, str]:
    """Run the worker in its own session; on timeout kill that whole process group.

    vLLM's shm ops spin without a timeout, so a stuck rank must not outlive us.
    """
    # the vLLM venv is self-contained: our PYTHONPATH (another numpy, zbccl) must not leak in
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd, env=env,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
        return proc.returncode, output
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return f"did not finish in {timeout:.0f}s", output
    finally:
        if proc.poll() is None:  # interrupted: leave no spinning rank behind
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_vllm_baseline(doc: dict, *, world_size: int, threads: int, quick: bool, idle_wait: float,
                      out: IO[str], timeout: float | None = None) -> dict:
    """Run ``vllm_worker.py`` under the vLLM venv's python and merge its cells into ``doc["cells"]``.

    Sequential (after the zbccl/gloo world has exited), so the two never share
    the cores. Returns ``{"skipped": why}``, ``{"error": ...}`` or the worker's
    metadata (vLLM and torch versions, gates); never raises for a vLLM failure.
    """
    py = find_vllm_python()
    if py is None:
        msg = f"vLLM baseline skipped: .venv-vllm not found; build it first with: {VLLM_SETUP}"
        print(msg, file=out)
        return {"skipped": msg}
    opts = doc["options"]
    ops = [op for op in opts["ops"] if op in VLLM_OPS]
    if not ops:
        return {"skipped": f"vLLM has CPU shm ops only for {list(VLLM_OPS)}"}
    with tempfile.TemporaryDirectory(prefix="zbccl-bench-vllm-") as tmp:
        result_path = Path(tmp) / "vllm.json"
        cmd = [str(py), str(Path(__file__).with_name("vllm_worker.py")), "--world-size", str(world_size),
               "--sizes", ",".join(map(str, opts["sizes"])), "--dtypes", ",".join(opts["dtypes"]),
               "--ops", ",".join(ops), "--threads", str(threads), "--idle-wait", str(idle_wait)]
        n_blocks = len(ops) * len(opts["dtypes"])
        budget = timeout or 300 + 40 * n_blocks * len(opts["sizes"]) + n_blocks * idle_wait + 120
        cmd += ["--out", str(result_path), "--timeout", str(budget - 30)] + (["--quick"] if quick else [])
        print(f"running the vLLM baseline ({py}) ...", file=out, flush=True)
        code, output = _run_worker(cmd, cwd=tmp, timeout=budget)
        if code != 0 or not result_path.exists():
            tail = output[-3000:]
            print(f"vLLM baseline failed ({code}):\n{tail}", file=out)
            return {"error": f"vllm_worker: {code}", "output_tail": tail}
        got = json.loads(result_path.read_text())
    by_key = {(c["op"], c["dtype"], c["size"]): c for c in got.pop("cells")}
    for cell in doc["cells"]:
        v = by_key.get((cell["op"], cell["dtype"], cell["size"]))
        if v is not None:
            cell["vllm"] = {"wrong": v["wrong"], "timing": v["timing"]}
    return got
