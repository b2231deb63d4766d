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


HOSTS_2X2 = [[0, 1], [2, 3]]


def _init(ctx, hosts: list[list[int]], fake: bool = True):
    """zbccl over ``hosts`` (the ranks of each host; made by ZBCCL_HOST_ID when ``fake``)."""
    if fake:
        os.environ["ZBCCL_HOST_ID"] = f"ep-host-{next(h for h, rs in enumerate(hosts) if ctx.rank in rs)}"
    torch.set_num_threads(1)
    return ctx.init(heap_size=64 * MiB)


def _start(ctx, hosts: list[list[int]], fake: bool = True):
    """zbccl over ``hosts`` and a Buffer spanning them."""
    import zbccl.ep as deep_ep

    comm = _init(ctx, hosts, fake)
    buffer = deep_ep.Buffer(comm, num_rdma_bytes=1 << 20, explicitly_destroy=True)
    assert buffer.wire is not None and buffer.wire.hosts == hosts
    return comm, buffer


def _integer_inputs(seed: int, r: int, T: int, H: int, E: int, K: int):
    """Rank r's ``(x bf16, topk_idx, topk_weights)``: x[t] = small integers f(r, t) (exact sums in any order)."""
    g = torch.Generator().manual_seed(seed * 7919 + r)
    idx = torch.topk(torch.rand(T, E, generator=g), K, dim=-1).indices
    if T:
        idx[0, -1] = -1  # one slot with no expert
    x = ((torch.arange(H).view(1, H) + 3 * torch.arange(T).view(T, 1) + 17 * r) % 13 - 6).to(torch.bfloat16)
    return x, idx, torch.rand(T, K, generator=g) + 0.5


def _crossing_bytes(in_ranks: list, hosts: list, me: int, row: int) -> int:
    """Bytes forwarded to ``me``: for each remote sender whose forwarder on my host I am, its tokens bound for
    any rank of my host (once each, however many of my host's ranks they go to)."""
    host_of = {r: h for h, rs in enumerate(hosts) for r in rs}
    mine = hosts[host_of[me]]
    total = 0
    for s, in_rank in enumerate(in_ranks):
        if host_of[s] == host_of[me] or mine[hosts[host_of[s]].index(s) % len(mine)] != me:
            continue
        total += int(in_rank[:, mine].any(1).sum()) * row
    return total


def _exact_and_bytes(buffer, comm, hosts: list[list[int]], seed: int) -> dict:
    """Integer payloads: dispatch, cached dispatch and combine are exact; each token crosses to a host once."""
    from zbccl.ep import reference
    from zbccl.ops.hosts.mesh import STAMP

    R, me, E, K = comm.world_size, comm.rank, 4 * comm.world_size, 3
    H = (7, 256, 9)[seed % 3]  # odd: every field after x's rows and sums must still be aligned
    Ts = [(seed * 5 + r * 11) % 40 + (0 if r == 1 else 8) for r in range(R)]
    if seed % 2:
        Ts[1] = 0  # an empty sender
    ins = [_integer_inputs(seed, r, Ts[r], H, E, K) for r in range(R)]
    x, idx, w = ins[me]
    in_ranks = [reference.dispatch_layout(i, E, R)[2] for _, i, _ in ins]
    host_of = {r: h for h, rs in enumerate(hosts) for r in rs}
    ntpr, ntprdma, ntpe, in_rank, _ = buffer.get_dispatch_layout(idx, E)
    assert ntprdma.tolist() == [int(in_rank[:, h].any(1).sum()) for h in hosts]
    mc, wire = comm._ctx.heap.transport.remote, buffer.wire
    put0, got0 = mc.bytes_put, mc.bytes_got
    recv_x, recv_idx, recv_w, lst, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=ntpr, num_tokens_per_rdma_rank=ntprdma, is_token_in_rank=in_rank,
        num_tokens_per_expert=ntpe, topk_idx=idx, topk_weights=w)
    row = -(-(16 + 12 * K + 2 * H) // 8) * 8
    # What crossed, counted by the transport: a part of up to the eager limit rides in the header round (this rank's
    # writes: a stamp and the header to each remote peer, then the parts), a larger one is read by its forwarder.
    mine = hosts[host_of[me]]
    out_parts = [int(in_rank[:, rs].any(1).sum()) * row for h, rs in enumerate(hosts) if h != host_of[me]]
    in_parts = [int(in_ranks[s][:, mine].any(1).sum()) * row for s in range(R)
                if host_of[s] != host_of[me] and mine[hosts[host_of[s]].index(s) % len(mine)] == me]
    control = (R - len(mine)) * (STAMP + wire.W8)
    # (a step for several ranks of a host rides in one write to its relay, each rank's bytes 64-byte aligned)
    extra = mc.bytes_put - put0 - control - sum(p for p in out_parts if p <= wire.eager)
    assert 0 <= extra < 64 * (R - len(mine)), (me, out_parts, extra)
    assert mc.bytes_got - got0 == sum(p for p in in_parts if p > wire.eager), (me, in_parts)
    crossed = sum(in_parts)
    assert crossed == _crossing_bytes(in_ranks, hosts, me, row), (crossed, me)
    assert buffer.memory_stats()["rdma_recv_bytes"] == crossed
    assert buffer.memory_stats()["rdma_send_bytes"] == sum(out_parts)
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
                if host_of[s] != host_of[r] and r == me)
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


def _repeated(buffer, comm) -> None:
    """The same shapes step after step: the wire reuses a role's block (outputs, send block, staging) once nothing
    holds it, never while the caller keeps an output or a peer may still read it."""
    from zbccl.ep import reference

    R, me, E, K, H = comm.world_size, comm.rank, 4 * comm.world_size, 3, 64
    ins = [_integer_inputs(3, r, 24, H, E, K) for r in range(R)]
    x, idx, w = ins[me]
    in_ranks = [reference.dispatch_layout(i, E, R)[2] for _, i, _ in ins]
    want = reference.dispatch([i[0] for i in ins], in_ranks, me, E, topk_idx=[i[1] for i in ins],
                              topk_weights=[i[2] for i in ins])
    ys = [reference.dispatch([i[0] for i in ins], in_ranks, r, E)["x"] for r in range(R)]
    expect, _ = reference.combine(ys, in_ranks, me)
    ntpr, _, ntpe, in_rank, _ = buffer.get_dispatch_layout(idx, E)

    def step():
        recv_x, recv_idx, recv_w, _, handle, _ = buffer.dispatch(
            x, num_tokens_per_rank=ntpr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe, topk_idx=idx,
            topk_weights=w)
        assert torch.equal(recv_x, want["x"]) and torch.equal(recv_idx, want["topk_idx"])
        combined, _, _ = buffer.combine(recv_x, handle)
        assert torch.equal(combined, expect)
        return recv_x, combined

    kept = step()  # held by the caller: never handed out again
    snapshot = [t.clone() for t in kept]
    a = [t.data_ptr() for t in step()]  # dropped at once: the next step reuses its blocks
    assert a != [t.data_ptr() for t in kept]
    b = [t.data_ptr() for t in step()]
    assert b == a and all(torch.equal(t, s) for t, s in zip(kept, snapshot))
    blocks = []
    for _ in range(2):  # two dispatches in a row: the first one's send block is still held, so not reused
        buffer.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe,
                        topk_idx=idx, topk_weights=w)
        blocks.append(buffer.wire._reuse["send block"][0].data_ptr())
    assert blocks[0] != blocks[1]
    step()


def _normal(ctx, hosts: list[list[int]], seeds, eager: int | None = None):
    import zbccl
    from zbccl.ops import tuner

    if eager is not None:  # parts over it are read by their forwarder instead of riding in the round
        tuner.EP_HOSTS_EAGER = eager
    comm, buffer = _start(ctx, hosts)
    if eager is not None:
        assert buffer.wire.eager == eager
    out = [_exact_and_bytes(buffer, comm, hosts, s) for s in range(3)]
    _repeated(buffer, comm)
    for seed in seeds:
        _random_case(buffer, comm, _case(seed, comm.world_size))
    buffer.destroy()
    zbccl.finalize()
    return out


def test_normal_2x1():
    out = run_world(_normal, 2, hosts=[[0], [1]], seeds=range(16), timeout=240)
    assert all(o["crossed"] == o["naive"] for r in out for o in r)  # one rank per host: nothing to merge


def test_normal_uneven_hosts_and_ll():
    """Hosts of 2 and 1 ranks: the lone rank forwards for both remote senders; LL on the same hosts."""
    out = run_world(_normal, 3, hosts=[[0, 1], [2]], seeds=range(800, 806), eager=4096, timeout=240)
    assert sum(o["crossed"] for r in out for o in r) < sum(o["naive"] for r in out for o in r)
    assert all(run_world(_low_latency, 3, hosts=[[0, 1], [2]], timeout=240))


def test_normal_2x2_each_token_crosses_to_a_host_once():
    out = run_world(_normal, 4, hosts=HOSTS_2X2, seeds=range(500, 512), timeout=240)
    crossed = sum(o["crossed"] for r in out for o in r)
    naive = sum(o["naive"] for r in out for o in r)
    assert 0 < crossed < naive, (crossed, naive)


# ---------------------------------------------------------------------------------------------- low-latency mode
def _ll_inputs(seed: int, r: int, T: int, H: int, E: int, K: int):
    """Rank r's ``(x bf16, topk_idx)`` (distinct experts per token, some slots -1) and its weights."""
    g = torch.Generator().manual_seed(seed * 31 + r)
    idx = torch.topk(torch.rand(T, E, generator=g), K, dim=-1).indices
    idx = idx.masked_fill(torch.rand(T, K, generator=g) < 0.2, -1)
    x = (torch.randn(T, H, generator=g) * 0.5 + r).to(torch.bfloat16)
    x[:, :1] = torch.arange(T, dtype=torch.bfloat16).view(T, 1)  # the source token, in the payload
    return x, idx, torch.rand(T, K, generator=g)


def _ll_case(buffer, comm, seed: int, *, fp8: bool, hook: bool, zero_copy: bool = False) -> None:
    from zbccl.ep import reference

    R, me, H, K, Tmax = comm.world_size, comm.rank, 256, 3, 24
    E = 3 * R
    L = E // R
    Ts = [(seed * 3 + 7 * r) % Tmax for r in range(R)]
    ins = [_ll_inputs(seed, r, Ts[r], H, E, K) for r in range(R)]
    x, idx, w = ins[me]
    stats = torch.zeros(L, dtype=torch.int32)
    recv, count, handle, _, h = buffer.low_latency_dispatch(x, idx, Tmax, E, use_fp8=fp8, round_scale=fp8,
                                                            cumulative_local_expert_recv_stats=stats,
                                                            return_recv_hook=hook)
    if hook:
        h()
    want = reference.low_latency_dispatch([i[0] for i in ins], [i[1] for i in ins], me, Tmax, E, use_fp8=fp8,
                                          round_scale=fp8)
    assert torch.equal(count, want["count"]) and torch.equal(stats, want["count"])
    assert torch.equal(handle[1], want["layout_range"])
    for le in range(L):
        n = int(count[le])
        assert torch.equal(handle[0][le, :n], want["src_info"][le, :n])
        if fp8:
            assert torch.equal(recv[0][le, :n].view(torch.uint8), want["x"][le, :n].view(torch.uint8))
            assert torch.equal(recv[1][le, :n], want["scales"][le, :n])
        else:
            assert torch.equal(recv[le, :n], want["x"][le, :n])
    # identity experts on the bf16 rows, then the weighted combine: bitwise the reference's
    outs = [reference.low_latency_dispatch([i[0] for i in ins], [i[1] for i in ins], r, Tmax, E)["x"] for r in range(R)]
    y = outs[me]
    if zero_copy:
        buffer.get_next_low_latency_combine_buffer(handle).copy_(y)
    combined, _, h = buffer.low_latency_combine(y, idx, w, handle, zero_copy=zero_copy, return_recv_hook=hook)
    if hook:
        h()
    expect = reference.low_latency_combine(outs, [i[1] for i in ins], me, w)
    assert torch.equal(combined, expect), f"low_latency_combine differs on rank {me}, seed {seed}"


def _low_latency(ctx, hosts: list[list[int]], torch_group: bool = False):
    """LL cases (and, through ``torch_group``, a Buffer over torch's gloo group, which starts zbccl itself)."""
    import zbccl
    import zbccl.ep as deep_ep

    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(24, 256, ctx.world_size, 3 * ctx.world_size)
    if torch_group:
        import torch.distributed as dist

        os.environ["ZBCCL_HOST_ID"] = f"ep-host-{next(h for h, rs in enumerate(hosts) if ctx.rank in rs)}"
        torch.set_num_threads(1)
        dist.init_process_group("gloo", store=dist.PrefixStore("gloo", ctx.store()), rank=ctx.rank,
                                world_size=ctx.world_size)
        buffer = deep_ep.Buffer(dist.group.WORLD, num_rdma_bytes=hint, low_latency_mode=True, explicitly_destroy=True)
        comm = buffer.comm
        _exact_and_bytes(buffer, comm, hosts, 2)  # normal mode on the same Buffer
    else:
        comm = _init(ctx, hosts)
        buffer = deep_ep.Buffer(comm, num_rdma_bytes=hint, low_latency_mode=True, explicitly_destroy=True)
    assert buffer.wire is not None and buffer.wire.hosts == hosts
    buffer.clean_low_latency_buffer(24, 256, 3 * comm.world_size)
    for seed, (fp8, hook, zc) in enumerate([(False, False, False), (True, False, False), (False, True, True),
                                            (True, True, False)]):
        _ll_case(buffer, comm, seed, fp8=fp8, hook=hook, zero_copy=zc)
    buffer.destroy()
    zbccl.finalize()
    return True


def test_low_latency_2x2_over_a_torch_gloo_group():
    assert all(run_world(_low_latency, 4, hosts=HOSTS_2X2, torch_group=True, timeout=240))


# ---------------------------------------------------------------------------------------------- errors and faults
def _errors(ctx):
    """Bad input on one rank raises on every rank and the Buffer stays usable; a rank that never comes is named."""
    import zbccl
    from zbccl.errors import ZbcclInvalidUsageError, ZbcclTimeoutError

    comm, buffer = _start(ctx, HOSTS_2X2)
    me, E, H = comm.rank, 8, 128
    x, idx, w = _integer_inputs(3, me, 10, H, E, 2)
    ntpr, _, ntpe, in_rank, _ = buffer.get_dispatch_layout(idx, E)
    seen = []
    bad_ntpr = ntpr + 1 if me == 1 else ntpr  # rank 1's counts disagree with its routing
    with pytest.raises(ZbcclInvalidUsageError, match="num_tokens_per_rank does not match") as exc:
        buffer.dispatch(x, num_tokens_per_rank=bad_ntpr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe,
                        topk_idx=idx, topk_weights=w)
    seen.append(list(exc.value.ranks))
    xh = torch.zeros(10, 2 * H, dtype=torch.bfloat16) if me == 3 else x  # rank 3's hidden size differs
    with pytest.raises(ZbcclInvalidUsageError, match="hidden size") as exc:
        buffer.dispatch(xh, num_tokens_per_rank=ntpr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe,
                        topk_idx=idx, topk_weights=w)
    seen.append(list(exc.value.ranks))
    big = torch.zeros(30, 256, dtype=torch.bfloat16) if me == 2 else torch.zeros(4, 256, dtype=torch.bfloat16)
    with pytest.raises(ZbcclInvalidUsageError, match="too many tokens"):  # LL: rank 2 exceeds the max tokens
        buffer.low_latency_dispatch(big, torch.zeros(big.size(0), 1, dtype=torch.int64), 16, E)
    q = x.to(torch.float8_e4m3fn)
    scales = torch.ones(10, H // 64 if me == 0 else H // 128)  # rank 0's scales are twice as wide
    with pytest.raises(ZbcclInvalidUsageError, match="scales' row width") as exc:
        buffer.dispatch((q, scales), num_tokens_per_rank=ntpr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe,
                        topk_idx=idx, topk_weights=w)
    seen.append(list(exc.value.ranks))
    recv_x, _, _, _, handle, event = buffer.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=in_rank,
                                                     num_tokens_per_expert=ntpe, topk_idx=idx, topk_weights=w,
                                                     previous_event=buffer.capture(), async_finish=True)
    event.current_stream_wait()
    with pytest.raises(ZbcclInvalidUsageError, match="rows"):  # combine: rank 0's x has the wrong row count
        buffer.combine(recv_x[:-1] if me == 0 and recv_x.size(0) else recv_x, handle)
    combined, _, _ = buffer.combine(recv_x, handle)  # still usable
    assert combined.shape == x.shape
    buffer.destroy()
    late = zbccl.ep.Buffer(comm, timeout=3)  # rank 3 never dispatches: the others name it within the timeout
    if me != 3:
        t0 = time.monotonic()
        with pytest.raises(ZbcclTimeoutError) as exc:
            late.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe,
                          topk_idx=idx, topk_weights=w)
        seen.append([list(exc.value.ranks), "host 1" in str(exc.value), time.monotonic() - t0])
        ctx.store().set(f"late/{me}", b"1")  # the timed-out ranks' communicators are broken: meet in the test's store
    ctx.store().wait([f"late/{r}" for r in range(3)])  # nobody leaves while another still waits for it
    zbccl.finalize()
    return seen


def test_bad_input_on_one_rank_and_a_missing_rank():
    out = run_world(_errors, 4, timeout=240)
    assert all(o[0] == [1] and o[1] == [3] and o[2] == [0] for o in out)
    for o in out[:3]:
        ranks, named_host, elapsed = o[3]
        assert ranks == [3] and named_host and elapsed < 15, o


def _full_heap(ctx):
    """Rank 1's heap is full when the Buffer is built: every rank raises the same error, naming rank 1."""
    import zbccl
    import zbccl.ep as deep_ep
    from zbccl.ep.exchange import heap_empty
    from zbccl.errors import ZbcclOutOfMemoryError

    os.environ["ZBCCL_HEAP_MAX"] = "0"  # (this child's own setting) a heap that does not grow: it fills quickly
    comm = _init(ctx, [[0], [1]])
    comm.barrier()  # its inter-host region, before the heap fills
    held = []
    if comm.rank == 1:  # fill it in halving blocks
        size = 64 * MiB
        while size >= 1 << 16:
            try:
                held.append(heap_empty(comm, (size,), torch.uint8, fallback=False))
            except ZbcclOutOfMemoryError:
                size //= 2
    comm.barrier()
    t0 = time.monotonic()
    with pytest.raises(ZbcclOutOfMemoryError) as exc:
        deep_ep.Buffer(comm, num_rdma_bytes=1 << 20, explicitly_destroy=True)
    elapsed = time.monotonic() - t0
    held.clear()
    buffer = deep_ep.Buffer(comm, num_rdma_bytes=1 << 20, explicitly_destroy=True)  # room again: it works
    buffer.destroy()
    zbccl.finalize()
    return list(exc.value.ranks), "rank(s) [1]" in str(exc.value), elapsed


def test_a_full_heap_at_construction_raises_on_every_rank():
    for ranks, named, elapsed in run_world(_full_heap, 2, timeout=120):
        assert ranks == [1] and named and elapsed < 10


def _host_dies(ctx):
    """Both ranks of host 1 are SIGKILLed between two ops: the survivors name them (and their host) within seconds."""
    from zbccl.errors import ZbcclRemoteError

    comm, buffer = _start(ctx, HOSTS_2X2)
    me, E = comm.rank, 8
    x, idx, w = _integer_inputs(5, me, 12, 128, E, 2)
    ntpr, _, ntpe, in_rank, _ = buffer.get_dispatch_layout(idx, E)
    args = dict(num_tokens_per_rank=ntpr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe, topk_idx=idx,
                topk_weights=w)
    buffer.dispatch(x, **args)
    store = ctx.store()
    if me >= 2:  # once the survivors are out of the first dispatch (its last round reads the victims' words)
        store.wait(["out/0", "out/1"])
        os.kill(os.getpid(), signal.SIGKILL)
    store.set(f"out/{me}", b"1")
    t0 = time.monotonic()
    with pytest.raises(ZbcclRemoteError) as exc:
        buffer.dispatch(x, **args)
    elapsed = time.monotonic() - t0
    store.set(f"raised/{me}", b"1")
    store.wait(["raised/0", "raised/1"])  # a survivor that left early would look dead to the other one
    return {"ranks": list(exc.value.ranks), "text": str(exc.value), "elapsed": elapsed}


def test_a_killed_host_is_named_within_seconds():
    out = run_world(_host_dies, 4, timeout=240, expect_exit={2: -9, 3: -9})
    for got in out[:2]:
        assert got["ranks"] and got["elapsed"] < 10, got
        if "chain:" in got["text"]:  # it waited on its host peer, which left because of host 1: the first cause
            assert got["ranks"][0] in {2, 3} and f"chain: rank {got['ranks'][0]} -> " in got["text"], got
        else:
            assert set(got["ranks"]) <= {2, 3} and "host 1" in got["text"], got


# ---------------------------------------------------------------------------------------------- namespace hosts
def _namespace(ctx):
    """2 namespace hosts x 2 ranks (nothing shared but a link): normal and LL modes against the reference, then
    the link of host 1 goes down before a dispatch and every rank names the other host."""
    import zbccl.ep as deep_ep

    comm, buffer = _start(ctx, HOSTS_2X2, fake=False)
    out = [_exact_and_bytes(buffer, comm, HOSTS_2X2, 1)]
    _random_case(buffer, comm, _case(700, comm.world_size))
    buffer.destroy()
    ll = deep_ep.Buffer(comm, low_latency_mode=True, explicitly_destroy=True)
    _ll_case(ll, comm, 3, fp8=True, hook=True)
    ll.destroy()
    return {"bytes": out, "cut": _cut(ctx, comm)}


def _cut(ctx, comm) -> dict:
    import zbccl.ep as deep_ep
    from zbccl.errors import ZbcclError

    buffer = deep_ep.Buffer(comm, timeout=20)
    me, E = comm.rank, 8
    x, idx, w = _integer_inputs(5, me, 12, 128, E, 2)
    ntpr, _, ntpe, in_rank, _ = buffer.get_dispatch_layout(idx, E)
    args = dict(num_tokens_per_rank=ntpr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe, topk_idx=idx,
                topk_weights=w)
    buffer.dispatch(x, **args)
    store = ctx.store()
    store.set(f"ready/{me}", b"1")
    if me == 0:  # host 1 cannot reach the store once cut: only host 0 waits there
        store.wait([f"ready/{r}" for r in range(4)])
        store.set("hosts/cut", b"1")
        store.wait(["hosts/cut-done"])
    t0 = time.monotonic()
    try:
        # A rank whose peers' parts had all arrived before the cut may finish this dispatch (an op ends once what
        # it receives is here, not once its own last writes are acknowledged): its next op needs the other host
        # again, and raises.
        for _ in range(2):
            buffer.dispatch(x, **args)
        out = {"error": None}
    except ZbcclError as exc:
        out = {"error": type(exc).__name__, "ranks": list(exc.ranks), "text": str(exc), "elapsed": time.monotonic() - t0}
    if me < 2:  # a survivor that left early would look dead to the other one
        store.set(f"raised/{me}", b"1")
        store.wait(["raised/0", "raised/1"])
    return out


def test_namespace_hosts_2x2_and_a_cut_link():
    from tests.hosts import HostsUnavailable, NetnsHosts, hosts_skip_reason, run_hosts

    reason = hosts_skip_reason()
    if reason:
        pytest.skip(reason)

    def director(hosts, store):
        store.wait(["hosts/cut"])
        hosts.cut(1)
        store.set("hosts/cut-done", b"1")
        store.wait(["raised/0", "raised/1"])
        hosts.cut(1, up=True)  # host 1's ranks, which raised too, then leave without waiting out their engines

    try:
        with NetnsHosts(2) as hosts:
            out = run_hosts(_namespace, hosts, ranks_per_host=2, timeout=240, director=director)
            addrs = [hosts.addr(0), hosts.addr(1)]
    except HostsUnavailable as exc:
        pytest.skip(str(exc))
    crossed = sum(o["crossed"] for r in out for o in r["bytes"])
    assert 0 < crossed < sum(o["naive"] for r in out for o in r["bytes"])
    for r, got in enumerate(o["cut"] for o in out):
        other = 1 - r // 2
        assert got["elapsed"] < 30 and got["ranks"], got
        if got["error"] == "ZbcclTimeoutError":  # it waited on the other host itself
            assert set(got["ranks"]) <= set(HOSTS_2X2[other]), got
            assert addrs[other] in got["text"] and f"host {other}" in got["text"], got
        elif "chain: rank" in got["text"]:  # it waited on a rank of its own host that left because of the other host
            assert got["error"] == "ZbcclRemoteError" and got["ranks"][0] in HOSTS_2X2[other], got
            assert f"chain: rank {got['ranks'][0]} -> " in got["text"], got
        else:  # its read of the other host's words was still stalled when the link came back and those ranks had
            # finalized or exited (the director restores it once host 0's ranks raised): they are named as such,
            # with their host
            assert got["error"] == "ZbcclRemoteError" and set(got["ranks"]) <= set(HOSTS_2X2[other]), got
            assert ("died" in got["text"] or "called finalize" in got["text"]) and addrs[other] in got["text"], got


def _ll_reference_across(ctx):
    """The one-host low-latency cases (fp8 in both scale layouts, ue8m0, a masked rank) between two hosts."""
    from tests.multiproc.test_ep_ll_native import _dispatch_matches

    os.environ["ZBCCL_HOST_ID"] = f"ep-host-{ctx.rank}"
    return _dispatch_matches(ctx)


def _ll_logfmt_across(ctx):
    """The one-host LogFMT combine case between two hosts."""
    import zbccl
    import zbccl.ep as deep_ep
    from tests.multiproc.test_ep_low_latency import _logfmt

    comm = _init(ctx, [[0], [1]])
    buffer = deep_ep.Buffer(comm, num_rdma_bytes=1 << 20, low_latency_mode=True, explicitly_destroy=True)
    assert buffer.wire is not None
    _logfmt(buffer, comm)
    buffer.destroy()
    zbccl.finalize()
    return True


def test_low_latency_2x1_scales_a_masked_rank_and_logfmt_are_the_reference():
    assert all(run_world(_ll_reference_across, 2, timeout=120))
    assert all(run_world(_ll_logfmt_across, 2, timeout=120))
