"""zbccl.ep normal mode: DeepEP's test_intranode checks at world 2 and 4, on CPU.

Payloads encode their source rank (``x = ones * rank``), so a misplaced row is caught;
layouts are checked against DeepEP's own reference computation, gathered over zbccl.
"""

from __future__ import annotations

import pytest
import torch

from tests.multiproc.ep_checks import (
    calc_diff,
    check_data,
    per_token_cast_back,
    per_token_cast_to_fp8,
    ref_layout,
)
from tests.spawn import run_world

MiB = 1 << 20


def _gather(t: torch.Tensor, comm) -> list[torch.Tensor]:
    """Every rank's ``t`` (the same shape on every rank), in rank order."""
    import zbccl

    out = torch.empty(comm.world_size * t.numel(), dtype=t.dtype)
    zbccl.all_gather_into_tensor(out, t.contiguous().view(-1), comm=comm)
    return list(out.view(comm.world_size, *t.shape).unbind(0))


def _gather_sum(t: torch.Tensor, comm) -> torch.Tensor:
    import zbccl

    out = torch.empty(comm.world_size * t.numel(), dtype=t.dtype)
    zbccl.all_gather_into_tensor(out, t.contiguous().view(-1), comm=comm)
    return out.view(comm.world_size, *t.shape).sum(0).to(t.dtype)


def _intranode(buffer, comm, T: int, H: int, K: int, E: int, *, skew: bool = False, seed: int = 0):
    import zbccl.ep as deep_ep

    R, rank = comm.world_size, comm.rank
    torch.manual_seed(seed + rank)
    x = torch.ones((T, H), dtype=torch.bfloat16) * rank
    x_pure_rand = torch.randn((T, H), dtype=torch.bfloat16)
    x_e4m3 = per_token_cast_to_fp8(x)
    x_e4m3 = (x_e4m3[0], x_e4m3[1].T.contiguous().T)
    scores = torch.randn((T, E), dtype=torch.float32).abs() + 1
    if skew:  # one expert (and so one rank) gets most tokens; the last rank gets none
        scores[:, 1] += 100
        scores[:, (R - 1) * (E // R):] = -1
    topk_idx = torch.topk(scores, K, dim=-1, largest=True, sorted=False)[1].to(deep_ep.topk_idx_t)
    topk_weights = torch.ones((T, K), dtype=torch.float32) * rank
    topk_weights_pure_rand = torch.randn((T, K), dtype=torch.float32)
    per_rank, per_expert, is_token_in_rank = ref_layout(topk_idx, E, R)
    gbl_per_expert, gbl_per_rank = _gather_sum(per_expert, comm), _gather_sum(per_rank, comm)

    ref_rank, ref_rdma, ref_expert, ref_in_rank, _ = buffer.get_dispatch_layout(topk_idx, E)
    assert ref_rdma is None
    assert torch.allclose(ref_rank, per_rank) and ref_rank.dtype == torch.int32
    assert torch.allclose(ref_expert, per_expert) and ref_expert.dtype == torch.int32
    assert torch.equal(ref_in_rank, is_token_in_rank) and ref_in_rank.dtype == torch.bool
    config = deep_ep.Config(24, 8, 256)
    for previous_mode in (False, True):
        for async_mode in (False, True):
            for current_x in (x_pure_rand, x, x_e4m3):
                for with_topk in (False, True):
                    args = {"x": current_x, "num_tokens_per_rank": per_rank, "is_token_in_rank": is_token_in_rank,
                            "num_tokens_per_expert": per_expert, "config": config, "async_finish": async_mode}
                    if with_topk:
                        args.update({"topk_idx": topk_idx,
                                     "topk_weights": topk_weights_pure_rand if current_x is x_pure_rand else topk_weights})
                    if previous_mode:
                        args["previous_event"] = buffer.capture()
                    recv_x, recv_topk_idx, recv_topk_weights, lst, handle, event = buffer.dispatch(**args)
                    event.current_stream_wait() if async_mode else ()
                    recv_x = per_token_cast_back(*recv_x) if isinstance(recv_x, tuple) else recv_x
                    rpm = handle[0]
                    assert gbl_per_rank[rank].item() == recv_x.size(0)
                    assert gbl_per_expert.view(R, -1)[rank].tolist() == lst
                    if current_x is not x_pure_rand:
                        check_data(recv_x, rpm, rank, R)
                    w_clone = None
                    if with_topk:
                        L = E // R
                        assert (recv_topk_idx.eq(-1) | ((recv_topk_idx >= 0) & (recv_topk_idx < L))).all()
                        for i, count in enumerate(lst):
                            assert recv_topk_idx.eq(i).sum().item() == count
                        w_clone = recv_topk_weights.clone()
                        if current_x is not x_pure_rand:
                            mask = recv_topk_idx.eq(-1)
                            recv_topk_weights[mask] = recv_topk_weights.amax(dim=1, keepdim=True).expand_as(
                                recv_topk_weights)[mask]
                            check_data(recv_topk_weights, rpm, rank, R)
                    worst = T * R
                    if with_topk and worst:
                        args["num_worst_tokens"] = worst
                        wx, widx, ww, empty, _, event = buffer.dispatch(**args)
                        event.current_stream_wait() if async_mode else ()
                        wx = per_token_cast_back(*wx) if isinstance(wx, tuple) else wx
                        assert len(empty) == 0 and wx.size(0) == worst and widx.size(0) == worst and ww.size(0) == worst
                        n = recv_x.size(0)
                        assert torch.equal(recv_x, wx[:n]) and torch.equal(recv_topk_idx, widx[:n])
                        assert torch.equal(w_clone, ww[:n]) and bool((widx[n:] == -1).all())
                    if not with_topk:
                        cargs = {"x": current_x, "handle": handle, "config": config, "async_finish": async_mode}
                        if previous_mode:
                            cargs["previous_event"] = buffer.capture()
                        cx, *nones, event = buffer.dispatch(**cargs)
                        assert nones == [None] * 4
                        event.current_stream_wait() if async_mode else ()
                        cx = per_token_cast_back(*cx) if isinstance(cx, tuple) else cx
                        if current_x is not x_pure_rand:
                            check_data(cx, rpm, rank, R)
                    cargs = {"x": recv_x, "handle": handle, "config": config, "async_finish": async_mode}
                    if with_topk:
                        cargs["topk_weights"] = recv_topk_weights
                    if previous_mode:
                        cargs["previous_event"] = buffer.capture()
                    combined_x, combined_w, event = buffer.combine(**cargs)
                    event.current_stream_wait() if async_mode else ()
                    sent = is_token_in_rank.sum(dim=1).unsqueeze(1)
                    check_x = combined_x.float() / sent.clamp(min=1)
                    ref_x = x_pure_rand if current_x is x_pure_rand else x
                    ref_x = torch.where(sent > 0, ref_x.float(), 0.0)
                    assert combined_x.shape == (T, H) and combined_x.dtype == torch.bfloat16
                    assert T == 0 or calc_diff(check_x, ref_x) < 5e-6
                    if with_topk and T:
                        check_w = combined_w if current_x is x_pure_rand else combined_w / sent.clamp(min=1)
                        ref_w = topk_weights_pure_rand if current_x is x_pure_rand else topk_weights
                        assert calc_diff(check_w, torch.where(sent > 0, ref_w, 0.0)) < 1e-9


def _zero_copy(buffer, comm) -> None:
    """Heap operands (the model runs in heap_scope) are read in place: nothing is staged."""
    import zbccl
    from zbccl.ep import reference

    E, T, H = 8, 32, 256
    with zbccl.heap_scope():
        x = torch.ones(T, H, dtype=torch.bfloat16) * comm.rank
        topk_idx = torch.topk(torch.randn(T, E), 3).indices
        w = torch.rand(T, 3)
        ntpr, _, ntpe, in_rank, _ = buffer.get_dispatch_layout(topk_idx, E)
    staged = zbccl.memory_stats()["staged_bytes"]
    recv_x, _, _, _, handle, _ = buffer.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=in_rank,
                                                 num_tokens_per_expert=ntpe, topk_idx=topk_idx, topk_weights=w)
    assert zbccl.is_heap_tensor(recv_x)
    assert buffer.bytes_moved == recv_x.size(0) * (H * 2 + 3 * 8 + 3 * 4)
    combined, _, _ = buffer.combine(recv_x, handle)
    assert buffer.bytes_moved == int(in_rank.sum()) * H * 2  # my tokens, back from every rank they went to
    assert zbccl.memory_stats()["staged_bytes"] == staged
    assert torch.equal(combined.float(), x.float() * in_rank.sum(1, keepdim=True))
    # bias and weights, against the plain-torch reference
    xr = torch.randn(T, H, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(comm.rank + 7))
    b0, b1 = torch.randn(T, H, dtype=torch.bfloat16), torch.ones(T, H, dtype=torch.bfloat16)
    rx, _, rw, _, handle, _ = buffer.dispatch(xr, num_tokens_per_rank=ntpr, is_token_in_rank=in_rank,
                                              num_tokens_per_expert=ntpe, topk_idx=topk_idx, topk_weights=w)
    got = buffer.combine(rx, handle, topk_weights=rw, bias=(b0, b1))[:2]
    # the plain-torch reference from every rank's routing (xr is rebuilt from its seed): bitwise
    in_ranks = _gather(in_rank.to(torch.uint8), comm)
    in_ranks = [m.bool() for m in in_ranks]
    xrs = [torch.randn(T, H, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(r + 7))
           for r in range(comm.world_size)]
    assert torch.equal(xrs[comm.rank], xr)
    idxs, ws = _gather(topk_idx, comm), _gather(w, comm)
    ys = [reference.dispatch(xrs, in_ranks, r, E, topk_idx=idxs, topk_weights=ws) for r in range(comm.world_size)]
    ref = reference.combine([y["x"] for y in ys], in_ranks, comm.rank, topk_weights=[y["topk_weights"] for y in ys],
                            bias=(b0, b1))
    expect = xr.float() * in_rank.sum(1, keepdim=True) + b0.float() + b1.float()
    assert (got[0].float() - expect).abs().max() <= 0.02 * expect.abs().max()
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert torch.allclose(got[1], w * in_rank.any(1, keepdim=True))
    # the int8 transfer option: about half the bytes, within int8's per-128 error
    torch.manual_seed(comm.rank)
    xr = torch.randn(T, H, dtype=torch.bfloat16)
    q, _, _, _, handle, _ = buffer.dispatch(xr, num_tokens_per_rank=ntpr, is_token_in_rank=in_rank,
                                            num_tokens_per_expert=ntpe, int8=True)
    exact, _, _, _, _, _ = buffer.dispatch(xr, handle=handle)
    assert q.dtype == torch.bfloat16 and q.shape == exact.shape
    assert (q.float() - exact.float()).abs().max() <= exact.float().abs().max() / 127 + 1e-2


def _uneven(buffer, comm) -> None:
    """Ranks with different token counts, one with none: counts, order and combine still exact."""
    R, me, E, H = comm.world_size, comm.rank, 8, 128
    T = 7 * me  # rank 0 sends nothing
    x = (torch.arange(T, dtype=torch.float32).unsqueeze(1) + 32 * me).expand(T, H).to(torch.bfloat16)
    topk_idx = torch.stack([torch.randperm(E)[:2] for _ in range(T)]) if T else torch.empty(0, 2, dtype=torch.int64)
    ntpr, _, ntpe, in_rank, _ = buffer.get_dispatch_layout(topk_idx, E)
    recv_x, _, _, _, handle, _ = buffer.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=in_rank,
                                                 num_tokens_per_expert=ntpe)
    all_in = torch.empty(sum(7 * r for r in range(R)) * R, dtype=torch.bool)
    sizes = [7 * r * R for r in range(R)]
    import zbccl

    zbccl.all_gather_v(all_in, in_rank.reshape(-1), sizes, comm=comm)
    expect, start = [], 0
    for r in range(R):
        block = all_in[start:start + sizes[r]].view(7 * r, R)
        start += sizes[r]
        expect += [32 * r + t for t in block[:, me].nonzero().flatten().tolist()]
    assert recv_x[:, 0].float().tolist() == [float(v) for v in expect]
    assert handle[3].tolist() == [v % 32 for v in expect]
    combined, _, _ = buffer.combine(recv_x, handle)
    assert torch.equal(combined.float(), x.float() * in_rank.sum(1, keepdim=True))


def _reused_outputs(buffer, comm) -> None:
    """Repeated same-size steps reuse the output blocks only once the caller dropped them: outputs still
    held keep their values (value = f(rank, token, step)) and the next step gets fresh blocks."""
    me, E, H, T = comm.rank, 8, 128, 12
    topk_idx = torch.stack([torch.randperm(E)[:2] for _ in range(T)])
    w = torch.rand(T, 2)

    def step(k: int):
        x = (torch.arange(T, dtype=torch.float32).unsqueeze(1) + 32 * k + 16 * me).expand(T, H).to(torch.bfloat16)
        ntpr, _, ntpe, in_rank, _ = buffer.get_dispatch_layout(topk_idx, E)
        rx, ri, rw, _, h, _ = buffer.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=in_rank,
                                              num_tokens_per_expert=ntpe, topk_idx=topk_idx, topk_weights=w)
        comb, cw, _ = buffer.combine(rx, h, topk_weights=rw)
        assert torch.equal(comb.float(), x.float() * in_rank.sum(1, keepdim=True))
        return rx, ri, rw, comb, h

    held = step(0)
    saved = [t.clone() for t in held[:4]]
    ptrs = {t.data_ptr() for t in held[:4]}
    step(1)  # its outputs are dropped on return ...
    again = step(2)  # ... so this step may reuse them, never the held ones
    assert not ptrs & {t.data_ptr() for t in again[:4]}
    for a, b in zip(held[:4], saved):
        assert torch.equal(a, b)
    assert torch.equal(again[0].float() - 64, held[0].float())  # all values exact in bf16 (< 128, sums < 256)
    # only the storages kept (torch keeps one Python object per storage, so the tensors' count misses them)
    del held, again
    kept = [t.untyped_storage() for t in step(3)[:4]]
    saved = [bytes(st) for st in kept]
    step(4)
    assert [bytes(st) for st in kept] == saved, "a block whose storage the caller still holds was reused"


def _worst_handle(buffer, comm) -> None:
    """A num_worst_tokens handle (DeepEP: num_worst rows in handle[3]) serves combine and cached dispatch;
    fp8 input with a hidden size that is not a multiple of 128 (scales of any width, as DeepEP)."""
    me, E, H = comm.rank, 8, 200
    T, worst = 5 + 3 * me, 64
    x = (torch.arange(T, dtype=torch.float32).unsqueeze(1) + 32 * me).expand(T, H).to(torch.bfloat16)
    topk_idx = torch.stack([torch.randperm(E)[:3] for _ in range(T)])
    w = torch.rand(T, 3)
    ntpr, _, ntpe, in_rank, _ = buffer.get_dispatch_layout(topk_idx, E)
    args = dict(num_tokens_per_rank=ntpr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe, topk_idx=topk_idx,
                topk_weights=w)
    recv_x, _, _, _, handle, _ = buffer.dispatch(x, **args)
    wx, _, _, lst, wh, _ = buffer.dispatch(x, num_worst_tokens=worst, **args)
    n = recv_x.size(0)
    assert lst == [] and wh[3].size(0) == worst and torch.equal(wh[3][:n], handle[3]) and bool((wh[3][n:] == -1).all())
    assert torch.equal(buffer.combine(wx, wh)[0], buffer.combine(recv_x, handle)[0])
    cx = buffer.dispatch(x, handle=wh)[0]
    assert cx.size(0) == worst and torch.equal(cx[:n], recv_x)
    xq = (x.to(torch.float8_e4m3fn), torch.ones(T, 2) * me)
    (rq, rs), *_ = buffer.dispatch(xq, handle=handle)
    assert torch.equal(rq.float(), recv_x.float().to(torch.float8_e4m3fn).float()) and rs.shape == (n, 2)
    assert torch.equal(rs[:, 0], recv_x[:, 0].float().div(32).floor())


def _same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, (a, b)
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
    elif isinstance(a, (tuple, list)):
        assert isinstance(b, (tuple, list)) and len(a) == len(b)
        for u, v in zip(a, b):
            _same(u, v)
    else:
        assert a == b, (a, b)


def _ref_inputs(r: int, R: int, E: int, H: int, K: int):
    """Rank r's ``(x, topk_idx, topk_weights)`` of :func:`_native_matches_reference` (rebuilt by every rank)."""
    g = torch.Generator().manual_seed(50 + r)
    T = 40 + 7 * r
    scores = torch.rand(T, E, generator=g)
    scores[torch.rand(T, generator=g) < 0.7, :K] += 10
    topk_idx = torch.topk(scores, K).indices
    topk_idx[torch.rand(T, K, generator=g) < 0.2] = -1
    return torch.randn(T, H, generator=g).to(torch.bfloat16), topk_idx, torch.rand(T, K, generator=g)


def _native_matches_reference(buffer, comm) -> None:
    """The native layout/plan/pull/sum (ep.c) give bit for bit what zbccl.ep.reference computes from every rank's
    inputs: scattered token lists (skewed routing, -1 entries), fp8 with scales, num_worst_tokens, alignment,
    cached, weights, bias, the whole handle; and a handle whose rows point outside a peer's block is refused,
    not read."""
    import zbccl
    from zbccl.ep import reference

    R, me, E, H, K = comm.world_size, comm.rank, 16, 256, 4
    ins = [_ref_inputs(r, R, E, H, K) for r in range(R)]
    x, topk_idx, w = ins[me]
    T = x.size(0)
    in_ranks = [reference.dispatch_layout(i, E, R)[2] for _, i, _ in ins]
    ntpr, _, ntpe, in_rank, _ = buffer.get_dispatch_layout(topk_idx, E)
    _same((ntpr, ntpe, in_rank), reference.dispatch_layout(topk_idx, E, R))
    kw = dict(num_tokens_per_rank=ntpr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe)
    worst = sum(40 + 7 * r for r in range(R)) + 3
    for extra in (dict(topk_idx=topk_idx, topk_weights=w, expert_alignment=4), dict(),
                  dict(topk_idx=topk_idx, topk_weights=w, num_worst_tokens=worst)):
        for fp8 in (True, False):  # a: the bf16 dispatch's results, used below
            xs = [per_token_cast_to_fp8(xi) if fp8 else xi for xi, _, _ in ins]
            a = buffer.dispatch(xs[me], **kw, **extra)[:5]
            topk = dict(topk_idx=[i for _, i, _ in ins], topk_weights=[wi for _, _, wi in ins]) if extra else {}
            want = reference.dispatch(xs, in_ranks, me, E, expert_alignment=extra.get("expert_alignment", 1),
                                      num_channels=a[4][1].size(1), **topk)
            n = int(want["rank_prefix_matrix"][-1, me])  # rows past it (num_worst_tokens) are undefined, as in DeepEP
            _same((a[0][0][:n], a[0][1][:n]) if fp8 else a[0][:n], want["x"])
            if extra:
                _same((a[1][:n], a[2][:n]), (want["topk_idx"], want["topk_weights"]))
                if "num_worst_tokens" in extra:
                    assert a[3] == [] and bool((a[1][n:] == -1).all()) and bool((a[2][n:] == 0).all())
                else:
                    assert a[3] == want["num_recv_tokens_per_expert_list"]
            handle = a[4]
            _same((handle[0], handle[1], handle[2], handle[3][:n], handle[4], handle[5]),
                  (want["rank_prefix_matrix"], want["channel_prefix_matrix"], want["recv_channel_prefix_matrix"],
                   want["src_idx"], in_rank, want["send_head"]))
        cached = buffer.dispatch(x, handle=a[4])[0]
        _same(cached[:n], reference.dispatch([xi for xi, _, _ in ins], in_ranks, me, E)["x"])
        if "num_worst_tokens" not in extra:
            # every rank combines twice what it received, with its weights and a bias of its own
            ys = [reference.dispatch([xi for xi, _, _ in ins], in_ranks, r, E, **topk) for r in range(R)]
            bias = torch.randn(T, H, generator=torch.Generator().manual_seed(90 + me)).to(torch.bfloat16)
            rw = a[2] if a[2] is not None else None
            got = buffer.combine(a[0] * 2, a[4], topk_weights=rw, bias=bias)[:2]
            ref = reference.combine([y["x"] * 2 for y in ys], in_ranks, me, bias=(bias,),
                                    topk_weights=[y["topk_weights"] for y in ys] if extra else None)
            _same(got[0], ref[0])
            _same(got[1], ref[1])
    # a handle whose rows point past a peer's block: refused by the native sum on that rank only
    rx, _, _, _, handle, _ = buffer.dispatch(x, **kw, topk_idx=topk_idx, topk_weights=w)
    bad = list(handle)
    if me == 0:
        bad[5] = torch.where(handle[5] >= 0, handle[5] + 10_000, handle[5])
    try:
        buffer.combine(rx, tuple(bad))
        assert me != 0 or not bool(in_rank.any()), "rank 0 read rows outside a peer's block"
    except zbccl.ZbcclInvalidUsageError as exc:
        assert me == 0 and "out of range" in str(exc), exc
    combined, _, _ = buffer.combine(rx, handle)  # the group is still in step
    assert torch.equal(combined, (x.float() * in_rank.sum(1, keepdim=True)).to(torch.bfloat16))


def _normal_world(ctx, cases):
    import zbccl
    import zbccl.ep as deep_ep

    torch.set_num_threads(1)  # 2+ ranks per core here: torch's thread pool would stall on oversubscription
    comm = ctx.init(heap_size=64 * MiB)
    buffer = deep_ep.Buffer(comm, int(2e9), 0, low_latency_mode=False, num_qps_per_rank=1, explicitly_destroy=True,
                            allow_mnnvl=False, use_fabric=False)
    for kw in cases:
        _intranode(buffer, comm, **kw)
    _zero_copy(buffer, comm)
    _uneven(buffer, comm)
    _reused_outputs(buffer, comm)
    _worst_handle(buffer, comm)
    _native_matches_reference(buffer, comm)
    buffer.destroy()
    zbccl.finalize()
    return True


def test_intranode_world2():
    cases = [dict(T=64, H=256, K=4, E=8), dict(T=48, H=128, K=3, E=16, skew=True, seed=3), dict(T=0, H=128, K=2, E=4)]
    assert all(run_world(_normal_world, 2, cases=cases, timeout=120))


@pytest.mark.slow
def test_intranode_world4():
    assert all(run_world(_normal_world, 4, cases=[dict(T=40, H=256, K=4, E=16, skew=True)], timeout=120))


def _gloo_group(ctx):
    """DeepEP's setup: a torch process group (gloo here) and Buffer(group); zbccl starts from its store."""
    import torch.distributed as dist

    import zbccl
    import zbccl.ep as deep_ep

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=ctx.store(), rank=ctx.rank, world_size=ctx.world_size)
    group = dist.new_group(list(range(ctx.world_size)))
    buffer = deep_ep.Buffer(group, int(1e8), 0, low_latency_mode=False, num_qps_per_rank=1, explicitly_destroy=True)
    assert buffer.rank == dist.get_rank(group) and buffer.group_size == group.size() and buffer.group is group
    comm = zbccl.get_default()
    _intranode(buffer, comm, T=24, H=128, K=2, E=4)
    buffer.destroy()
    zbccl.finalize()
    dist.destroy_process_group()
    return True


def test_buffer_on_a_gloo_process_group():
    assert all(run_world(_gloo_group, 2, timeout=120))


def _gloo_subgroups(ctx):
    """Buffers on torch sub-groups of a gloo world (the TP x EP layout). zbccl started from a pair's group
    cannot serve a group across pairs: every rank is told so (it used to run on the wrong peers, silently).
    Started over torch's world, it serves any group, each rank in its group's place."""
    import torch.distributed as dist

    import zbccl
    import zbccl.ep as deep_ep

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=ctx.store(), rank=ctx.rank, world_size=ctx.world_size)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    strided = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    pair, across = pairs[ctx.rank // 2], strided[ctx.rank % 2]
    buffer = deep_ep.Buffer(pair, int(1e7), explicitly_destroy=True)  # starts zbccl over this pair only
    _intranode(buffer, buffer.comm, T=12, H=128, K=2, E=4, seed=1)
    buffer.destroy()
    with pytest.raises(zbccl.ZbcclInvalidUsageError, match=r"cannot map the ProcessGroup's ranks \[\d, \d\]"):
        deep_ep.Buffer(across, int(1e7), explicitly_destroy=True)
    zbccl.finalize()
    zbccl.init(group=dist.group.WORLD, heap_size=64 * MiB)
    for group in (across, pair):
        buffer = deep_ep.Buffer(group, int(1e7), explicitly_destroy=True)
        assert buffer.rank == dist.get_rank(group) and buffer.comm.ranks == tuple(dist.get_process_group_ranks(group))
        _intranode(buffer, buffer.comm, T=12, H=128, K=2, E=4, seed=2)
        buffer.destroy()
    zbccl.finalize()
    dist.destroy_process_group()
    return True


def test_buffers_on_torch_subgroups_map_their_ranks():
    assert all(run_world(_gloo_subgroups, 4, timeout=180))
