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


def _inputs(rank: int):
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
