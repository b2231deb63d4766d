"""Usage: PYTHONPATH=src python scripts/cpu_op_cost.py

The host cost of zbccl's CPU collectives at world 2 in this checkout (PYTHONPATH picks the tree; run it
on two trees in turn, several rounds, to compare them): each op's whole call (wall time, median of
batches), and the Python part of each op with the native call stubbed (``py:`` keys; thread CPU time:
nothing waits, and a busy machine's preemptions do not count; the method of ``zbccl/bench/micro.py``).
Prints one JSON object, the slowest rank's figure per key, in ns. Used to check that routing CUDA
tensors (issue 23) costs the CPU path nothing (docs/cuda-ops.md).
"""

from __future__ import annotations

import json
import statistics
import time

import torch

STUBBED = ("all_reduce_heap", "all_reduce_private(staged)", "all_gather", "reduce_scatter", "broadcast")


def timed(fn, iters: int, reps: int = 5, clock=time.perf_counter) -> float:
    out = []
    for _ in range(reps):
        t0 = clock()
        for _ in range(iters):
            fn()
        out.append((clock() - t0) / iters * 1e9)
    return statistics.median(out)


def rank(*, rank: int, world_size: int, store) -> dict:
    import zbccl

    comm = zbccl.init(store=store, rank=rank, world_size=world_size, heap_size="64M")
    W, n = world_size, 1024
    x, out, inp, rs = zbccl.zeros(n), zbccl.zeros(W * n), zbccl.zeros(W * n), zbccl.zeros(n)
    private = torch.zeros(n)
    cases = {
        "all_reduce_heap": lambda: zbccl.all_reduce(x),
        "all_reduce_private(staged)": lambda: zbccl.all_reduce(private),
        "all_reduce_max": lambda: zbccl.all_reduce(x, "max"),
        "all_gather": lambda: zbccl.all_gather_into_tensor(out, x),
        "reduce_scatter": lambda: zbccl.reduce_scatter_tensor(rs, inp),
        "all_to_all": lambda: zbccl.all_to_all_single(out, inp),
        "broadcast": lambda: zbccl.broadcast(x, 0),
    }
    res = {}
    for name, fn in cases.items():
        for _ in range(50):
            fn()
        comm.barrier()
        res[name] = timed(fn, 300)
    ch = comm.op_state
    comm.barrier()
    seq, real, hot, hot_gather = ch.seq, ch._chan_run, ch.hot, ch.hot_gather
    ch._chan_run, ch.hot, ch.hot_gather = (lambda handle, args: 0), None, None  # the Python path alone
    try:
        for name in STUBBED:
            res["py:" + name] = timed(cases[name], 3000, clock=time.thread_time)
    finally:
        ch._chan_run, ch.seq, ch.hot, ch.hot_gather = real, seq, hot, hot_gather
    comm.barrier()
    zbccl.finalize()
    return res


if __name__ == "__main__":
    from zbccl.tools.launch import launch_local

    ranks = launch_local(rank, 2, timeout=300)
    print(json.dumps({k: round(max(r[k] for r in ranks), 1) for k in ranks[0]}))
