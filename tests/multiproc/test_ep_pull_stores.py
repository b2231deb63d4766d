"""EP dispatch pulls with cached and streaming stores: the same rows, bit for bit, and ``auto`` samples both.

The pull is large enough (>= ``ep.stores.MIN_BYTES`` per rank) for the policy to measure it; rows
encode (source rank, token), so a row written to the wrong place or half-written is caught.
"""

from __future__ import annotations

import torch

from tests.spawn import run_world

MiB = 1 << 20
T, H, K, E = 128, 1024, 2, 8  # 256 KiB of bf16 rows per rank, ~512 KiB received


def _x(rank: int) -> torch.Tensor:
    rows = torch.arange(T, dtype=torch.float32).unsqueeze(1) * 4 + rank
    return (rows + torch.arange(H, dtype=torch.float32) % 7).to(torch.bfloat16)


def _topk(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])


def _pulls(ctx):
    import zbccl
    import zbccl.ep as deep_ep

    torch.set_num_threads(1)
    comm = ctx.init(heap_size=64 * MiB)
    buffer = deep_ep.Buffer(comm, timeout=60, explicitly_destroy=True)
    with zbccl.heap_scope():
        x = _x(comm.rank).clone()
    topk = _topk(comm.rank)
    ntpr, _, ntpe, in_rank, _ = buffer.get_dispatch_layout(topk, E)
    got = {}
    for mode in (0, 1, -1, -1, -1):
        buffer.ex.stores.mode = mode
        recv_x, _, _, _, handle, _ = buffer.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=in_rank,
                                                     num_tokens_per_expert=ntpe)
        got.setdefault(mode, []).append(recv_x.clone())
        combined, _, _ = buffer.combine(recv_x, handle)
        # each token comes back once per rank that received it: x times that count, exactly in bf16 here
        times = in_rank.sum(1, keepdim=True).to(torch.float32)
        assert torch.equal(combined.float(), x.float() * times), f"mode {mode}: combine differs"
    # the reference: every rank's rows for this rank, by source rank then token (DeepEP's order)
    mine = [(r, t) for r in range(comm.world_size) for t in range(T)
            if bool((_topk(r)[t] // (E // comm.world_size) == comm.rank).any())]
    ref = torch.stack([_x(r)[t] for r, t in mine])
    for mode, outs in got.items():
        for out in outs:
            assert torch.equal(out, ref), f"mode {mode}: received rows differ from the reference"
    rates = buffer.ex.stores.rates()
    buffer.destroy()
    zbccl.finalize()
    return rates


def test_cached_and_streaming_pulls_are_bit_exact_and_auto_samples_both():
    for rates in run_world(_pulls, 2, timeout=120):
        assert rates["cached"] is not None and rates["streaming"] is not None, rates
