"""Usage: python -m zbccl.bench.ep [-n 2,4] [--tokens 512] [--hidden 2048] [--experts 64] [--topk 8]
                                [--routing uniform,skewed] [--iters 20] [--ll-tokens 128] [--json PATH]

MoE dispatch+combine benchmark: ``zbccl.ep.Buffer`` (operands in the heap, as when the model
runs in ``heap_scope``, and private operands, which are staged) against a gloo baseline with
the same semantics (``all_to_all_single`` with splits, after a counts exchange, and the
matching reverse with an fp32 sum per token), in the same run. Columns: time per step
(layout + dispatch + combine) as the median over iterations of the slowest rank, and as the
best iteration (``_min``: what the machine gives when nothing else runs), the speed-ups over
gloo, ``wrong`` (elements differing from the gloo result: the receive rows and the combined
tokens), CPU time per step (the slowest rank's process time: what a step costs when the
machine is otherwise idle, as waits that yield cost little), the best dispatch alone against the best plain memcpy of the same bytes (all ranks
copying at once), and communication memory: zbccl's peak heap bytes during the step
(receive tensors, plans, staging) against what DeepEP reserves for the same shapes (the
larger of its dispatch/combine ``Config.get_nvl_buffer_size_hint``, and its low-latency
``get_low_latency_rdma_size_hint``). Rows ``ll-heap``: low-latency mode (the first ``--ll-tokens``
tokens per rank, bf16, heap operands: ``low_latency_dispatch`` + weighted ``low_latency_combine``)
against gloo with the same semantics (a row per selected expert, the receiver's per-expert
``[L, R * T, H]`` layout, the weighted fp32 sum back). Each (routing) block also says what the host
was like: ``state``, the host-state probe (``bench/probe.py``: the cost of a store into lines the
peer core just read, fast or slow), and ``cpu_ref_us``, the slowest rank's best time for a fixed
local workload (ten 128x128 fp32 matmuls and a 2 MiB copy): this VM also has a state in which every
local computation takes about twice as long, which the cross-core probe does not see, and a step
whose phases are all local (plan, pull, sum) slows with it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

__all__ = ["run", "main"]

MiB = 1 << 20


def _routing(kind: str, T: int, E: int, K: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234 + rank)
    scores = torch.rand(T, E, generator=g)
    if kind == "skewed":  # 90% of the tokens pick the first K experts (all on rank 0): rank 0 gets most rows
        hot = torch.rand(T, generator=g) < 0.9
        scores[hot, :K] += 10
    return torch.topk(scores, K, dim=1).indices


class _Gloo:
    """The baseline: the same dispatch/combine semantics over gloo's all_to_all_single."""

    def __init__(self, R: int) -> None:
        self.R = R

    def step(self, x, topk_idx, w, E: int):
        import torch.distributed as dist

        R, L = self.R, E // self.R
        in_rank = torch.zeros(x.size(0), R, dtype=torch.bool)
        valid = topk_idx >= 0
        tok = torch.arange(x.size(0)).unsqueeze(1).expand_as(topk_idx)
        in_rank[tok[valid], (topk_idx // L)[valid]] = True
        pairs = in_rank.t().nonzero()
        send_counts = torch.bincount(pairs[:, 0], minlength=R)
        tokens = pairs[:, 1]
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts)
        ins, outs = send_counts.tolist(), recv_counts.tolist()
        recv_x = torch.empty(sum(outs), x.size(1), dtype=x.dtype)
        dist.all_to_all_single(recv_x, x[tokens], outs, ins)
        recv_i = torch.empty(sum(outs), topk_idx.size(1), dtype=topk_idx.dtype)
        dist.all_to_all_single(recv_i, topk_idx[tokens], outs, ins)
        recv_w = torch.empty(sum(outs), w.size(1), dtype=w.dtype)
        dist.all_to_all_single(recv_w, w[tokens], outs, ins)
        back = torch.empty(len(tokens), x.size(1), dtype=x.dtype)
        dist.all_to_all_single(back, recv_x, ins, outs)  # the "expert" is the identity
        acc = torch.zeros(x.size(0), x.size(1), dtype=torch.float32)
        acc.index_add_(0, tokens, back.float())
        return recv_x, acc.to(x.dtype)


    def ll_step(self, x, topk_idx, w, E: int):
        """Low-latency semantics: a token goes once per selected expert, lands in the receiver's
        ``[L, R * T, H]`` per-expert layout (by source rank, then token), and comes back weighted."""
        import torch.distributed as dist

        R, L, (T, H), K = self.R, E // self.R, x.shape, topk_idx.size(1)
        flat = topk_idx.reshape(-1)
        slots = (flat >= 0).nonzero().flatten()
        experts = flat[slots]
        order = torch.sort(experts * (T * K) + slots).indices
        slots, experts = slots[order], experts[order]
        tokens = slots // K
        send = torch.bincount(experts // L, minlength=R)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
        ins, outs = send.tolist(), recv.tolist()
        rx = torch.empty(sum(outs), H, dtype=x.dtype)
        dist.all_to_all_single(rx, x[tokens], outs, ins)
        rexp = torch.empty(sum(outs), dtype=torch.int64)
        dist.all_to_all_single(rexp, experts, outs, ins)
        local = rexp % L
        perm = torch.sort(local, stable=True).indices  # by expert, then source rank, then token
        cnt = torch.bincount(local, minlength=L)
        pos = torch.arange(len(perm)) - (cnt.cumsum(0) - cnt)[local[perm]]
        out = torch.empty(L, R * T, H, dtype=x.dtype)
        out.view(-1, H)[local[perm] * (R * T) + pos] = rx[perm]
        back = torch.empty(len(tokens), H, dtype=x.dtype)
        dist.all_to_all_single(back, rx, ins, outs)  # the "expert" is the identity
        acc = torch.zeros(T, H, dtype=torch.float32)
        acc.index_add_(0, tokens, back.float() * w.reshape(-1)[slots].unsqueeze(1))
        return out, acc.to(x.dtype)


def _ll_step(buffer, x, topk_idx, w, E: int):
    recv_x, count, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, x.size(0), E, use_fp8=False)
    combined, _, _ = buffer.low_latency_combine(recv_x, topk_idx, w, handle)
    return recv_x, count, combined


def _zbccl_step(buffer, x, topk_idx, w, E: int):
    ntpr, _, ntpe, in_rank, _ = buffer.get_dispatch_layout(topk_idx, E)
    t0 = time.perf_counter()
    recv_x, _, _, _, handle, _ = buffer.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=in_rank,
                                                 num_tokens_per_expert=ntpe, topk_idx=topk_idx, topk_weights=w)
    t1 = time.perf_counter()
    combined, _, _ = buffer.combine(recv_x, handle)
    return recv_x, combined, t1 - t0


def _timed(fn, iters: int, sync, cpu: list | None = None) -> list[float]:
    """Wall time of each call (after a barrier); ``cpu`` gets this process's CPU seconds per call."""
    out, used = [], 0.0
    for _ in range(iters):
        sync()
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
        used += time.process_time() - c0
    if cpu is not None:
        cpu.append(used / max(iters, 1))
    return out


def _cpu_ref_s() -> float:
    """Best of 5 runs of a fixed local workload (compute and copy), seconds."""
    a, b = torch.ones(128, 128), torch.ones(128, 128)
    src, dst = torch.ones(1 << 19), torch.empty(1 << 19)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(10):
            torch.mm(a, b)
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return best


def _case(comm, buffer, gloo, routing: str, o: dict) -> dict:
    import zbccl

    from .probe import probe_host_state

    T, H, E, K, iters = o["tokens"], o["hidden"], o["experts"], o["topk"], o["iters"]
    me = comm.rank
    topk_idx = _routing(routing, T, E, K, me)
    w = torch.rand(T, K)
    x_priv = (torch.arange(T * H) % 251 + me).to(torch.bfloat16).view(T, H)
    with zbccl.heap_scope():
        x_heap, idx_heap, w_heap = x_priv.clone(), topk_idx.clone(), w.clone()
    ref_x, ref_comb = gloo.step(x_priv, topk_idx, w, E)
    probe = probe_host_state(comm)
    row = {"routing": routing, "state": probe["state"] if probe else "-", "cpu_ref_s": _cpu_ref_s()}
    for mode, args in (("heap", (x_heap, idx_heap, w_heap)), ("private", (x_priv, topk_idx, w))):
        recv_x, comb, _ = _zbccl_step(buffer, *args, E)
        wrong = int((recv_x != ref_x).sum()) + int((comb != ref_comb).sum()) if recv_x.shape == ref_x.shape else -1
        buffer.ex.drop_reused()  # the peak counts the step's outputs, not blocks cached from before
        stats0 = comm.sma.stats()["allocated_bytes"]
        comm.sma.reset_peak()
        disp: list[float] = []
        cpu: list[float] = []
        times = _timed(lambda a=args, d=disp: d.append(_zbccl_step(buffer, *a, E)[2]), iters, comm.barrier, cpu)
        peak = comm.sma.stats()["peak_allocated_bytes"] - stats0
        row[mode] = {"step_s": times, "dispatch_s": disp, "wrong": wrong, "heap_peak_bytes": peak, "cpu_s": cpu[0]}
    cpu = []
    row["gloo"] = {"step_s": _timed(lambda: gloo.step(x_priv, topk_idx, w, E), iters, comm.barrier, cpu),
                   "cpu_s": cpu[0]}
    _ll_case(comm, buffer, gloo, row, x_heap[:o["ll_tokens"]], idx_heap[:o["ll_tokens"]], w_heap[:o["ll_tokens"]],
             E, iters)
    recv_bytes = ref_x.numel() * ref_x.element_size()
    src, dst = torch.empty(max(recv_bytes, 1), dtype=torch.uint8), torch.empty(max(recv_bytes, 1), dtype=torch.uint8)
    row["memcpy_s"] = _timed(lambda: dst.copy_(src), iters, comm.barrier)
    row["recv_bytes"] = recv_bytes
    return row


def _ll_case(comm, buffer, gloo, row: dict, x, topk_idx, w, E: int, iters: int) -> None:
    """Low-latency dispatch + combine (bf16, heap operands) against gloo with the same semantics;
    ``wrong`` counts differing elements of the valid received rows and of the combined tokens."""
    ref_x, ref_comb = gloo.ll_step(x, topk_idx, w, E)
    recv_x, count, comb = _ll_step(buffer, x, topk_idx, w, E)
    wrong = int((comb != ref_comb).sum())
    for e, c in enumerate(count.tolist()):
        wrong += int((recv_x[e, :c] != ref_x[e, :c]).sum())
    cpu: list[float] = []
    row["ll"] = {"step_s": _timed(lambda: _ll_step(buffer, x, topk_idx, w, E), iters, comm.barrier, cpu),
                 "cpu_s": cpu[0], "wrong": wrong}
    cpu = []
    row["ll_gloo"] = {"step_s": _timed(lambda: gloo.ll_step(x, topk_idx, w, E), iters, comm.barrier, cpu),
                      "cpu_s": cpu[0]}


def _rank(*, rank: int, world_size: int, store, opts: dict) -> dict:
    import torch.distributed as dist

    import zbccl
    import zbccl.ep as deep_ep

    T, H = opts["tokens"], opts["hidden"]
    comm = zbccl.init(store=dist.PrefixStore("zbccl", store), rank=rank, world_size=world_size,
                      heap_size=max(64 * MiB, 8 * world_size * T * H * 2 + 32 * MiB), timeout=120)
    dist.init_process_group("gloo", store=dist.PrefixStore("gloo", store), rank=rank, world_size=world_size)
    buffer = deep_ep.Buffer(comm, explicitly_destroy=True)
    rows = [_case(comm, buffer, _Gloo(world_size), r, opts) for r in opts["routing"]]
    everyone = comm.all_gather_object(rows)
    buffer.destroy()
    dist.destroy_process_group()
    zbccl.finalize()
    return {"ranks": everyone} if rank == 0 else {}


def _slowest(per_rank: list[list[float]], pick=statistics.median) -> float:
    """Median (or ``pick``) over iterations of the slowest rank's time."""
    return pick([max(ts) for ts in zip(*per_rank)])


def _summarise(world: int, ranks: list[list[dict]], opts: dict) -> list[dict]:
    import zbccl.ep as deep_ep

    H, T, E = opts["hidden"], opts["tokens"], opts["experts"]
    hb = H * 2
    reserve = max(deep_ep.Buffer.get_dispatch_config(world).get_nvl_buffer_size_hint(hb, world),
                  deep_ep.Buffer.get_combine_config(world).get_nvl_buffer_size_hint(hb, world))
    ll = deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, world, E)
    out = []
    for i, routing in enumerate(opts["routing"]):
        per = [r[i] for r in ranks]
        gloo = _slowest([p["gloo"]["step_s"] for p in per])
        gloo_min = _slowest([p["gloo"]["step_s"] for p in per], min)
        memcpy = _slowest([p["memcpy_s"] for p in per], min)
        host = {"state": per[0]["state"], "cpu_ref_us": max(p["cpu_ref_s"] for p in per) * 1e6}
        for mode in ("heap", "private"):
            step = _slowest([p[mode]["step_s"] for p in per])
            step_min = _slowest([p[mode]["step_s"] for p in per], min)
            disp = _slowest([p[mode]["dispatch_s"] for p in per], min)
            peak = max(p[mode]["heap_peak_bytes"] for p in per)
            cpu, gloo_cpu = max(p[mode]["cpu_s"] for p in per), max(p["gloo"]["cpu_s"] for p in per)
            out.append({"world": world, "routing": routing, "operands": mode, **host, "step_us": step * 1e6,
                        "gloo_step_us": gloo * 1e6, "speedup": gloo / step, "step_min_us": step_min * 1e6,
                        "gloo_min_us": gloo_min * 1e6, "speedup_min": gloo_min / step_min, "dispatch_min_us": disp * 1e6,
                        "cpu_us": cpu * 1e6, "gloo_cpu_us": gloo_cpu * 1e6,
                        "wrong": sum(p[mode]["wrong"] for p in per),
                        "dispatch_vs_memcpy": memcpy / disp if disp else 0.0,
                        "heap_peak_MiB": peak / MiB, "deepep_nvl_MiB": reserve / MiB, "deepep_ll_MiB": ll / MiB,
                        "mem_ratio": peak / reserve, "recv_MiB_max": max(p["recv_bytes"] for p in per) / MiB})
        t, g = _slowest([p["ll"]["step_s"] for p in per]), _slowest([p["ll_gloo"]["step_s"] for p in per])
        tm, gm = _slowest([p["ll"]["step_s"] for p in per], min), _slowest([p["ll_gloo"]["step_s"] for p in per], min)
        out.append({"world": world, "routing": routing, "operands": "ll-heap", **host, "step_us": t * 1e6,
                    "gloo_step_us": g * 1e6,
                    "speedup": g / t, "step_min_us": tm * 1e6, "gloo_min_us": gm * 1e6, "speedup_min": gm / tm,
                    "dispatch_min_us": 0.0, "cpu_us": max(p["ll"]["cpu_s"] for p in per) * 1e6,
                    "gloo_cpu_us": max(p["ll_gloo"]["cpu_s"] for p in per) * 1e6,
                    "wrong": sum(p["ll"]["wrong"] for p in per), "dispatch_vs_memcpy": 0.0, "heap_peak_MiB": 0.0,
                    "deepep_nvl_MiB": reserve / MiB, "deepep_ll_MiB": ll / MiB, "mem_ratio": 0.0, "recv_MiB_max": 0.0})
    return out


def run(*, worlds=(2, 4), tokens: int = 512, hidden: int = 2048, experts: int = 64, topk: int = 8,
        routing=("uniform", "skewed"), iters: int = 20, ll_tokens: int = 128, out=None) -> list[dict]:
    """Run the benchmark for each world size and print one table; returns the rows."""
    from ..tools.launch import launch_local

    out = out or sys.stdout
    opts = {"tokens": tokens, "hidden": hidden, "experts": experts, "topk": topk, "routing": list(routing),
            "iters": iters, "ll_tokens": min(ll_tokens, tokens)}
    rows = []
    for world in worlds:
        res = launch_local(_rank, world, timeout=900, opts=opts)[0]
        rows += _summarise(world, res["ranks"], opts)
    cols = ("world", "routing", "operands", "state", "cpu_ref_us", "step_us", "gloo_step_us", "speedup", "step_min_us", "gloo_min_us",
            "speedup_min", "cpu_us", "gloo_cpu_us", "wrong", "dispatch_min_us", "dispatch_vs_memcpy", "heap_peak_MiB", "deepep_nvl_MiB",
            "mem_ratio", "deepep_ll_MiB")
    print(f"# ep dispatch+combine: tokens/rank={tokens} hidden={hidden} experts={experts} topk={topk} bf16", file=out)
    print(" ".join(f"{c:>12}" for c in cols), file=out)
    for r in rows:
        print(" ".join(f"{r[c]:>12.3f}" if isinstance(r[c], float) else f"{r[c]!s:>12}" for c in cols), file=out)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m zbccl.bench.ep", description=__doc__.split("\n\n")[1])
    p.add_argument("-n", "--world-sizes", default="2,4")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--routing", default="uniform,skewed")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--ll-tokens", type=int, default=128)
    p.add_argument("--json")
    a = p.parse_args(argv)
    rows = run(worlds=[int(w) for w in a.world_sizes.split(",")], tokens=a.tokens, hidden=a.hidden,
               experts=a.experts, topk=a.topk, routing=a.routing.split(","), iters=a.iters, ll_tokens=a.ll_tokens)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
