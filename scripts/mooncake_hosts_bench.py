"""Usage: sudo PYTHONPATH=src:. <venv with zbccl[internode]>/bin/python scripts/mooncake_hosts_bench.py [--json]

Between two namespace hosts (tests/hosts.py: a bridge, veth pairs, net+pid+ipc+uts namespaces), one rank
each, interleaved in the same processes:

* raw Mooncake one-sided writes (``transfer_sync_write`` from rank 0's registered heap into rank 1's):
  the mooncake transport's physical limit here; latency at 4 KiB, bandwidth at 64 KiB-64 MiB;
* the mooncake transport's ``put`` (bounds checks and registration splits included) at the same sizes;
* ``HostExchange.all_reduce`` (zbccl.ops.internode: put + signal, one rank per host) against gloo's
  ``all_reduce`` over the same veth link (``GLOO_SOCKET_IFNAME``), float32, with a correctness column.

Rows: ``what size_bytes median_us p90_us GB/s wrong``. Every figure is a median over its repetitions; the
machine's cores are shared by both "hosts", so these are not NIC numbers.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch

SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]
REPS = {4 << 10: 300, 64 << 10: 200, 1 << 20: 40, 16 << 20: 8, 64 << 20: 5}
RAW = 64 << 20  # [0, RAW): the raw writes' source and target
HEAP = RAW + 2 * (68 << 20)  # then the exchange's two slots


def _stats(what: str, size: int, times: list[float], wrong: int = 0) -> dict:
    med = statistics.median(times)
    p90 = sorted(times)[int(0.9 * (len(times) - 1))]
    return {"what": what, "size": size, "median_us": med * 1e6, "p90_us": p90 * 1e6,
            "gbps": size / med / 1e9, "wrong": wrong}


def rank_main(ctx, *, ifnames: list[str]) -> list[dict]:
    """One rank of the benchmark (host ``ctx.rank``)."""
    import torch.distributed as dist
    from tests.transports.world import line, open_transport

    from zbccl.ops.internode import HostExchange

    os.environ["GLOO_SOCKET_IFNAME"] = ifnames[ctx.rank]
    t, boot = open_transport(ctx, "mooncake", data=HEAP)
    dist.init_process_group("gloo", store=dist.PrefixStore("gloo", ctx.store()), rank=ctx.rank,
                            world_size=ctx.world_size)
    me, peer = ctx.rank, 1 - ctx.rank
    rows: list[dict] = []
    try:
        ex = HostExchange(t, [0, 1], me, data_offset=RAW, data_bytes=HEAP - RAW, line_base=line(16),
                          timeout=120)
        src = t.view(me, 0, (RAW,), torch.uint8)
        src.copy_(torch.arange(RAW, dtype=torch.int64).to(torch.uint8))
        engine, target = t.engine, t.peers[peer]
        t.put(peer, 0, b"warm")  # the handshake
        for size in SIZES:  # phase 1: one-sided writes alone (rank 1 idles in a store barrier)
            raw, put = [], []
            if me == 0:
                for _ in range(REPS[size]):
                    t0 = time.perf_counter()
                    rc = engine.write(target.sid, src.data_ptr(), target.data, size)
                    raw.append(time.perf_counter() - t0)
                    assert rc == 0, rc
                    t0 = time.perf_counter()
                    t.put(peer, 0, src[:size])
                    put.append(time.perf_counter() - t0)
                rows += [_stats("mooncake raw write", size, raw), _stats("transport put", size, put)]
            boot.barrier(timeout=300)
        for size in SIZES:  # phase 2: all_reduce, zbccl and gloo interleaved
            zb, gl, wrong_zb, wrong_gl = [], [], 0, 0
            x = (torch.arange(size // 4, dtype=torch.float32) % 1000) + me
            want = (torch.arange(size // 4, dtype=torch.float32) % 1000) * 2 + 1
            for _ in range(REPS[size]):
                t0 = time.perf_counter()
                got = ex.all_reduce(x)
                zb.append(time.perf_counter() - t0)
                wrong_zb += int(not torch.equal(got, want))
                y = x.clone()
                t0 = time.perf_counter()
                dist.all_reduce(y)
                gl.append(time.perf_counter() - t0)
                wrong_gl += int(not torch.equal(y, want))
            if me == 0:
                rows += [_stats("zbccl all_reduce 2x1", size, zb, wrong_zb), _stats("gloo all_reduce", size, gl,
                                                                                    wrong_gl)]
        boot.barrier(timeout=120)
        return rows
    finally:
        dist.destroy_process_group()
        t.close(unmap=False)


def main() -> None:
    from tests.hosts import NetnsHosts, run_hosts

    with NetnsHosts(2) as hosts:
        ifnames = [f"zbp{hosts.tag}{i}" for i in range(2)]
        rows = run_hosts(rank_main, hosts, timeout=900, ifnames=ifnames)[0]
    if "--json" in sys.argv:
        print(json.dumps(rows, indent=1))
        return
    print(f"{'what':<22} {'size':>10} {'median_us':>10} {'p90_us':>10} {'GB/s':>7} {'wrong':>5}")
    for r in rows:
        print(f"{r['what']:<22} {r['size']:>10} {r['median_us']:>10.1f} {r['p90_us']:>10.1f} {r['gbps']:>7.3f} "
              f"{r['wrong']:>5}")


if __name__ == "__main__":
    import scripts.mooncake_hosts_bench as this  # the ranks import rank_main by this module's name

    this.main()
