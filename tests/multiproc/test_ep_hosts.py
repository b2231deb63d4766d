"""zbccl.ep across hosts (DeepEP's internode mode) against the plain-torch reference.

Hosts are made by ``ZBCCL_HOST_ID`` (no root: the routed transport runs shm within a "host" and Mooncake
over loopback between them) at 2 x 1 and 2 x 2 ranks, and one case runs over namespace hosts
(``tests/hosts.py``, root) at 2 x 2. Every rank rebuilds every rank's inputs from a seed, as payloads that
encode their source, so :mod:`zbccl.ep.reference` gives it the whole expected result. Skips without Mooncake.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from tests.multiproc.ep_checks import per_token_cast_back
from tests.multiproc.test_ep_random import _case, _equal, _inputs, _rows
from tests.spawn import run_world

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _needs_mooncake():
    from zbccl.heap.transports.mooncake import missing_reason

    reason = missing_reason()
    if reason:
        pytest.skip(reason)


def _start(ctx, ranks_per_host: int, fake: bool = True):
    """zbccl over hosts of ``ranks_per_host`` ranks (by ZBCCL_HOST_ID when ``fake``), and a spanning Buffer."""
    import zbccl.ep as deep_ep

    if fake:
        os.environ["ZBCCL_HOST_ID"] = f"ep-host-{ctx.rank // ranks_per_host}"
    torch.set_num_threads(1)
    comm = ctx.init(heap_size=64 * MiB)
    buffer = deep_ep.Buffer(comm, num_rdma_bytes=1 << 20, explicitly_destroy=True)
    assert buffer.wire is not None and buffer.wire.H == comm.world_size // ranks_per_host
    return comm, buffer


def _hosts_of(R: int, per: int) -> list[list[int]]:
    return [list(range(h * per, (h + 1) * per)) for h in range(R // per)]


def _integer_inputs(seed: int, r: int, T: int, H: int, E: int, K: int):
    """Rank r's ``(x bf16, topk_idx, topk_weights)``: x[t] = small integers f(r, t) (exact sums in any order)."""
    g = torch.Generator().manual_seed(seed * 7919 + r)
    idx = torch.topk(torch.rand(T, E, generator=g), K, dim=-1).indices
    if T:
        idx[0, -1] = -1  # one slot with no expert
    x = ((torch.arange(H).view(1, H) + 3 * torch.arange(T).view(T, 1) + 17 * r) % 13 - 6).to(torch.bfloat16)
    return x, idx, torch.rand(T, K, generator=g) + 0.5


def _crossing_bytes(in_ranks: list, hosts: list, me: int, per: int, row: int) -> int:
    """Bytes forwarded to ``me``: for each remote sender whose forwarder on my host I am, its tokens bound for
    any rank of my host (once each, however many of my host's ranks they go to)."""
    host_of = {r: h for h, rs in enumerate(hosts) for r in rs}
    mine = hosts[host_of[me]]
    total = 0
    for s, in_rank in enumerate(in_ranks):
        if host_of[s] == host_of[me] or mine[(s % per) % len(mine)] != me:
            continue
        total += int(in_rank[:, mine].any(1).sum()) * row
    return total


def _exact_and_bytes(buffer, comm, per: int, seed: int) -> dict:
    """Integer payloads: dispatch, cached dispatch and combine are exact; each token crosses to a host once."""
    from zbccl.ep import reference

    R, me, E, K, H = comm.world_size, comm.rank, 4 * comm.world_size, 3, 256
    Ts = [(seed * 5 + r * 11) % 40 + (0 if r == 1 else 8) for r in range(R)]
    if seed % 2:
        Ts[1] = 0  # an empty sender
    ins = [_integer_inputs(seed, r, Ts[r], H, E, K) for r in range(R)]
    x, idx, w = ins[me]
    in_ranks = [reference.dispatch_layout(i, E, R)[2] for _, i, _ in ins]
    hosts = _hosts_of(R, per)
    ntpr, ntprdma, ntpe, in_rank, _ = buffer.get_dispatch_layout(idx, E)
    assert ntprdma.tolist() == [int(in_rank[:, h].any(1).sum()) for h in hosts]
    mc = comm._ctx.heap.transport.remote
    got0 = mc.bytes_got
    recv_x, recv_idx, recv_w, lst, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=ntpr, num_tokens_per_rdma_rank=ntprdma, is_token_in_rank=in_rank,
        num_tokens_per_expert=ntpe, topk_idx=idx, topk_weights=w)
    crossed = mc.bytes_got - got0
    row = -(-(16 + 12 * K + 2 * H) // 8) * 8
    assert crossed == _crossing_bytes(in_ranks, hosts, me, per, row), (crossed, me)
    assert buffer.memory_stats()["rdma_recv_bytes"] == crossed
    want = reference.dispatch([i[0] for i in ins], in_ranks, me, E, topk_idx=[i[1] for i in ins],
                              topk_weights=[i[2] for i in ins])
    assert torch.equal(recv_x, want["x"]) and torch.equal(recv_idx, want["topk_idx"])
    assert torch.equal(recv_w, want["topk_weights"]) and lst == want["num_recv_tokens_per_expert_list"]
    assert torch.equal(handle[6], want["rank_prefix_matrix"][:, me]) and torch.equal(handle[7], want["src_idx"])
    assert torch.equal(buffer.dispatch(x, handle=handle)[0], recv_x)
    ys = [reference.dispatch([i[0] for i in ins], in_ranks, r, E)["x"] for r in range(R)]
    wts = [reference.dispatch([i[0] for i in ins], in_ranks, r, E, topk_idx=[i[1] for i in ins],
                              topk_weights=[i[2] for i in ins])["topk_weights"] for r in range(R)]
    bias = torch.ones(Ts[me], H, dtype=torch.bfloat16)
    combined, cw, _ = buffer.combine(recv_x, handle, topk_weights=recv_w, bias=bias)
    expect, expect_w = reference.combine(ys, in_ranks, me, topk_weights=wts, bias=(bias,))
    assert torch.equal(combined, expect) and torch.allclose(cw, expect_w, rtol=1e-6, atol=1e-6)
    # what a naive all-to-all would send across: a token once per remote destination rank
    naive = sum(int(in_ranks[s][:, r].sum()) * row for s in range(R) for r in range(R)
                if (s // per) != (r // per) and r == me)
    return {"crossed": crossed, "naive": naive}


def _random_case(buffer, comm, case: dict) -> None:
    """test_ep_random's case across hosts: exact dispatch; combine within fp32/bf16 rounding of the host-first sum."""
    from zbccl.ep import reference

    R, me, E = comm.world_size, comm.rank, case["E"]
    ins = [_inputs(case, r, R) for r in range(R)]
    x, idx, w = ins[me]
    in_ranks = [reference.dispatch_layout(i, E, R)[2] for _, i, _ in ins]
    want = reference.dispatch([xi for xi, _, _ in ins], in_ranks, me, E, topk_idx=[i for _, i, _ in ins],
                              topk_weights=[wi for _, _, wi in ins], expert_alignment=case["align"])
    ntpr, _, ntpe, in_rank, _ = buffer.get_dispatch_layout(idx, E)
    n = int(want["rank_prefix_matrix"][-1, me])
    worst = sum(case["T"]) if case["worst"] else 0
    recv_x, recv_idx, recv_w, lst, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=ntpr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe, topk_idx=idx,
        topk_weights=w, expert_alignment=case["align"], num_worst_tokens=worst)
    where = f"case {case}, rank {me}"
    assert _equal(_rows(recv_x, n), want["x"]), f"received rows differ: {where}"
    assert torch.equal(recv_idx[:n], want["topk_idx"]) and torch.equal(recv_w[:n], want["topk_weights"]), where
    assert torch.equal(handle[6], want["rank_prefix_matrix"][:, me]) and torch.equal(handle[7][:n], want["src_idx"])
    if worst:
        assert lst == [] and recv_idx.size(0) == worst and bool((recv_idx[n:] == -1).all()), where
    else:
        assert lst == want["num_recv_tokens_per_expert_list"], where
        assert _equal(buffer.dispatch(x, handle=handle)[0], recv_x), f"cached dispatch differs: {where}"

    def back(r):
        got = reference.dispatch([xi for xi, _, _ in ins], in_ranks, r, E)["x"]
        return per_token_cast_back(got[0], got[1].contiguous()) if isinstance(got, tuple) else got

    mine = back(me)
    if worst:
        mine = torch.cat([mine, torch.zeros(worst - n, mine.size(1), dtype=mine.dtype)])
    combined, _, _ = buffer.combine(mine, handle)
    expect, _ = reference.combine([back(r) for r in range(R)], in_ranks, me)
    assert torch.allclose(combined.float(), expect.float(), rtol=2e-2, atol=2e-2), f"combine differs: {where}"


def _normal(ctx, per: int, seeds):
    import zbccl

    comm, buffer = _start(ctx, per)
    out = [_exact_and_bytes(buffer, comm, per, s) for s in range(3)]
    for seed in seeds:
        _random_case(buffer, comm, _case(seed, comm.world_size))
    buffer.destroy()
    zbccl.finalize()
    return out


def test_normal_2x1():
    out = run_world(_normal, 2, per=1, seeds=range(40), timeout=240)
    assert all(o["crossed"] == o["naive"] for r in out for o in r)  # one rank per host: nothing to merge


def test_normal_2x2_each_token_crosses_to_a_host_once():
    out = run_world(_normal, 4, per=2, seeds=range(500, 512), timeout=240)
    crossed = sum(o["crossed"] for r in out for o in r)
    naive = sum(o["naive"] for r in out for o in r)
    assert 0 < crossed < naive, (crossed, naive)
