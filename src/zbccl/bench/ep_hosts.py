"""Usage: python -m zbccl.bench.ep_hosts [--hosts 2] [--ranks-per-host 2] [--tokens 32,128,512] [--hidden 2048]
                                      [--experts 32] [--topk 4] [--iters 10] [--json PATH]

EP across hosts: ``zbccl.ep.Buffer`` over a group that spans hosts (normal dispatch + combine, and
low-latency dispatch + combine) against gloo's all_to_all with the same semantics (``bench/ep.py``'s
baseline), interleaved iteration by iteration in the same processes. Without ``--hosts`` support from the
caller, the "hosts" are made by ``ZBCCL_HOST_ID`` on this machine (the routed transport: shm within a
host, Mooncake over loopback between them). Columns: ``step_us``/``gloo_us`` (median over iterations of
the slowest rank), ``speedup``, ``wrong`` (elements differing from gloo's result: received rows and
combined tokens), ``crossed_KiB`` (payload bytes that crossed between hosts in one dispatch, all ranks)
against ``flat_KiB`` (what a flat all-to-all sends across: a token once per remote destination rank).

The benchmark of ``zbccl bench --hosts`` calls :func:`hosts_case` in every rank of its own hosts (after
``zbccl.init`` and gloo's ``init_process_group`` over the same ranks) and :func:`summarise` on the results.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from .ep import _Gloo, _ll_step, _routing, _zbccl_step

__all__ = ["hosts_case", "summarise", "run", "main"]

MiB = 1 << 20
#: Untimed iterations of every step before the timed ones, per size.
WARMUP = 3


def _interleaved(steps: dict, iters: int, sync) -> dict[str, list[float]]:
    """Each iteration runs every step once, in turn, after a barrier: wall seconds per step name."""
    out: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(iters):
        for name, fn in steps.items():
            sync()
            t0 = time.perf_counter()
            fn()
            out[name].append(time.perf_counter() - t0)
    return out


def hosts_case(comm, buffer, *, tokens: int, hidden: int, experts: int, topk: int, iters: int) -> dict:
    """One rank's measurement of one size (collective over ``buffer``'s group and torch's default gloo group,
    which must hold the same ranks in the same order): the step times, the differing elements against gloo,
    and the bytes the dispatch moved across hosts through this rank."""
    import torch.distributed as dist

    import zbccl

    R, me, E = comm.world_size, comm.rank, experts
    idx = _routing("uniform", tokens, E, topk, me)
    w = torch.rand(tokens, topk)
    x = (torch.arange(tokens * hidden) % 251 + me).to(torch.bfloat16).view(tokens, hidden)
    with zbccl.heap_scope():
        xh, idxh, wh = x.clone(), idx.clone(), w.clone()
    gloo = _Gloo(R)
    ref_x, ref_comb = gloo.step(x, idx, w, E)
    recv_x, comb, _ = _zbccl_step(buffer, xh, idxh, wh, E)
    wrong = int((recv_x != ref_x).sum()) + int((comb != ref_comb).sum()) if recv_x.shape == ref_x.shape else -1
    crossed = buffer.memory_stats()["rdma_recv_bytes"]
    ll_ref_x, ll_ref_comb = gloo.ll_step(x, idx, w, E)
    ll_x, count, ll_comb = _ll_step(buffer, xh, idxh, wh, E)
    ll_wrong = int((ll_comb != ll_ref_comb).sum())
    for e, c in enumerate(count.tolist()):
        ll_wrong += int((ll_x[e, :c] != ll_ref_x[e, :c]).sum())
    steps = {"zbccl": lambda: _zbccl_step(buffer, xh, idxh, wh, E), "gloo": lambda: gloo.step(x, idx, w, E),
             "ll": lambda: _ll_step(buffer, xh, idxh, wh, E), "ll_gloo": lambda: gloo.ll_step(x, idx, w, E)}
    _interleaved(steps, WARMUP, dist.barrier)  # first calls of a size: fresh heap pages, the engines' first transfers
    times = _interleaved(steps, iters, dist.barrier)
    L = E // R
    hosts = buffer.wire.hosts if buffer.wire is not None else [list(range(R))]
    host_of = {r: h for h, rs in enumerate(hosts) for r in rs}
    dest = torch.zeros(tokens, R, dtype=torch.bool)
    valid = idx >= 0
    dest[torch.arange(tokens).unsqueeze(1).expand_as(idx)[valid], (idx // L)[valid]] = True
    row = 2 * hidden + 12 * topk + 16
    flat = sum(int(dest[:, r].sum()) for r in range(R) if host_of[r] != host_of[me]) * row
    return {"tokens": tokens, "times": times, "wrong": wrong, "ll_wrong": ll_wrong, "crossed": crossed, "flat": flat}


def _slowest(cases: tuple, name: str) -> float:
    """Median over iterations of the slowest rank's time of step ``name``."""
    return statistics.median(max(ts) for ts in zip(*(c["times"][name] for c in cases)))


def summarise(per_rank: list[list[dict]], label: str = "") -> list[dict]:
    """Table rows from every rank's :func:`hosts_case` results (one list per rank, sizes in the same order)."""
    rows = []
    for cases in zip(*per_rank):
        z, g, ll, llg = (_slowest(cases, name) for name in ("zbccl", "gloo", "ll", "ll_gloo"))
        rows.append({"hosts": label, "tokens": cases[0]["tokens"], "step_us": z * 1e6, "gloo_us": g * 1e6,
                     "speedup": g / z, "wrong": sum(c["wrong"] for c in cases), "ll_us": ll * 1e6,
                     "ll_gloo_us": llg * 1e6, "ll_speedup": llg / ll, "ll_wrong": sum(c["ll_wrong"] for c in cases),
                     "crossed_KiB": sum(c["crossed"] for c in cases) / 1024,
                     "flat_KiB": sum(c["flat"] for c in cases) / 1024})
    return rows


def _rank(*, rank: int, world_size: int, store, opts: dict) -> dict:
    import torch.distributed as dist

    import zbccl
    import zbccl.ep as deep_ep

    os.environ["ZBCCL_HOST_ID"] = f"bench-host-{rank // opts['per']}"  # this child's own topology (not at import)
    T, H = max(opts["tokens"]), opts["hidden"]
    comm = zbccl.init(store=dist.PrefixStore("zbccl", store), rank=rank, world_size=world_size,
                      heap_size=max(64 * MiB, 16 * world_size * T * H * 2 + 32 * MiB), timeout=120)
    dist.init_process_group("gloo", store=dist.PrefixStore("gloo", store), rank=rank, world_size=world_size)
    buffer = deep_ep.Buffer(comm, explicitly_destroy=True)
    out = [hosts_case(comm, buffer, tokens=t, hidden=H, experts=opts["experts"], topk=opts["topk"],
                      iters=opts["iters"]) for t in opts["tokens"]]
    buffer.destroy()
    dist.destroy_process_group()
    zbccl.finalize()
    return out


def run(*, hosts: int = 2, per: int = 2, tokens=(32, 128, 512), hidden: int = 2048, experts: int = 32, topk: int = 4,
        iters: int = 10, out=None) -> list[dict]:
    """Run on ``hosts`` x ``per`` local ranks (hosts by ``ZBCCL_HOST_ID``) and print one table; returns the rows."""
    from ..tools.launch import launch_local

    out = out or sys.stdout
    opts = {"per": per, "tokens": list(tokens), "hidden": hidden, "experts": experts, "topk": topk, "iters": iters}
    per_rank = launch_local(_rank, hosts * per, timeout=900, opts=opts)
    rows = summarise(per_rank, f"{hosts}x{per}")
    cols = ("hosts", "tokens", "step_us", "gloo_us", "speedup", "wrong", "ll_us", "ll_gloo_us", "ll_speedup",
            "ll_wrong", "crossed_KiB", "flat_KiB")
    print(f"# ep across hosts (routed, ZBCCL_HOST_ID): hidden={hidden} experts={experts} topk={topk} bf16, "
          f"{iters} interleaved iterations", file=out)
    print(" ".join(f"{c:>11}" for c in cols), file=out)
    for r in rows:
        print(" ".join(f"{r[c]:>11.1f}" if isinstance(r[c], float) else f"{r[c]!s:>11}" for c in cols), file=out)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m zbccl.bench.ep_hosts", description=__doc__.split("\n\n")[1])
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--ranks-per-host", type=int, default=2)
    p.add_argument("--tokens", default="32,128,512")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json")
    a = p.parse_args(argv)
    rows = run(hosts=a.hosts, per=a.ranks_per_host, tokens=[int(t) for t in a.tokens.split(",")], hidden=a.hidden,
               experts=a.experts, topk=a.topk, iters=a.iters)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
