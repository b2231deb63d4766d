"""zbccl.ep normal mode against a plain-torch reference, on randomised cases.

Each case draws, from its seed, every rank's token count (0 included), the hidden size, experts,
top-k, routing (uniform, one hot expert, one hot rank, masked slots), dtype (bf16, fp32, fp8 pairs),
``expert_alignment`` and ``num_worst_tokens``. Every rank rebuilds every rank's inputs from the seed,
so :mod:`zbccl.ep.reference` gives it the whole expected result: the rows it must receive (by source
rank, then token), their local top-k ids and weights, the aligned per-expert list, the handle's prefix
matrix and source tokens, the combine (fp32, in rank order: bitwise), and a cached re-dispatch.
"""

from __future__ import annotations

import random

import torch

from tests.multiproc.ep_checks import per_token_cast_back, per_token_cast_to_fp8
from tests.spawn import run_world

MiB = 1 << 20


def _case(seed: int, R: int) -> dict:
    g = random.Random(seed)
    E = R * g.choice([1, 2, 3, 4])
    return {"seed": seed, "T": [g.choice([0, 1, 7, 33, 64]) for _ in range(R)], "H": g.choice([128, 384]),
            "E": E, "K": g.randint(1, min(E, 6)), "route": g.choice(["uniform", "hot_expert", "hot_rank", "masked"]),
            "dtype": g.choice(["bf16", "fp32", "fp8"]), "align": g.choice([1, 4]), "worst": g.random() < 0.3}


def _inputs(case: dict, r: int, R: int):
    """Rank r's ``(x, topk_idx, topk_weights)`` for ``case`` (the same on every rank)."""
    T, H, E, K = case["T"][r], case["H"], case["E"], case["K"]
    g = torch.Generator().manual_seed(case["seed"] * 1009 + r)
    scores = torch.rand(T, E, generator=g)
    if case["route"] == "hot_expert":
        scores[:, 0] += 2
    elif case["route"] == "hot_rank":
        scores[:, (R - 1) * (E // R):] += 2
    idx = torch.topk(scores, K, dim=-1).indices
    if case["route"] == "masked" and T:
        idx = idx.masked_fill(torch.rand(T, K, generator=g) < 0.3, -1)
        idx[0] = -1  # a token sent nowhere
    w = torch.rand(T, K, generator=g) + 0.5
    x = torch.randn(T, H, generator=g)
    if case["dtype"] == "fp8":
        q, s = per_token_cast_to_fp8(x.to(torch.bfloat16))
        return (q, s.T.contiguous().T), idx, w  # column-major scales, as DeepEP's test
    return x.to(torch.bfloat16 if case["dtype"] == "bf16" else torch.float32), idx, w


def _equal(a, b) -> bool:
    if isinstance(a, tuple):
        return torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1].float(), b[1].float())
    return torch.equal(a, b)


def _rows(x, n: int):
    return (x[0][:n], x[1][:n]) if isinstance(x, tuple) else x[:n]


def _check_case(buffer, comm, case: dict) -> None:
    from zbccl.ep import reference

    R, me, E = comm.world_size, comm.rank, case["E"]
    ins = [_inputs(case, r, R) for r in range(R)]
    x, idx, w = ins[me]
    in_ranks = [reference.dispatch_layout(i, E, R)[2] for _, i, _ in ins]
    want = reference.dispatch([xi for xi, _, _ in ins], in_ranks, me, E, topk_idx=[i for _, i, _ in ins],
                              topk_weights=[wi for _, _, wi in ins], expert_alignment=case["align"])
    ntpr, _, ntpe, in_rank, _ = buffer.get_dispatch_layout(idx, E)
    assert torch.equal(in_rank, in_ranks[me])
    n = int(want["rank_prefix_matrix"][-1, me])
    worst = sum(case["T"]) if case["worst"] else 0
    recv_x, recv_idx, recv_w, lst, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=ntpr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe, topk_idx=idx,
        topk_weights=w, expert_alignment=case["align"], num_worst_tokens=worst)
    where = f"case {case}, rank {me}"
    got_x = _rows(recv_x, n)
    assert _equal(got_x, want["x"]), f"received rows differ: {where}"
    assert torch.equal(recv_idx[:n], want["topk_idx"]) and torch.equal(recv_w[:n], want["topk_weights"]), \
        f"top-k differ: {where}"
    assert torch.equal(handle[0], want["rank_prefix_matrix"]) and torch.equal(handle[3][:n], want["src_idx"]), where
    if worst:
        assert lst == [] and recv_idx.size(0) == worst and bool((recv_idx[n:] == -1).all()), where
    else:
        assert lst == want["num_recv_tokens_per_expert_list"], f"per-expert list {lst}: {where}"
        again = buffer.dispatch(x, handle=handle)[0]
        assert _equal(again, recv_x), f"cached dispatch differs: {where}"
    # combine the received rows (identity experts): every rank's combine input is what it received
    def back(r):
        got = reference.dispatch([xi for xi, _, _ in ins], in_ranks, r, E)["x"]
        return per_token_cast_back(got[0], got[1].contiguous()) if isinstance(got, tuple) else got

    mine = back(me)
    if worst:
        mine = torch.cat([mine, torch.zeros(worst - n, mine.size(1), dtype=mine.dtype)])
    combined, _, _ = buffer.combine(mine, handle)
    expect, _ = reference.combine([back(r) for r in range(R)], in_ranks, me)
    assert torch.equal(combined, expect), f"combine differs: {where}"


def _random_cases(ctx, seeds):
    import zbccl
    import zbccl.ep as deep_ep

    torch.set_num_threads(1)
    comm = ctx.init(heap_size=64 * MiB)
    buffer = deep_ep.Buffer(comm, explicitly_destroy=True)
    for seed in seeds:
        _check_case(buffer, comm, _case(seed, comm.world_size))
    buffer.destroy()
    zbccl.finalize()
    return True


def test_random_cases_world2():
    assert all(run_world(_random_cases, 2, seeds=range(150), timeout=240))


def test_random_cases_world3():
    assert all(run_world(_random_cases, 3, seeds=range(1000, 1060), timeout=240))


def test_random_cases_world4_oversubscribed():
    assert all(run_world(_random_cases, 4, seeds=range(2000, 2020), timeout=240))
