"""zbccl.ep failure paths: bad input fails on every rank (and the Buffer stays usable), peer death.

Each bad call is made on one rank only (the others pass good arguments), and every rank must
raise ZbcclInvalidUsageError quoting the bad rank's message; then a good op must still work,
which shows that nothing hung and the group stayed in step.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from tests.spawn import run_world

MiB = 1 << 20
T, H, K, E = 16, 256, 2, 8


def _inputs(rank: int, R: int):
    torch.manual_seed(rank)
    x = torch.ones(T, H, dtype=torch.bfloat16) * rank
    topk_idx = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    return x, topk_idx, torch.ones(T, K, dtype=torch.float32)


def _expect_everywhere(fn, match: str, bad_rank: int | None = 1):
    import zbccl

    with pytest.raises(zbccl.ZbcclInvalidUsageError, match=match) as info:
        fn()
    assert bad_rank is None or f"rank {bad_rank}" in str(info.value), str(info.value)


def _good_round(buffer, comm):
    x, topk_idx, w = _inputs(comm.rank, comm.world_size)
    ntpr, _, ntpe, in_rank, _ = buffer.get_dispatch_layout(topk_idx, E)
    recv_x, _, _, _, handle, _ = buffer.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=in_rank,
                                                 num_tokens_per_expert=ntpe, topk_idx=topk_idx, topk_weights=w)
    combined, _, _ = buffer.combine(recv_x, handle)
    assert torch.allclose(combined.float(), x.float() * in_rank.sum(1, keepdim=True))
    return handle


def _bad_inputs(ctx):
    import zbccl
    import zbccl.ep as deep_ep

    torch.set_num_threads(1)
    comm = ctx.init(heap_size=32 * MiB)
    R, me = comm.world_size, comm.rank
    buffer = deep_ep.Buffer(comm, explicitly_destroy=True)
    other = deep_ep.Buffer(comm, explicitly_destroy=True)
    x, topk_idx, w = _inputs(me, R)
    ntpr, _, ntpe, in_rank, _ = buffer.get_dispatch_layout(topk_idx, E)
    good = dict(x=x, num_tokens_per_rank=ntpr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe,
                topk_idx=topk_idx, topk_weights=w)
    bad_idx = topk_idx.clone()
    bad_idx[3, 1] = E + 5
    shift = torch.zeros_like(ntpr)
    shift[0], shift[-1] = 1, -1
    cases = [  # (what rank 1 passes instead, the message every rank must see)
        (dict(topk_idx=bad_idx), "topk_idx out of range"),
        (dict(topk_idx=topk_idx.float()), "topk_idx has the wrong dtype"),
        (dict(x=x[:, :100]), "hidden size"),
        (dict(x=x[:5]), "wrong shape"),
        (dict(topk_weights=None), "topk_idx and topk_weights go together"),
        (dict(num_tokens_per_expert=torch.zeros(2 * E, dtype=torch.int32)), "does not match topk_idx"),
        (dict(num_tokens_per_rank=ntpr + 1), "num_tokens_per_rank does not match"),
        (dict(num_tokens_per_rank=ntpr.long() + (1 << 40)), "num_tokens_per_rank does not match"),  # not a size
        (dict(num_tokens_per_rank=ntpr + shift), "num_tokens_per_rank does not match"),  # right sum, wrong split
        (dict(x=x.to(torch.int32)), "x has the wrong dtype"),
    ]
    for change, match in cases:
        args = dict(good, **change) if me == 1 else good
        _expect_everywhere(lambda a=args: buffer.dispatch(**a), match)
    # mismatched num_experts (consistent per rank, different across ranks): named on every rank
    idx2 = topk_idx % 4 if me == 1 else topk_idx
    ntpr2, _, ntpe2, in_rank2, _ = buffer.get_dispatch_layout(idx2, 4 if me == 1 else E)
    _expect_everywhere(lambda: buffer.dispatch(x, num_tokens_per_rank=ntpr2, is_token_in_rank=in_rank2,
                                               num_tokens_per_expert=ntpe2, topk_idx=idx2, topk_weights=w),
                       "ranks disagree on num_experts", bad_rank=None)
    # num_worst_tokens too small on one rank
    _expect_everywhere(lambda: buffer.dispatch(**good, num_worst_tokens=1 if me == 1 else T * R), "num_worst_tokens")
    handle = _good_round(buffer, comm)
    recv_rows = handle[3].size(0)
    # a handle from another Buffer, on one rank
    other_handle = _good_round(other, comm)
    _expect_everywhere(lambda: buffer.combine(torch.zeros(recv_rows, H, dtype=torch.bfloat16),
                                              other_handle if me == 1 else handle), "not returned by this Buffer")
    _expect_everywhere(lambda: buffer.combine(torch.zeros(recv_rows + (me == 1), H, dtype=torch.bfloat16), handle),
                       "does not match the handle")
    with pytest.raises(zbccl.ZbcclInvalidUsageError, match="get_dispatch_layout: topk_idx out of range"):
        buffer.get_dispatch_layout(bad_idx, E)  # local: only the caller is involved
    # dispatch skips re-checking the topk_idx get_dispatch_layout just checked; an in-place change since is seen
    for change, match in (((3, 1), E + 5), "topk_idx out of range"), (((3, 1), None), "does not match topk_idx"):
        idx3 = topk_idx.clone()
        ntpr3, _, ntpe3, in_rank3, _ = buffer.get_dispatch_layout(idx3, E)
        if me == 1:
            where, value = change
            idx3[where] = value if value is not None else (int(idx3[where]) + 1) % E
        _expect_everywhere(lambda i=idx3, a=ntpr3, b=in_rank3, c=ntpe3: buffer.dispatch(
            x, num_tokens_per_rank=a, is_token_in_rank=b, num_tokens_per_expert=c, topk_idx=i, topk_weights=w), match)
    # low-latency: num_max_dispatch_tokens_per_rank exceeded on one rank
    tmax = T if me == 1 else T
    xx = torch.cat([x, x]) if me == 1 else x
    ii = torch.cat([topk_idx, topk_idx]) if me == 1 else topk_idx
    _expect_everywhere(lambda: buffer.low_latency_dispatch(xx, ii, tmax, E, use_fp8=False), "too many tokens")
    dup = topk_idx.clone()
    if me == 1:
        dup[2, 1] = dup[2, 0]  # one expert twice in a token: more rows than it has slots
    _expect_everywhere(lambda: buffer.low_latency_dispatch(x, dup, T, E, use_fp8=False), "an expert twice")
    _expect_everywhere(lambda: buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=False, async_finish=True,
                                                           return_recv_hook=me == 1), "exclude each other")
    _, _, h, _, _ = buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=False)
    _expect_everywhere(lambda: buffer.low_latency_combine(
        torch.zeros(E // R, R * T, H, dtype=torch.bfloat16), topk_idx, w, h if me == 0 else (h[1],) + h[1:]),
        "not returned by this Buffer")
    _good_round(buffer, comm)
    stats = zbccl.memory_stats()
    other.destroy()
    buffer.destroy()
    zbccl.finalize()
    return stats["staged_bytes"]


def test_bad_input_fails_on_every_rank_and_the_buffer_stays_usable():
    assert all(s > 0 for s in run_world(_bad_inputs, 2, timeout=120))


def _fields_disagree(ctx):
    """Fields every receiver uses (the scales' width and dtype, the low-latency handle's sizes) agree."""
    import zbccl
    import zbccl.ep as deep_ep

    torch.set_num_threads(1)
    comm = ctx.init(heap_size=32 * MiB)
    R, me = comm.world_size, comm.rank
    buffer = deep_ep.Buffer(comm, explicitly_destroy=True)
    x, topk_idx, w = _inputs(me, R)
    ntpr, _, ntpe, in_rank, _ = buffer.get_dispatch_layout(topk_idx, E)
    xq = x.to(torch.float8_e4m3fn)
    layout = dict(num_tokens_per_rank=ntpr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe,
                  topk_idx=topk_idx, topk_weights=w)
    scales = torch.ones(T, H // 128, dtype=torch.float32)
    cases = [  # (rank 1's scales, the field every rank must name)
        (torch.ones(T, H // 64, dtype=torch.float32), "the scales' row width"),  # wider: peers read past rank 0's
        (torch.ones(T, H // 256, dtype=torch.float32), "the scales' row width"),
        (torch.ones(T, H // 128, dtype=torch.int32), "the scales' dtype"),
    ]
    for bad, match in cases:
        _expect_everywhere(lambda b=bad: buffer.dispatch((xq, b if me == 1 else scales), **layout), match)
    recv, _, _, _, handle, _ = buffer.dispatch((xq, scales), **layout)  # in step: same widths work
    assert recv[1].shape[1] == H // 128
    # low-latency combine: a handle whose sizes were changed on one rank (its x matches them there)
    _, _, h, _, _ = buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=False)
    L = E // R
    for i, what in ((2, "num_max_dispatch_tokens_per_rank"), (4, "num_experts")):
        hh = h if me == 0 else h[:i] + (2 * h[i],) + h[i + 1:]
        L2, N2 = (int(hh[4]) // R, R * int(hh[2]))
        _expect_everywhere(lambda a=hh, b=(L2, N2): buffer.low_latency_combine(
            torch.zeros(b[0], b[1], H, dtype=torch.bfloat16), topk_idx, w, a), what)
    combined, _, _ = buffer.low_latency_combine(torch.zeros(L, R * T, H, dtype=torch.bfloat16), topk_idx, w, h)
    assert combined.shape == (T, H)
    _good_round(buffer, comm)
    buffer.destroy()
    zbccl.finalize()
    return True


def test_fields_receivers_use_must_agree_on_every_rank():
    assert run_world(_fields_disagree, 2, timeout=120) == [True, True]


def _peer_dies(ctx, where: str):
    import zbccl
    import zbccl.ep as deep_ep

    torch.set_num_threads(1)
    comm = ctx.init(heap_size=16 * MiB)
    buffer = deep_ep.Buffer(comm, timeout=60)
    x, topk_idx, w = _inputs(comm.rank, comm.world_size)
    ntpr, _, ntpe, in_rank, _ = buffer.get_dispatch_layout(topk_idx, E)
    recv_x, _, _, _, handle, _ = buffer.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=in_rank,
                                                 num_tokens_per_expert=ntpe)
    if comm.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    with pytest.raises(zbccl.ZbcclRemoteError) as info:
        if where == "dispatch":
            buffer.dispatch(x, handle=handle)
        elif where == "combine":
            buffer.combine(recv_x, handle)
        else:
            buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=True)
    assert 1 in info.value.ranks
    zbccl.finalize()
    return True


@pytest.mark.parametrize("where", ["dispatch", "combine", "low_latency_dispatch"])
def test_peer_death_is_a_remote_error(where):
    # The world's timeout (40 s) is below the Buffer's (60 s): a pass proves the death was noticed.
    out = run_world(_peer_dies, 2, where=where, expect_exit={1: -signal.SIGKILL}, timeout=40)
    assert out[0] is True


def _hostile_plan(ctx):
    """A peer whose published low-latency plan names a token it does not have (a hostile or corrupt
    rank; its own checks are bypassed here): the receiver of that row (rank 0: the token is in the
    list of expert 0) refuses the block, naming the rank, instead of reading past the peer's x; the
    Buffer stays usable."""
    import zbccl
    import zbccl.ep as deep_ep
    from zbccl.ep import low_latency

    torch.set_num_threads(1)
    comm = ctx.init(heap_size=32 * MiB)
    me = comm.rank
    buffer = deep_ep.Buffer(comm, timeout=30, explicitly_destroy=True, low_latency_mode=True)
    x, topk_idx, w = _inputs(me, comm.world_size)
    real = low_latency._pairs
    if me == 1:
        def corrupt(ex, idx, n_exp):
            counts, tokens, slots = real(ex, idx, n_exp)
            tokens = tokens.clone()
            tokens[0] = T + 1000  # past the end of this rank's x, in the list of expert 0 (rank 0's)
            return counts, tokens, slots

        low_latency._pairs = corrupt
    try:
        if me == 0:
            _expect_everywhere(lambda: buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=False),
                               "rank 1's published plan is out of bounds")
        else:
            buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=False)
    finally:
        low_latency._pairs = real
    recv_x, count, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=False)  # still in step
    combined = buffer.low_latency_combine(recv_x, topk_idx, w, handle)[0]
    assert torch.equal(combined, (x.float() * K).to(torch.bfloat16))
    buffer.destroy()
    zbccl.finalize()
    return True


def test_a_peers_out_of_bounds_plan_is_refused():
    assert all(run_world(_hostile_plan, 2, timeout=120))


def _out_of_step(ctx):
    """Ranks whose EP calls do not match: rank 0 skips a receive hook and dispatches again (its publish meets
    rank 1's hook barrier); then a clean against a dispatch. Every rank raises at that barrier, naming each
    rank's op and phase, instead of reading stale headers or waiting out the timeout; the Buffer then refuses
    every op, and a new Buffer works."""
    import zbccl
    import zbccl.ep as deep_ep

    torch.set_num_threads(1)
    comm = ctx.init(heap_size=32 * MiB)
    me = comm.rank
    x, topk_idx, _ = _inputs(me, comm.world_size)
    buffer = deep_ep.Buffer(comm, explicitly_destroy=True, timeout=120)  # a timeout would be another error
    _, _, _, _, hook = buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=False, return_recv_hook=True)
    with pytest.raises(zbccl.ZbcclInvalidUsageError, match="out of step") as info:
        if me == 0:
            buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=False)
        else:
            hook()
    text = str(info.value)
    assert "rank 0 in op #2 low_latency_dispatch, its publish" in text, text
    assert "rank 1 in op #1 low_latency_dispatch, its closing barrier" in text, text
    with pytest.raises(zbccl.ZbcclInvalidUsageError, match="destroy this Buffer"):
        _good_round(buffer, comm)
    buffer.destroy()

    buffer = deep_ep.Buffer(comm, explicitly_destroy=True, timeout=120)
    _good_round(buffer, comm)
    with pytest.raises(zbccl.ZbcclInvalidUsageError, match="out of step") as info:
        if me == 0:
            buffer.clean_low_latency_buffer(T, H, E)
        else:
            _good_round(buffer, comm)
    assert "clean_low_latency_buffer, its barrier" in str(info.value) and "op #3 dispatch, its publish" in str(info.value)
    buffer.destroy()
    buffer = deep_ep.Buffer(comm, explicitly_destroy=True, timeout=120)
    _good_round(buffer, comm)
    buffer.clean_low_latency_buffer(T, H, E)
    buffer.destroy()
    zbccl.finalize()
    return True


def test_ranks_out_of_step_fail_at_once_on_every_rank():
    assert all(run_world(_out_of_step, 2, timeout=120))
