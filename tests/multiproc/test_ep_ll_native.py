"""The low-latency combine's native weighted sum (``ep_ll_combine``) equals the torch path bit for bit.

Random weights, routing with unselected slots (-1) and an expert that most tokens pick; the same
dispatch is combined once natively and once with the core's ``ep_ll_combine`` hidden (the torch
``index_select``/``mul_``/``index_add_`` reference), and both against a plain fp32 reference.
"""

from __future__ import annotations

import types

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


def _combine_both(ctx):
    import zbccl
    import zbccl.ep as deep_ep

    torch.set_num_threads(1)
    comm = ctx.init(heap_size=64 * MiB)
    buffer = deep_ep.Buffer(comm, timeout=60, explicitly_destroy=True, low_latency_mode=True)
    x, idx, w = _inputs(comm.rank)
    prims = buffer.ex.prims
    assert getattr(prims, "ep_ll_combine", None) is not None
    outs = []
    for native in (False, True):
        recv_x, count, handle, _, _ = buffer.low_latency_dispatch(x, idx, T, E, use_fp8=False)
        y = (recv_x.float() * 0.5 + 1).to(torch.bfloat16)  # the "experts"
        buffer.ex.prims = prims if native else types.SimpleNamespace(
            **{k: getattr(prims, k) for k in dir(prims) if not k.startswith("_") and k != "ep_ll_combine"})
        outs.append(buffer.low_latency_combine(y, idx, w, handle)[0].clone())
        buffer.ex.prims = prims
    assert torch.equal(outs[0], outs[1]), "native and torch low-latency combines differ"
    # plain reference: each selected expert returns 0.5 * x + 1 of the token (the dispatch sent bf16 x as is)
    ref = torch.zeros(T, H)
    xe = (x.float() * 0.5 + 1).to(torch.bfloat16).float()
    for k in range(K):
        sel = idx[:, k] >= 0
        ref[sel] += xe[sel] * w[sel, k:k + 1]
    assert torch.allclose(outs[0].float(), ref, rtol=1e-2, atol=1e-2)
    buffer.destroy()
    zbccl.finalize()
    return True


def test_native_low_latency_combine_is_bitwise_the_torch_one():
    assert all(run_world(_combine_both, 2, timeout=120))


def _hide(prims, *names):
    return types.SimpleNamespace(**{k: getattr(prims, k) for k in dir(prims) if not k.startswith("_") and k not in names})


def _dispatch_both(ctx):
    """The native plan, receive half and combine addresses (``ep_ll_plan``, ``ep_ll_pull``, ``ep_ll_addrs``)
    against the torch path: the same received rows, counts, src_info, layout, fp8 scales (both scale
    layouts) and combine (which reads the rows at the begins the pull returned), with a rank masked in
    the last case."""
    import zbccl
    import zbccl.ep as deep_ep

    torch.set_num_threads(1)
    comm = ctx.init(heap_size=64 * MiB)
    R = comm.world_size
    buffer = deep_ep.Buffer(comm, timeout=60, explicitly_destroy=True, low_latency_mode=True, enable_shrink=True)
    n_exp = 4 * R  # a multiple of the ranks
    x, idx, w = _inputs(comm.rank, n_exp)
    x = x.repeat(1, 4)  # H = 1024: two scales per row with ue8m0's 512-channel groups
    prims = buffer.ex.prims
    assert getattr(prims, "ep_ll_pull", None) is not None and getattr(prims, "ep_ll_plan", None) is not None
    cases = [dict(use_fp8=False), dict(use_fp8=True), dict(use_fp8=True, round_scale=True, use_ue8m0=True),
             dict(use_fp8=True, mask=True)]
    for kw in cases:
        mask = kw.pop("mask", False)
        if mask:
            buffer.low_latency_update_mask_buffer(R - 1, True)
        got = []
        for native in (True, False):
            buffer.ex.prims = prims if native else _hide(prims, "ep_ll_pull", "ep_ll_plan", "ep_ll_addrs")
            recv_x, count, handle, _, _ = buffer.low_latency_dispatch(x, idx, T + 3, n_exp, **kw)
            y, scales = recv_x if kw["use_fp8"] else (recv_x, None)
            comb = buffer.low_latency_combine((y.float() * 0.5 + 1).to(torch.bfloat16), idx, w, handle)[0].clone()
            src_info, layout = handle[0], handle[1]
            valid = torch.arange(src_info.size(1)).unsqueeze(0) < count.unsqueeze(1)  # [L, N]: the filled slots
            parts = [y.view(torch.uint8)[valid], count, src_info[valid], layout, comb]
            if scales is not None:
                parts.append(scales[valid].contiguous().view(torch.int32))
            parts = [p.clone() for p in parts]
            got.append(parts)
            buffer.ex.prims = prims
        for i, (a, b) in enumerate(zip(*got)):
            assert torch.equal(a, b), f"{kw} mask={mask}: output {i} differs between the native and torch pulls"
    buffer.low_latency_clean_mask_buffer()
    buffer.destroy()
    zbccl.finalize()
    return True


def test_native_low_latency_dispatch_is_the_torch_one():
    assert all(run_world(_dispatch_both, 2, timeout=120))


def test_native_low_latency_dispatch_is_the_torch_one_world3():
    assert all(run_world(_dispatch_both, 3, timeout=180))
