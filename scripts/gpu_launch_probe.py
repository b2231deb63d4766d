"""Where an eager CUDA collective's host time goes, and the in-place all_gather at world 4 (issue 23).

Usage (on a GPU, MPS on, from the repo root): ``PYTHONPATH=src python3 scripts/gpu_launch_probe.py [--only launch,inplace]``

* ``launch`` (world 2): the host microseconds per call of the public ``zbccl.all_reduce``, of
  ``DeviceOps.all_reduce`` (one-shot; repeated, and with every check: ``_checked``), of the launcher alone
  (``native/triton/launch.py``), of the compiled binary's launcher called directly, of its C launch
  function called directly (``launch._entry``: the floor of the Python side), and of triton's JIT path; the
  device time per eager op (CUDA events) beside torch SymmetricMemory's one-shot in the same processes;
  whether a triton launch hook is set; ``launch.fire`` (a repeated call's launch); the replay of a
  one-kernel CUDA graph holding the same call (``graph1``: what a repeated eager call would cost if it
  replayed instead of launching); and rank 0's cProfile of the DeviceOps call and of the public one.
* ``inplace`` (world 4, ``CUDA_LAUNCH_BLOCKING=1``): all_gather at 16-64 MiB out of place, in place with the
  big tiles and in place with 8 KiB tiles, each checked; the first failure ends the world (a CUDA fault is
  sticky) and says which.

Prints one JSON line per rank result (``PROBE {...}``). Bounded: each world has a timeout.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time

SIZES_KIB = (4, 16, 64)


def _host_us(rk, fn, n: int = 300) -> float:
    import torch.distributed as dist

    rk.finish()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) / n * 1e6
    rk.finish()
    return host


def _dev_us(rk, fn, n: int = 200) -> float:
    import torch
    import torch.distributed as dist

    vals = []
    for _ in range(3):
        rk.finish()
        dist.barrier()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n):
            fn()
        b.record()
        rk.finish()
        vals.append(a.elapsed_time(b) * 1e3 / n)
    return statistics.median(vals)


def _launch_row(rk, ops, kib: int, profile: bool) -> tuple[dict, str | None]:
    """One size's row (see the module docstring); ``profile``: also rank 0's cProfiles."""
    import torch
    import torch.distributed as dist

    import zbccl
    from zbccl.native.triton import kernels as k
    from zbccl.native.triton import launch as L

    n = kib * 512
    t = rk.empty((n,), torch.bfloat16)
    t.zero_()
    for _ in range(5):
        ops.all_reduce(t, "sum", algo="one_shot")
        zbccl.all_reduce(t)
    rk.finish()
    calls = []
    real = L._all_reduce
    L._all_reduce = lambda grid, nw, *args: (calls.append((grid, nw, args)), real(grid, nw, *args))[1]
    try:
        ops._launched.clear()  # the long way (a repeat would not reach the launcher)
        ops.all_reduce(t, "sum", algo="one_shot")
    finally:
        L._all_reduce = real
    rk.finish()
    grid, nw, args = calls[0]
    row = {"kib": kib, "grid": grid, "num_warps": nw, "compiled": [type(v).__name__ for v in real.compiled.values()]}
    ck = next(v for v in real.compiled.values() if v is not None)
    _, stream = L._device_stream()
    full = list(args)
    for i in real._ptrs:
        full[i] = args[i].data_ptr()

    def direct():
        ck.run(grid, 1, 1, stream, ck.function, ck.packed_metadata, None, None, None, *full)

    row["host_public"] = _host_us(rk, lambda: zbccl.all_reduce(t))
    row["host_deviceops"] = _host_us(rk, lambda: ops.all_reduce(t, "sum", algo="one_shot"))  # a repeat
    row["host_deviceops_checked"] = _host_us(
        rk, lambda: (ops._launched.clear(), ops.all_reduce(t, "sum", algo="one_shot")))
    row["host_kernel_call"] = _host_us(rk, lambda: real(grid, nw, *args))
    row["host_direct_run"] = _host_us(rk, direct)
    fn, head = L._entry(ck)  # triton 3.6: the C launch function itself (what fire calls)
    row["entry_is_c_launch"] = fn is not ck.run
    row["host_entry"] = _host_us(rk, lambda: fn(grid, 1, 1, stream, *head, *full))
    launched = real(grid, nw, *args)
    rk.finish()
    row["host_fire"] = _host_us(rk, lambda: L.fire(launched)) if launched is not None else None
    row["host_jit"] = _host_us(rk, lambda: k.all_reduce_kernel[(grid,)](*args, num_warps=nw), n=100)
    row["host_stream"] = _host_us(rk, L._device_stream, n=2000)
    row["dev_public"] = _dev_us(rk, lambda: zbccl.all_reduce(t))
    row["dev_direct_run"] = _dev_us(rk, direct)
    try:  # an experiment: a repeated eager call replaying a one-kernel CUDA graph instead of launching (host cost)
        g = torch.cuda.CUDAGraph()
        rk.finish()
        with torch.cuda.graph(g):
            ops.all_reduce(t, "sum", algo="one_shot")
        rk.finish()
        row["host_graph1"] = _host_us(rk, g.replay)
        row["dev_graph1"] = _dev_us(rk, g.replay)
    except Exception as exc:  # noqa: BLE001 - reported
        row["graph1_error"] = f"{type(exc).__name__}: {exc}"
    try:
        import torch.distributed._symmetric_memory as symm_mem

        group = dist.group.WORLD.group_name
        s = symm_mem.empty(n, dtype=torch.bfloat16, device="cuda")
        symm_mem.rendezvous(s, group)
        s.zero_()

        def one():
            return torch.ops.symm_mem.one_shot_all_reduce(s, "sum", group)

        one()
        row["host_symm"] = _host_us(rk, one)
        row["dev_symm"] = _dev_us(rk, one)
    except Exception as exc:  # noqa: BLE001 - reported
        row["symm_error"] = f"{type(exc).__name__}: {exc}"
    texts = []
    for what, fn in (("DeviceOps.all_reduce", lambda: ops.all_reduce(t, "sum", algo="one_shot")),
                     ("zbccl.all_reduce", lambda: zbccl.all_reduce(t))):
        prof = cProfile.Profile() if profile else None
        rk.finish()
        dist.barrier()
        if prof is not None:
            prof.enable()
        for _ in range(300):
            fn()
        if prof is not None:
            prof.disable()
        rk.finish()
        if prof is not None:
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
            texts.append(f"--- cProfile of {what}, 300 calls\n" + out.getvalue()[-5000:])
    return row, "\n".join(texts) or None


def launch_rank(*, rank: int, world_size: int, store, deadline: float = float("inf")) -> dict:
    from zbccl.bench.gpu_cases import Rank
    from zbccl.native.triton import launch as L

    rk = Rank(rank, world_size, store, heap_bytes=256 << 20, timeout=20.0, deadline=deadline)
    res: dict = {"rank": rank, "rows": []}
    try:
        ops = rk.comm.device_ops("cuda")
        res["hooked"] = L._hooked()
        for kib in SIZES_KIB:
            row, prof = _launch_row(rk, ops, kib, rank == 0 and kib == SIZES_KIB[0])
            res["rows"].append(row)
            if prof:
                res["profile"] = prof
        return res
    except Exception:  # noqa: BLE001 - reported
        import traceback

        res["error"] = traceback.format_exc(limit=8)
        return res
    finally:
        rk.close()


def _inplace_size(rk, mib: int, lines: list[str]) -> None:
    import torch

    from zbccl.bench.gpu_bench import _small_tiles
    from zbccl.bench.gpu_cases import payload

    W, r, zb = rk.world, rk.rank, rk.zbccl
    n = (mib << 20) // 2
    inp, o = rk.empty((n,), torch.bfloat16), rk.empty((W * n,), torch.bfloat16)
    tr, me = rk.comm.device_heap("cuda").transport, rk.comm.global_rank
    lines.append(f"{mib} MiB: o off {tr.offset_of(me, o)} inp off {tr.offset_of(me, inp)} heap {tr.size(me)}")
    want = torch.cat([payload(q, (n,), torch.bfloat16) for q in range(W)]).cuda()
    mine = o[r * n:(r + 1) * n]

    def oop():
        inp.copy_(payload(r, (n,), torch.bfloat16))
        zb.all_gather_into_tensor(o, inp)

    def inplace():
        o.zero_()
        mine.copy_(payload(r, (n,), torch.bfloat16))
        zb.all_gather_into_tensor(o, mine)

    for name, fn in (("out-of-place", oop), ("in-place 8K tiles", _small_tiles(inplace)),
                     ("in-place big tiles", inplace)):
        t0 = time.monotonic()
        fn()
        rk.finish()
        lines.append(f"{mib} MiB {name}: wrong {int((o != want).sum())} ({time.monotonic() - t0:.2f}s)")


def inplace_rank(*, rank: int, world_size: int, store, deadline: float = float("inf")) -> dict:
    from zbccl.bench.gpu_cases import Rank

    rk = Rank(rank, world_size, store, heap_bytes=512 << 20, timeout=20.0, deadline=deadline)
    res: dict = {"rank": rank, "cases": []}
    try:
        res["max_blocks"] = rk.comm.device_ops("cuda").max_blocks
        for mib in (16, 32, 64):
            _inplace_size(rk, mib, res["cases"])
        return res
    except Exception as exc:  # noqa: BLE001 - reported
        res["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
        return res
    finally:
        try:
            rk.close()
        except Exception:  # noqa: BLE001, S110 - the context may be dead after a fault
            pass


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="launch,inplace")
    args = p.parse_args()
    from zbccl.tools.launch import launch_local

    os.environ.setdefault("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "1")
    only = set(args.only.split(","))
    if "launch" in only:
        t0 = time.monotonic()
        try:
            for r in launch_local(launch_rank, 2, timeout=120, threads=1, deadline=time.time() + 110):
                prof = r.pop("profile", None)
                print("PROBE " + json.dumps(r), flush=True)
                if prof:
                    print(prof, flush=True)
        except Exception as exc:  # noqa: BLE001
            print(f"PROBE launch world failed: {type(exc).__name__}: {exc}", flush=True)
        print(f"PROBE launch took {time.monotonic() - t0:.1f}s", flush=True)
    if "inplace" in only:
        t0 = time.monotonic()
        os.environ["CUDA_LAUNCH_BLOCKING"] = "1"
        try:
            for r in launch_local(inplace_rank, 4, timeout=120, threads=1, deadline=time.time() + 110):
                print("PROBE " + json.dumps(r), flush=True)
        except Exception as exc:  # noqa: BLE001
            print(f"PROBE inplace world failed: {type(exc).__name__}: {str(exc)[-3000:]}", flush=True)
        print(f"PROBE inplace took {time.monotonic() - t0:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
