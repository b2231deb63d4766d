"""Usage: sudo PYTHONPATH=src:. <venv with zbccl[internode]>/bin/python scripts/hosts_ops_bench.py [--per-host 1|2] [--json]

The public collectives across namespace hosts (tests/hosts.py; ``ops/hosts``: the flat exchange, and the
hierarchical algorithms at 2 x 2) against gloo over the same veth links (``GLOO_SOCKET_IFNAME``),
interleaved in the same processes, float32 sum, with a correctness column, after a warm-up. A store barrier before each
repetition starts the ranks together, as a model step does. Rows: ``op size zbccl_us gloo_us speedup
wrong`` (medians over the repetitions, rank 0's clock), then the load average: the cores are shared by
every "host", so these are not NIC numbers.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch

SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20]
REPS = {4 << 10: 100, 64 << 10: 60, 1 << 20: 20, 16 << 20: 5}


def rank_main(ctx, *, ifnames: list[str], per_host: int) -> list[dict]:
    """One rank of the benchmark."""
    import torch.distributed as dist

    import zbccl

    os.environ["GLOO_SOCKET_IFNAME"] = ifnames[ctx.rank // per_host]
    comm = ctx.init(heap_size=96 << 20, timeout=120)
    dist.init_process_group("gloo", store=dist.PrefixStore("gloo", ctx.store()), rank=ctx.rank,
                            world_size=ctx.world_size)
    me, W, rows = comm.rank, comm.world_size, []
    try:
        for _ in range(50):  # warm-up: Mooncake opens its TCP lanes on the first transfers
            zbccl.all_reduce(torch.ones(1024))
            dist.all_reduce(torch.ones(1024))
        for op in ("all_reduce", "all_gather"):
            for size in SIZES:
                n = size // 4
                x = (torch.arange(n, dtype=torch.float32) % 1000) + me
                if op == "all_reduce":
                    want = (torch.arange(n, dtype=torch.float32) % 1000) * W + sum(range(W))
                else:
                    want = torch.cat([(torch.arange(n, dtype=torch.float32) % 1000) + r for r in range(W)])
                zb, gl, wrong_zb, wrong_gl = [], [], 0, 0
                for _ in range(REPS[size]):
                    for which, times in (("zbccl", zb), ("gloo", gl)):
                        y = x.clone()
                        out = torch.empty(W * n)
                        comm.bootstrap.barrier(timeout=120)
                        t0 = time.perf_counter()
                        if op == "all_reduce":
                            zbccl.all_reduce(y) if which == "zbccl" else dist.all_reduce(y)
                        elif which == "zbccl":
                            zbccl.all_gather_into_tensor(out, y)
                        else:
                            dist.all_gather_into_tensor(out, y)
                        times.append(time.perf_counter() - t0)
                        bad = int(not torch.equal(y if op == "all_reduce" else out, want))
                        if which == "zbccl":
                            wrong_zb += bad
                        else:
                            wrong_gl += bad
                z, g = statistics.median(zb), statistics.median(gl)
                rows.append({"op": op, "size": size, "zbccl_us": z * 1e6, "gloo_us": g * 1e6, "speedup": g / z,
                             "wrong": f"{wrong_zb}/{wrong_gl}"})
        rows.append({"loadavg": os.getloadavg()})
        return rows
    finally:
        dist.destroy_process_group()
        zbccl.finalize()


def main() -> None:
    from tests.hosts import NetnsHosts, run_hosts

    per_host = int(sys.argv[sys.argv.index("--per-host") + 1]) if "--per-host" in sys.argv else 1
    with NetnsHosts(2) as hosts:
        ifnames = [f"zbp{hosts.tag}{i}" for i in range(2)]
        rows = run_hosts(rank_main, hosts, ranks_per_host=per_host, timeout=1200, ifnames=ifnames,
                         per_host=per_host)[0]
    if "--json" in sys.argv:
        print(json.dumps(rows, indent=1))
        return
    print(f"2 hosts x {per_host}: {'op':<11} {'size':>9} {'zbccl_us':>10} {'gloo_us':>10} {'speedup':>8} wrong(z/g)")
    for r in rows[:-1]:
        print(f"{'':<14}{r['op']:<11} {r['size']:>9} {r['zbccl_us']:>10.1f} {r['gloo_us']:>10.1f} "
              f"{r['speedup']:>8.2f} {r['wrong']}")
    print(f"load average during the run: {rows[-1]['loadavg']}")


if __name__ == "__main__":
    import scripts.hosts_ops_bench as this  # the ranks import rank_main by this module's name

    this.main()
