"""zbccl.ep low-latency mode on the native kernels against the plain-torch reference (``zbccl.ep.reference``).

Every rank rebuilds every rank's inputs from their seeds, so the reference gives it exactly what it must
receive (rows, counts, src_info, layout, fp8 scales in both scale layouts, with a rank masked in one case)
and what its combine must sum (ascending expert order, fp32): compared bit for bit. Routing has unselected
slots (-1) and an expert that most tokens pick; the combine is also checked against a plain fp32 sum.
"""

from __future__ import annotations

import torch

from tests.spawn import run_world

MiB = 1 << 20
T, H, K, E = 24, 256, 4, 8


def _inputs(rank: int, E: int = E):
    g = torch.Generator().manual_seed(100 + rank)
    x = (torch.randn(T, H, generator=g) * (rank + 1)).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    no_one = ~(idx == 1).any(1)
    idx[no_one, 0] = 1  # every token picks expert 1 (skew), once
    idx[::5, 2] = -1  # some slots pick nothing
    w = torch.rand(T, K, generator=g)
    return x, idx, w


def _combine_matches(ctx):
    import zbccl
    import zbccl.ep as deep_ep
    from zbccl.ep import reference

    torch.set_num_threads(1)
    comm = ctx.init(heap_size=64 * MiB)
    R, me = comm.world_size, comm.rank
    buffer = deep_ep.Buffer(comm, timeout=60, explicitly_destroy=True, low_latency_mode=True)
    ins = [_inputs(r) for r in range(R)]
    x, idx, w = ins[me]
    recv_x, count, handle, _, _ = buffer.low_latency_dispatch(x, idx, T, E, use_fp8=False)
    y = (recv_x.float() * 0.5 + 1).to(torch.bfloat16)  # the "experts"
    got = buffer.low_latency_combine(y, idx, w, handle)[0].clone()
    outs = [(reference.low_latency_dispatch([xi for xi, _, _ in ins], [i for _, i, _ in ins], o, T, E)["x"].float()
             * 0.5 + 1).to(torch.bfloat16) for o in range(R)]
    ref = reference.low_latency_combine(outs, [i for _, i, _ in ins], me, w)
    assert torch.equal(got, ref), "the native low-latency combine differs from the reference"
    # plain fp32 check: each selected expert returns 0.5 * x + 1 of the token (the dispatch sent bf16 x as is)
    plain = torch.zeros(T, H)
    xe = (x.float() * 0.5 + 1).to(torch.bfloat16).float()
    for k in range(K):
        sel = idx[:, k] >= 0
        plain[sel] += xe[sel] * w[sel, k:k + 1]
    assert torch.allclose(got.float(), plain, rtol=1e-2, atol=1e-2)
    buffer.destroy()
    zbccl.finalize()
    return True


def test_native_low_latency_combine_is_bitwise_the_reference():
    assert all(run_world(_combine_matches, 2, timeout=120))


def _dispatch_matches(ctx):
    """The native plan, receive half and combine addresses (``ep_ll_plan``, ``ep_ll_pull``, ``ep_ll_addrs``)
    against the reference: the same received rows, counts, src_info, layout, fp8 scales (both scale
    layouts) and combine (which reads the rows at the begins the pull returned), with a rank masked in
    the last case."""
    import zbccl
    import zbccl.ep as deep_ep
    from zbccl.ep import reference

    torch.set_num_threads(1)
    comm = ctx.init(heap_size=64 * MiB)
    R, me = comm.world_size, comm.rank
    buffer = deep_ep.Buffer(comm, timeout=60, explicitly_destroy=True, low_latency_mode=True, enable_shrink=True)
    n_exp = 4 * R  # a multiple of the ranks
    ins = [_inputs(r, n_exp) for r in range(R)]
    xs = [xi.repeat(1, 4) for xi, _, _ in ins]  # H = 1024: two scales per row with ue8m0's 512-channel groups
    idxs = [i for _, i, _ in ins]
    x, idx, w = xs[me], idxs[me], ins[me][2]
    cases = [dict(use_fp8=False), dict(use_fp8=True), dict(use_fp8=True, round_scale=True, use_ue8m0=True),
             dict(use_fp8=True, mask=True)]
    for kw in cases:
        mask = kw.pop("mask", False)
        masks = None
        if mask:
            buffer.low_latency_update_mask_buffer(R - 1, True)
            masks = [1 << (R - 1)] * R  # every rank masks rank R - 1
        recv_x, count, handle, _, _ = buffer.low_latency_dispatch(x, idx, T + 3, n_exp, **kw)
        y, scales = recv_x if kw["use_fp8"] else (recv_x, None)
        expert = (y.float() * 0.5 + 1).to(torch.bfloat16)
        comb = buffer.low_latency_combine(expert, idx, w, handle)[0].clone()
        want = [reference.low_latency_dispatch(xs, idxs, o, T + 3, n_exp, masks=masks, **kw) for o in range(R)]
        mine = want[me]
        src_info, layout = handle[0], handle[1]
        valid = torch.arange(src_info.size(1)).unsqueeze(0) < count.unsqueeze(1)  # [L, N]: the filled slots
        where = f"{kw} mask={mask}"
        assert torch.equal(count, mine["count"]), where
        assert torch.equal(y.view(torch.uint8)[valid], mine["x"].view(torch.uint8)[valid]), f"rows differ: {where}"
        assert torch.equal(src_info[valid], mine["src_info"][valid]) and torch.equal(layout, mine["layout_range"]), where
        if scales is not None:
            assert torch.equal(scales[valid], mine["scales"][valid]), f"scales differ: {where}"
        outs = [(o["x"].float() * 0.5 + 1).to(torch.bfloat16) for o in want]  # every owner's "experts"
        ref = reference.low_latency_combine(outs, idxs, me, w, masks=masks)
        assert torch.equal(comb, ref), f"combine differs: {where}"
    buffer.low_latency_clean_mask_buffer()
    buffer.destroy()
    zbccl.finalize()
    return True


def test_native_low_latency_dispatch_is_the_reference():
    assert all(run_world(_dispatch_matches, 2, timeout=120))


def test_native_low_latency_dispatch_is_the_reference_world3():
    assert all(run_world(_dispatch_matches, 3, timeout=180))
