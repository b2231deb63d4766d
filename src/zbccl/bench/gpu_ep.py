"""The GPU check's EP cases (``bench/gpu_steps.py``): ``zbccl.ep.Buffer`` on CUDA tensors, as DeepEP code calls it.

Every rank rebuilds every rank's inputs from seeds (rows encode rank and token), runs the Buffer on CUDA tensors
(the device path, ``ep/device.py``) and compares each result, on the host, bit for bit with the plain-torch
oracle (``zbccl.ep.reference``): normal dispatch (bf16 and fp8, with top-k, from a heap ``x``, a cached one,
``num_worst_tokens``)
and combine (weights, a bias, ``async_finish`` events); low-latency dispatch (bf16, fp8, UE8M0) and combine (a
fresh output, the zero-copy buffer), and on CUDA the low-latency step and a normal-mode step (``num_worst_tokens``)
captured in a CUDA graph and replayed.
Each case is one line of the check (``ep/...``).
"""

from __future__ import annotations

import torch

from ..ep import reference as ref
from ..ep.layout import fp8_quantize
from .gpu_cases import Rank, diff, run_case

__all__ = ["ep_cases", "ep_inputs"]

H, K, TMAX = 512, 4, 32


def ep_inputs(r: int, E: int, *, hidden: int = H, topk: int = K, tokens: tuple[int, int] = (9, 5),
              seed: int = 7000, drop: float = 0.15):
    """Rank r's ``(x [T, hidden] bf16, topk_idx [T, topk], topk_weights)`` on the CPU, from seeds: ``T = tokens[0] +
    tokens[1] * r`` (a count that differs per rank), distinct experts per token with a ``drop`` share of -1, and
    rows that encode rank and token (the EP tests use it too)."""
    g = torch.Generator().manual_seed(seed + r)
    T = tokens[0] + tokens[1] * r
    idx = torch.stack([torch.randperm(E, generator=g)[:topk] for _ in range(T)])
    idx[torch.rand(T, topk, generator=g) < drop] = -1
    w = torch.rand(T, topk, generator=g)
    t = torch.arange(T, dtype=torch.float32).unsqueeze(1)
    x = ((t * 0.5 + r * 16 + torch.arange(hidden) * 0.03125) % 64 - 32).to(torch.bfloat16)
    return x, idx, w


def ep_cases(rk: Rank) -> list[tuple[str, bool, str]]:
    """The EP cases of one rank (see the module docstring)."""
    import zbccl.ep as deep_ep

    W, me, res = rk.world, rk.rank, []
    E = 4 * W
    dev = rk.device
    ins = [ep_inputs(r, E) for r in range(W)]
    xs, idxs, ws = [a for a, _, _ in ins], [i for _, i, _ in ins], [v for _, _, v in ins]
    in_ranks = [ref.dispatch_layout(i, E, W)[2] for i in idxs]
    x, idx, w = (t.to(dev) for t in ins[me])
    buf = deep_ep.Buffer(rk.comm, num_nvl_bytes=1 << 20, explicitly_destroy=True)
    C = deep_ep.Buffer.num_sms // 2
    state: dict = {}

    def normal():
        ntpr, _, ntpe, in_rank, _ = buf.get_dispatch_layout(idx, E)
        recv_x, recv_idx, recv_w, lst, h, ev = buf.dispatch(
            x, num_tokens_per_rank=ntpr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe, topk_idx=idx,
            topk_weights=w, expert_alignment=2, async_finish=True)
        ev.current_stream_wait()
        want = ref.dispatch(xs, in_ranks, me, E, topk_idx=idxs, topk_weights=ws, expert_alignment=2, num_channels=C)
        state.update(h=h, recv_x=recv_x, recv_w=recv_w, ntpr=ntpr, ntpe=ntpe, in_rank=in_rank)
        if lst != want["num_recv_tokens_per_expert_list"]:
            return f"num_recv_tokens_per_expert_list {lst} != {want['num_recv_tokens_per_expert_list']}"
        return (diff(recv_x, want["x"]) or diff(recv_idx, want["topk_idx"]) or diff(recv_w, want["topk_weights"])
                or diff(h[0], want["rank_prefix_matrix"]) or diff(h[1], want["channel_prefix_matrix"])
                or diff(h[2], want["recv_channel_prefix_matrix"]) or diff(h[3], want["src_idx"])
                or diff(h[5], want["send_head"]))

    def heap_x():
        """x in the heap: each peer pulls its rows where they are (``all_to_all_v(rows=)`` on CUDA)."""
        xh = rk.empty(tuple(x.shape), x.dtype)
        xh.copy_(x)
        recv_x, recv_idx, *_ = buf.dispatch(xh, num_tokens_per_rank=state["ntpr"], is_token_in_rank=state["in_rank"],
                                            num_tokens_per_expert=state["ntpe"], topk_idx=idx, topk_weights=w)
        want = ref.dispatch(xs, in_ranks, me, E, topk_idx=idxs, topk_weights=ws)
        return diff(recv_x, want["x"]) or diff(recv_idx, want["topk_idx"])

    def cached():
        again, *_ = buf.dispatch(x * 2, handle=state["h"])
        want = ref.dispatch([(a.float() * 2).to(torch.bfloat16) for a in xs], in_ranks, me, E)
        return diff(again, want["x"])

    def combine():
        bias = torch.full((x.size(0), H), 0.25, dtype=torch.bfloat16, device=dev)
        y = (state["recv_x"].float() * 0.5 + me).to(torch.bfloat16)
        out, out_w, ev = buf.combine(y, state["h"], state["recv_w"], bias=bias, async_finish=True)
        ev.current_stream_wait()
        ys, wws = [], []
        for r in range(W):
            wr = ref.dispatch(xs, in_ranks, r, E, topk_idx=idxs, topk_weights=ws)
            ys.append((wr["x"].float() * 0.5 + r).to(torch.bfloat16))
            wws.append(wr["topk_weights"])
        want, want_w = ref.combine(ys, in_ranks, me, topk_weights=wws, bias=(bias.cpu(),))
        return diff(out, want) or diff(out_w, want_w)

    def worst():
        n_worst = 128
        wx, widx, _, lst, _, _ = buf.dispatch(x, num_tokens_per_rank=state["ntpr"], is_token_in_rank=state["in_rank"],
                                              num_tokens_per_expert=state["ntpe"], topk_idx=idx, topk_weights=w,
                                              num_worst_tokens=n_worst)
        want = ref.dispatch(xs, in_ranks, me, E, topk_idx=idxs, topk_weights=ws)
        n = want["x"].size(0)
        if wx.size(0) != n_worst or lst != [] or not bool((widx[n:] == -1).all()):
            return f"num_worst_tokens: {wx.size(0)} rows, list {lst}, top-k past the rows not -1"
        return diff(wx[:n], want["x"])

    def fp8():
        xs8 = [fp8_quantize(a) for a in xs]
        mine = (xs8[me][0].to(dev), xs8[me][1].to(dev))
        (r8, s8), *_ = buf.dispatch(mine, num_tokens_per_rank=state["ntpr"], is_token_in_rank=state["in_rank"],
                                    num_tokens_per_expert=state["ntpe"], topk_idx=idx, topk_weights=w)
        want = ref.dispatch(xs8, in_ranks, me, E)
        return diff(r8, want["x"][0]) or diff(s8, want["x"][1])

    def low_latency(use_fp8: bool, ue8m0: bool):
        def case():
            recv, count, handle, ev, hook = buf.low_latency_dispatch(x, idx, TMAX, E, use_fp8=use_fp8,
                                                                      round_scale=ue8m0, use_ue8m0=ue8m0)
            want = ref.low_latency_dispatch(xs, idxs, me, TMAX, E, use_fp8=use_fp8, round_scale=ue8m0,
                                            use_ue8m0=ue8m0)
            rx, sx = recv if use_fp8 else (recv, None)
            bad = diff(count, want["count"]) or diff(handle[1], want["layout_range"])
            for le in range(E // W):
                n = int(want["count"][le])
                bad = bad or diff(handle[0][le, :n], want["src_info"][le, :n]) or diff(rx[le, :n], want["x"][le, :n])
                if use_fp8:
                    bad = bad or diff(sx[le, :n], want["scales"][le, :n])
            if not use_fp8:
                state["ll"] = (recv, handle)
            return bad
        return case

    def ll_combine(zero_copy: bool):
        def case():
            recv, handle = state["ll"]
            y = (recv.float() * 0.75 - me).to(torch.bfloat16)
            if zero_copy:
                into = buf.get_next_low_latency_combine_buffer(handle)
                into.copy_(y)
                y = into
            got, _, _ = buf.low_latency_combine(y, idx, w, handle, zero_copy=zero_copy)
            outs = [(ref.low_latency_dispatch(xs, idxs, o, TMAX, E)["x"].float() * 0.75 - o).to(torch.bfloat16)
                    for o in range(W)]
            return diff(got, ref.low_latency_combine(outs, idxs, me, ws[me]))
        return case

    def ll_graph():
        """Low-latency dispatch -> expert step -> combine captured once in a CUDA graph, replayed on new rows:
        each replay equals the same step run eagerly."""
        xs_static = x.clone()

        def step():
            recv, _, handle, _, _ = buf.low_latency_dispatch(xs_static, idx, TMAX, E, use_fp8=False)
            out, _, _ = buf.low_latency_combine((recv.float() * 0.75 - me).to(torch.bfloat16), idx, w, handle)
            return (out,)

        return _replays(rk, step, xs_static, x)

    def normal_graph():
        """Normal mode with ``num_worst_tokens`` (no host sync): layout -> dispatch -> expert step -> combine
        captured once in a CUDA graph, replayed on new rows: each replay equals the same step run eagerly."""
        xs_static = x.clone()

        def step():
            ntpr, _, ntpe, in_rank, _ = buf.get_dispatch_layout(idx, E)
            recv_x, _, recv_w, _, h, _ = buf.dispatch(xs_static, num_tokens_per_rank=ntpr, is_token_in_rank=in_rank,
                                                      num_tokens_per_expert=ntpe, topk_idx=idx, topk_weights=w,
                                                      num_worst_tokens=W * 32)
            out, out_w, _ = buf.combine((recv_x.float() * 0.75 - me).to(torch.bfloat16), h, recv_w)
            return out, out_w

        return _replays(rk, step, xs_static, x)

    try:
        run_case(rk, "ep/normal_dispatch", normal, res)
        run_case(rk, "ep/heap_x_dispatch", heap_x, res)
        run_case(rk, "ep/cached_dispatch", cached, res)
        run_case(rk, "ep/normal_combine", combine, res)
        run_case(rk, "ep/num_worst_tokens", worst, res)
        run_case(rk, "ep/fp8_dispatch", fp8, res)
        run_case(rk, "ep/ll_dispatch_bf16", low_latency(False, False), res)
        run_case(rk, "ep/ll_dispatch_fp8", low_latency(True, False), res)
        run_case(rk, "ep/ll_dispatch_ue8m0", low_latency(True, True), res)
        run_case(rk, "ep/ll_combine", ll_combine(False), res)
        run_case(rk, "ep/ll_combine_zero_copy", ll_combine(True), res)
        if dev.type == "cuda":
            run_case(rk, "ep/ll_graph", ll_graph, res)
            run_case(rk, "ep/normal_graph", normal_graph, res)
    finally:
        buf.destroy()
    return res


def _replays(rk: Rank, step, xs_static: torch.Tensor, x: torch.Tensor) -> str | None:
    """``step`` (returning a tuple of tensors) run once eagerly, captured once in a CUDA graph, then replayed on
    three new contents of ``xs_static`` (made from ``x``): each replay's outputs against the same step run
    eagerly; None, or what differed."""
    step()
    rk.finish()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for it in range(3):
        xs_static.copy_((x.float() * (it + 2) % 17).to(torch.bfloat16))
        graph.replay()
        got = [t.clone() for t in captured]
        rk.finish()
        bad = next((b for b in map(diff, got, step()) if b), None)
        if bad:
            return f"replay {it}: {bad}"
    return None
