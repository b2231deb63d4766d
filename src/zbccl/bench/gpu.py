"""GPU check of zbccl's CUDA path: ``python -m zbccl.bench.gpu [--quick] [--worlds 2,4] [--only NAMES] [--json PATH]``.

What ``scripts/gpu_check.sh`` runs on a machine with a CUDA GPU (every rank on GPU 0). Each check runs
in its own guard and prints one line, ``CHECK <name> PASS|FAIL|SKIP <detail>``, then the next one runs;
every spawned world has a wall-clock timeout (its ranks are killed at it), so the whole run ends in
bounded time (under 6 minutes with the defaults). Checks, per world size (2 and 4):

* ``w<N>/<op>``: every op on heap tensors, every dtype it serves, odd sizes, bit-exact against a
  plain-torch reference (``gpu_cases.correctness``);
* ``w<N>/graph/<op>``: each op captured in a CUDA graph and replayed on new payloads, and
  ``w<N>/graph/decode_step``: matmul -> all_reduce -> matmul captured once, replayed many times,
  bit-exact against the same step run eagerly (``gpu_cases.graph_cases``, ``decode_step``);
* ``w<N>/bench``: all_reduce and all_gather, 4 KiB to 64 MiB, against the device memcpy and torch
  SymmetricMemory's one-shot/two-shot all_reduce and a staged cudaMemcpy all_reduce, interleaved in
  the same processes (``gpu_bench``); the table it prints is the one ``docs/benchmarks.md`` keeps.

Without CUDA it prints ``CHECK cuda SKIP no CUDA ...`` and exits with status 3.
Exit status: 0 when every check passed, 1 when one failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable

from .gpu_bench import bench_rank
from .gpu_steps import cases_rank

__all__ = ["main", "cuda_status", "format_table", "summarise_cases"]

#: Wall-clock limits of the spawned worlds (s): a hung rank is killed at these. The run's budget
#: (``--budget``) bounds them further: a world gets at most what is left of it. Ranks stop running
#: cases ``_WIND_DOWN_S`` before (agreed among them) and report what ran.
LIMITS = {"cases": 105.0, "bench": 55.0}
NO_CUDA = 3


def cuda_status() -> str | None:
    """None when a CUDA device is usable here, else why not (one line)."""
    import torch

    if not torch.cuda.is_available():
        return (f"no CUDA: torch.cuda.is_available() is False (torch {torch.__version__}, built with CUDA "
                f"{torch.version.cuda}); run this on a machine with an NVIDIA GPU")
    return None


def _check(name: str, fn: Callable[[], tuple[bool, str]], out: list) -> bool:
    """Run one guarded check and print its line; never raises."""
    t0 = time.monotonic()
    try:
        ok, detail = fn()
    except BaseException as exc:  # noqa: BLE001 - a check fails, the next one runs (Ctrl-C included: it ends the run)
        if isinstance(exc, KeyboardInterrupt):
            raise
        ok, detail = False, f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
        # the whole error (a rank's error carries its own traceback), before the CHECK line
        print(f"ERROR {name}: {type(exc).__name__}: {str(exc).strip()}\n{traceback.format_exc(limit=6)}", flush=True)
    line = f"CHECK {name} {'PASS' if ok else 'FAIL'} {detail} ({time.monotonic() - t0:.1f}s)"
    print(line, flush=True)
    out.append({"name": name, "ok": ok, "detail": detail})
    return ok


def first_errors(results: list[list[tuple[str, bool, str]]]) -> list[str]:
    """Every rank's first failed case that was not skipped, in full (type, message, traceback): the cause,
    which the per-group lines (the first failures, often a peer's consequences) may not show."""
    lines = []
    for rank, cases in enumerate(results):
        for name, ok, detail in cases:
            if not ok and not detail.startswith("skipped"):
                lines.append(f"FIRST-ERROR [rank {rank}] {name}: {detail}")
                break
        else:
            lines.append(f"FIRST-ERROR [rank {rank}] none ({len(cases)} cases)")
    return lines


def summarise_cases(results: list[list[tuple[str, bool, str]]]) -> dict[str, tuple[bool, str]]:
    """Per-rank case results -> per op group (``all_reduce``, ``graph/all_gather`` ...): ``(ok, detail)``:
    how many cases passed on every rank, and the first failures with the rank that saw them (failures
    before skips, every rank's included)."""
    groups: dict[str, dict] = {}
    for rank, cases in enumerate(results):
        for name, ok, detail in cases:
            parts = name.split("/")
            key = "/".join(parts[:2]) if parts[0] == "graph" else parts[0]
            g = groups.setdefault(key, {"cases": {}, "fail": []})
            g["cases"][name] = g["cases"].get(name, True) and ok
            if not ok:
                g["fail"].append((detail.startswith("skipped"), rank,
                                  f"[rank {rank}] {name}: {detail.splitlines()[0] if detail else ''}"))
    for g in groups.values():  # real failures first, then one line per rank, at most 4
        fails, seen = [], set()
        for skipped, rank, line in sorted(g["fail"], key=lambda f: f[0]):
            if (skipped, rank) not in seen and len(fails) < 4:
                seen.add((skipped, rank))
                fails.append(line)
        g["fail"] = fails
    out = {}
    for key, g in groups.items():
        n_ok = sum(g["cases"].values())
        n = len(g["cases"])
        out[key] = (n_ok == n, f"{n_ok}/{n} cases bit-exact" + ("; " + " | ".join(g["fail"]) if g["fail"] else ""))
    return out


_deadline = float("inf")


#: Seconds a world keeps after its ranks agreed to stop: teardown and sending the results back.
_WIND_DOWN_S = 12.0


def _launch(fn, world: int, limit: float, **kwargs):
    """``fn`` on ``world`` ranks, killed at ``limit`` (or what is left of the run's budget); the ranks get a
    ``deadline`` (wall clock) ``_WIND_DOWN_S`` before that, at which they agree to stop and report."""
    from ..tools.launch import launch_local

    left = min(limit, _deadline - time.monotonic())
    if left < _WIND_DOWN_S + 12:
        raise TimeoutError(f"skipped: the run's time budget is spent ({left:.0f}s left)")
    return launch_local(fn, world, timeout=left, threads=1, deadline=time.time() + left - _WIND_DOWN_S, **kwargs)


# ----------------------------------------------------------------------------------------- the table
def format_table(world: int, ranks: list[dict]) -> list[str]:
    """Markdown rows from every rank's bench result: the slowest rank's median per implementation. ``size``:
    each rank's input bytes; busbw as nccl-tests (all_gather's data size is its output: ``W * size``).
    The graph columns are per op of a captured graph (device time, no host launch cost); the ratios are
    torch SymmetricMemory one-shot's time over zbccl's (above 1: zbccl faster); ``host us``: the host's time
    to issue one call (the slowest rank's median); ``zb in-place``: all_gather whose input is this rank's part
    of its output; ``zb 8K-tile``: the op with the small ops' tiles at a large size (the A/B of the big tiles)."""
    from .report import algbw_bytes, busbw_factor

    head = ("| W | op | size | zbccl us | busbw GB/s | zb 1-shot us | zb 2-shot us | symm 1-shot us | "
            "symm 2-shot us | staged us | zb graph us | symm graph us | memcpy GB/s | busbw/memcpy | "
            "1-shot/zbccl | graphs 1-shot/zbccl | host us zbccl / zb 1-shot / symm 1-shot | zb in-place us | "
            "in-place busbw/memcpy | zb 8K-tile us | #wrong |")
    lines = [head, "|" + "---|" * 21]
    for i, row in enumerate(ranks[0]["rows"]):
        rows = [r["rows"][i] for r in ranks]
        us = {k: max(r["us"].get(k, float("nan")) for r in rows) for k in rows[0]["us"]}
        wrong = sum(sum(r["wrong"].values()) for r in rows)
        size = row["bytes"]
        memcpy_gbs = size / max(r["memcpy_us"] for r in rows) / 1e3
        zb = us.get("zbccl")
        busbw = algbw_bytes(row["op"], size, world) * busbw_factor(row["op"], world) / zb / 1e3 if zb else None
        cell = lambda k, us=us: f"{us[k]:.1f}" if k in us else "-"  # noqa: E731
        ratio = f"{us['symm_1shot'] / zb:.2f}" if zb and "symm_1shot" in us else "-"
        ip = us.get("zb_inplace")
        inplace = (f"{algbw_bytes(row['op'], size, world) * busbw_factor(row['op'], world) / ip / 1e3 / memcpy_gbs:.2f}"
                   if ip else "-")
        hosts = {k: max(r.get("host_us", {}).get(k, float("nan")) for r in rows) for k in rows[0].get("host_us", {})}
        host = " / ".join(f"{hosts[k]:.1f}" if k in hosts else "-" for k in ("zbccl", "zb_1shot", "symm_1shot"))
        g_ratio = f"{us['symm_graph'] / us['zb_graph']:.2f}" if "symm_graph" in us and "zb_graph" in us else "-"
        lines.append(f"| {world} | {row['op']} | {_size(size)} | {cell('zbccl')} | "
                     f"{'-' if busbw is None else f'{busbw:.1f}'} | {cell('zb_1shot')} | {cell('zb_2shot')} | "
                     f"{cell('symm_1shot')} | {cell('symm_2shot')} | {cell('staged')} | {cell('zb_graph')} | "
                     f"{cell('symm_graph')} | {memcpy_gbs:.1f} | "
                     f"{'-' if busbw is None else f'{busbw / memcpy_gbs:.2f}'} | {ratio} | {g_ratio} | {host} | "
                     f"{cell('zb_inplace')} | {inplace} | {cell('zb_8k')} | {wrong} |")
    return lines


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


# ----------------------------------------------------------------------------------------- main
def _env_line(device: str) -> str:
    import torch

    gpu = (torch.cuda.get_device_name(0) if device.startswith("cuda")
           else "Triton interpreter rehearsal" if device == "interpret" else "CPU dry run")
    parts = [f"torch {torch.__version__}", f"cuda {torch.version.cuda}", gpu]
    for mod in ("triton", "cuda.bindings"):
        try:
            m = __import__(mod, fromlist=["__version__"])
            parts.append(f"{mod} {getattr(m, '__version__', '?')}")
        except ImportError as exc:
            parts.append(f"{mod} missing ({exc})")
    return ", ".join(parts)


def _native() -> tuple[bool, str]:
    """Build (or find) the native core once here, before the ranks need it, and say how long it took."""
    from .. import native

    t0 = time.monotonic()
    native.prepare(world_size=2)
    return True, f"ready in {time.monotonic() - t0:.1f}s"


def main(argv: list[str] | None = None, *, prog: str = "python -m zbccl.bench.gpu") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer sizes and rounds (about half the time)")
    p.add_argument("--worlds", default="2,4", help="world sizes, comma-separated (default 2,4)")
    p.add_argument("--only", default="", help="comma-separated subset of: cases,bench (default both)")
    p.add_argument("--replays", type=int, default=100, help="replays of the captured decode step")
    p.add_argument("--heap", default="512M", help="CUDA heap per rank (default 512M)")
    p.add_argument("--json", default=None, help="write every check and bench row here")
    p.add_argument("--budget", type=float, default=330.0, help="seconds for the whole run (default 330)")
    p.add_argument("--cpu-dry-run", action="store_true",
                   help="run the cases on zbccl's CPU ops instead (checks this driver where no GPU is)")
    p.add_argument("--interpret", action="store_true",
                   help="rehearse the cases on the device path without a GPU: the public ops routed to DeviceOps, "
                        "whose Triton kernels run under TRITON_INTERPRET=1 over the shm heap (slow: use --quick)")
    p.add_argument("--mode", default="",
                   help="how the ranks share the GPU, for the table's header (scripts/gpu_final.sh passes on/off: "
                        "MPS or time-slicing); default: MPS when CUDA_MPS_PIPE_DIRECTORY is set")
    args = p.parse_args(argv)
    global _deadline
    _deadline = time.monotonic() + args.budget
    device = "interpret" if args.interpret else "cpu" if args.cpu_dry_run else "cuda:0"
    why = None if args.cpu_dry_run or args.interpret else cuda_status()
    if why is not None:
        print(f"CHECK cuda SKIP {why}", flush=True)
        return NO_CUDA
    from ..env import parse_size

    os.environ.setdefault("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "1")  # the ranks share GPU 0
    worlds = [int(w) for w in args.worlds.split(",") if w.strip()]
    only = {s.strip() for s in args.only.split(",") if s.strip()} or {"cases", "bench"}
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # read by triton in the spawned ranks (this process runs no kernel)
        LIMITS["cases"] = args.budget
    if args.cpu_dry_run or args.interpret:
        only.discard("bench")  # CUDA events and torch SymmetricMemory: GPU only
    heap = parse_size(args.heap)
    checks: list = []
    tables: list[str] = []
    _check("env", lambda: (True, _env_line(device)), checks)
    if not _check("native", _native, checks):
        print("zbccl: the native core is needed at world size > 1; every zbccl check below will fail", flush=True)
    for w in worlds:
        if "cases" in only:
            def run_cases(w=w):
                res = _launch(cases_rank, w, LIMITS["cases"], quick=args.quick, replays=args.replays,
                              heap_bytes=heap, device=device)
                for line in first_errors(res):
                    print(line, flush=True)
                for key, (ok, detail) in summarise_cases(res).items():
                    _check(f"w{w}/{key}", lambda ok=ok, detail=detail: (ok, detail), checks)
                return True, f"{sum(len(r) for r in res) // w} cases per rank"

            _check(f"w{w}/cases", run_cases, checks)
        if "bench" in only:
            def run_bench(w=w):
                res = _launch(bench_rank, w, LIMITS["bench"], quick=args.quick, heap_bytes=heap)
                tables.extend(format_table(w, res) if res[0]["rows"] else [])
                errors = sorted({e for r in res for e in r["errors"]})
                wrong = sum(sum(row["wrong"].values()) for r in res for row in r["rows"])
                ok = not errors and wrong == 0 and bool(res[0]["rows"])
                return ok, f"{len(res[0]['rows'])} rows, #wrong {wrong}" + (f"; {'; '.join(errors[:4])}" if errors else "")

            _check(f"w{w}/bench", run_bench, checks)
    if tables:
        stamp = time.strftime("%Y-%m-%d", time.gmtime())
        mode = args.mode or ("on" if os.environ.get("CUDA_MPS_PIPE_DIRECTORY") else "off")
        sharing = "MPS: the ranks' kernels run concurrently" if mode == "on" else "time-sliced, no MPS"
        print(f"\nGPU bench, {_env_line(device)}, {stamp}, every rank on GPU 0 ({sharing}), bf16, "
              "slowest rank's median:\n" + "\n".join(_dedup_heads(tables)), flush=True)
    failed = [c["name"] for c in checks if not c["ok"]]
    print(f"\nSUMMARY {len(checks) - len(failed)}/{len(checks)} checks passed"
          + (f"; failed: {', '.join(failed)}" if failed else ""), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"checks": checks, "table": tables}, f, indent=1)
    return 0 if not failed else 1


def _dedup_heads(lines: list[str]) -> list[str]:
    out, seen = [], set()
    for ln in lines:
        if ln.startswith("| W |") or ln.startswith("|---"):
            if ln in seen:
                continue
            seen.add(ln)
        out.append(ln)
    return out


if __name__ == "__main__":
    sys.exit(main())
