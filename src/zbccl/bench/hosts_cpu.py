"""``zbccl bench --hosts 2 --cpu``: what a small op between hosts costs this process's CPU, without the network.

Between two namespace hosts of one rank each, every op (all_reduce, all_gather, reduce_scatter, all_to_all,
barrier; even sizes, fp32; inputs in the heap, the outputs of all_gather and all_to_all in private memory, so
that both ranks offer alike: loopback hands a rank its own header as its peer's) runs in two ways, batch by
batch, interleaved in the same processes:

* **with the network**: the op as it runs (``op_us``: wall time per call, the slower rank's);
* **without**: the same calls inside :meth:`~zbccl.ops.hosts.mesh.Mesh.loopback` of the communicator's world
  mesh, where each write to the other host lands in the rank's own slot as if the peer had sent the same bytes
  (``cpu_us``: wall time per call, every wait then served at once; ``thread_us``: the calling thread's CPU time).

So ``cpu_us`` is everything zbccl's Python and native code above the transport spend on one op (argument
checks, the agreement, the stamp, the copies and reductions, the waits' polls), with no engine thread and no
peer competing for the core, and ``cpu/op`` its share of the op's time with the network: zbccl's own cost,
apart from the engine's and the link's, to compare before and after a change of the hot path (alternate the
runs: on this VM it moves with the machine's state too). Sizes stay at or below the direct threshold (every
piece through the slots, which is what loopback serves); the results computed in loopback are meaningless and
not checked (the ops' own checks run in ``zbccl bench --hosts``).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import IO

import torch

__all__ = ["run_cpu_bench", "CPU_OPS", "format_cpu_report"]

#: The ops measured (each member sends the other the same lengths: what loopback needs).
CPU_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "barrier")


def _op(comm, op: str, nbytes: int):
    """A call of ``op`` on ``nbytes`` of fp32 heap tensors (the bytes each rank contributes)."""
    import zbccl

    n = max(nbytes // 4, 2)
    n -= n % 2
    inp = zbccl.empty(n, dtype=torch.float32, comm=comm)
    inp.copy_(torch.arange(n, dtype=torch.float32) + 1000 * comm.rank)
    if op == "all_reduce":
        return lambda: zbccl.all_reduce(inp, comm=comm)
    if op == "all_gather":
        out = torch.empty(2 * n, dtype=torch.float32)
        return lambda: zbccl.all_gather_into_tensor(out, inp, comm=comm)
    if op == "reduce_scatter":
        out = zbccl.empty(n // 2, dtype=torch.float32, comm=comm)
        return lambda: zbccl.reduce_scatter_tensor(out, inp, comm=comm)
    if op == "all_to_all":
        out = torch.empty(n, dtype=torch.float32)
        return lambda: zbccl.all_to_all_single(out, inp, comm=comm)
    return lambda: zbccl.barrier(comm=comm)


def rank_main(ctx, *, sizes: list[int], calls: int, rounds: int) -> dict | None:
    """One rank (``tools/netns.run_hosts``); rank 0 returns ``{"cells": [...], "affinity": [...]}``."""
    import zbccl

    torch.set_num_threads(1)
    comm = zbccl.init(store=ctx.store(), rank=ctx.rank, world_size=ctx.world_size,
                      heap_size=8 * max(sizes) + (32 << 20), timeout=120)
    cells = []
    try:
        for op in CPU_OPS:
            for nbytes in sizes if op != "barrier" else sizes[:1]:
                f = _op(comm, op, nbytes)
                for _ in range(20):
                    f()  # the agreement, the plan and the slots' staging, as a repeated op finds them
                mesh = comm.device_state["hosts"].world
                times: dict[str, list[float]] = {"op_us": [], "cpu_us": [], "thread_us": []}
                for _ in range(rounds):
                    zbccl.barrier(comm=comm)
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        f()
                    times["op_us"].append((time.perf_counter() - t0) / calls * 1e6)
                    with mesh.loopback():  # (both ranks run the same calls: their step numbers stay equal)
                        t0, c0 = time.perf_counter(), time.thread_time()
                        for _ in range(calls):
                            f()
                        times["thread_us"].append((time.thread_time() - c0) / calls * 1e6)
                        times["cpu_us"].append((time.perf_counter() - t0) / calls * 1e6)
                    comm.bootstrap.barrier(timeout=120, tag="bench/hosts/cpu")  # (both left loopback: Mesh.loopback)
                mine = torch.tensor([statistics.median(v) for v in times.values()], dtype=torch.float64)
                zbccl.all_reduce(mine, "max", comm=comm)
                cells.append({"op": op, "size": nbytes, **dict(zip(times, (round(x, 1) for x in mine.tolist())))})
        zbccl.barrier(comm=comm)
    finally:
        zbccl.finalize()
    return {"cells": cells, "affinity": sorted(os.sched_getaffinity(0))} if ctx.rank == 0 else None


def run_cpu_bench(*, sizes=(4096, 65536), calls: int = 200, rounds: int = 5, own_cores: bool = False,
                  out: IO[str] | None = None, timeout: float = 600.0) -> dict:
    """Run it between two namespace hosts of one rank each (``own_cores``: each on its own cores); print the
    report to ``out`` (None: stdout) and return ``{"cells", "cores", "rank0_affinity"}``. Raises
    :class:`~zbccl.tools.netns.HostsUnavailable` where namespace hosts cannot be made or Mooncake is missing,
    ``ValueError`` for a size over the direct threshold (loopback serves the slots only)."""
    from ..heap.transports.mooncake import missing_reason
    from ..ops.tuner import HOSTS_DIRECT_MIN
    from ..tools.netns import HostsUnavailable, NetnsHosts, hosts_skip_reason, run_hosts

    sizes = [int(s) for s in sizes]
    if not sizes or any(not 8 <= s <= HOSTS_DIRECT_MIN for s in sizes) or calls < 1 or rounds < 1:
        raise ValueError(f"bench --hosts --cpu: expected sizes of 8 bytes to {HOSTS_DIRECT_MIN} (through the slots), "
                         f"calls and rounds >= 1, got sizes {sizes}, calls {calls}, rounds {rounds}")
    reason = hosts_skip_reason() or missing_reason()
    if reason:
        raise HostsUnavailable(f"bench --hosts --cpu: cannot run between namespace hosts here: {reason}")
    with NetnsHosts(2, own_cores=own_cores) as made:
        got = run_hosts(rank_main, made, 1, timeout=timeout, sizes=sizes, calls=calls, rounds=rounds)[0]
    doc = {"cells": got["cells"], "cores": made.cores, "rank0_affinity": got["affinity"],
           "calls": calls, "rounds": rounds}
    for line in format_cpu_report(doc):
        print(line, file=out or sys.stdout)
    return doc


def format_cpu_report(doc: dict) -> list[str]:
    """The report's lines (module docstring)."""
    cores = doc["cores"]
    lines = [f"# CPU per op between 2 namespace hosts x 1 rank, without the network (Mesh.loopback) and with it; "
             f"{doc['rounds']} rounds of {doc['calls']} calls interleaved, medians, the slower rank",
             f"cores: {'shared' if cores is None else '; '.join(f'host {i} on {c}' for i, c in enumerate(cores))}",
             f"{'op':>15} {'size':>8} {'op_us':>9} {'cpu_us':>9} {'thread_us':>10} {'cpu/op':>7}"]
    for c in doc["cells"]:
        share = c["cpu_us"] / c["op_us"] if c["op_us"] else 0.0
        lines.append(f"{c['op']:>15} {c['size']:>8} {c['op_us']:>9.1f} {c['cpu_us']:>9.1f} {c['thread_us']:>10.1f} "
                     f"{share:>7.2f}")
    return lines
