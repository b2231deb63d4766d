"""zbccl.ep low-latency mode: DeepEP's test_low_latency checks at world 2 and 4, on CPU.

``x`` encodes its source rank (``rank - 128``) in every column and the token index in the
last 128 columns, so each received row proves where it came from.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.multiproc.ep_checks import calc_diff, per_token_cast_back
from tests.spawn import run_world

MiB = 1 << 20


def _low_latency(buffer, comm, T: int, H: int, K: int, E: int, seed: int = 1, skew: bool = False):
    import zbccl

    R, rank = comm.world_size, comm.rank
    torch.manual_seed(seed + rank)
    random.seed(seed + rank)
    L = E // R
    x = torch.ones((T, H), dtype=torch.bfloat16) * (rank - 128)
    x[:, -128:] = torch.arange(T).to(torch.bfloat16).view(-1, 1)
    x_list = [x, torch.randn((T, H), dtype=torch.bfloat16) * 0.1]
    scores = torch.randn((T, E), dtype=torch.float32).abs() + 1
    if skew:
        scores[:, 0] += 100
        scores[:, (R - 1) * L:] = -1
    topk_idx = torch.topk(scores, K, dim=-1, largest=True, sorted=True)[1]
    topk_weights = torch.randn((T, K), dtype=torch.float32).abs()
    for _ in range(min(10, T)):
        topk_idx[random.randint(0, T - 1), random.randint(0, K - 1)] = -1
    all_topk_idx = torch.empty((R * T, K), dtype=topk_idx.dtype)
    zbccl.all_gather_into_tensor(all_topk_idx, topk_idx, comm=comm)
    all_topk_idx = all_topk_idx.view(R, T, K)
    num_times = 0
    for current_x in x_list:
        for hook_mode in (False, True):
            for dispatch_fp8, round_scale, ue8m0 in ((False, False, False), (True, False, False), (True, True, False),
                                                     (True, True, True)):
                num_times += 1
                for _ in range(num_times % 2 + 1):
                    stats = torch.zeros((L,), dtype=torch.int)
                    packed_x, count, handle, event, hook = buffer.low_latency_dispatch(
                        current_x, topk_idx, T, E, use_fp8=dispatch_fp8, round_scale=round_scale, use_ue8m0=ue8m0,
                        cumulative_local_expert_recv_stats=stats, async_finish=not hook_mode,
                        return_recv_hook=hook_mode)
                    hook() if hook_mode else event.current_stream_wait()
                packed_x = (packed_x[0], packed_x[1].contiguous()) if dispatch_fp8 else packed_x
                sim = (per_token_cast_back(packed_x[0].view(-1, H), packed_x[1].view(-1, H // 128))
                       .view(packed_x[0].shape) if dispatch_fp8 else packed_x.clone())
                for i in range(L):
                    expert_id = rank * L + i
                    n = count[i].item()
                    si, lr = handle[0][i], handle[1][i]
                    assert stats[i].item() == n
                    assert n == (lr & 0xFFFFFFFF).sum().item()
                    assert n == (all_topk_idx == expert_id).sum().item()
                    if current_x is not x or n == 0:
                        continue
                    # DeepEP's own per-expert cast back (views the expert's scales as bytes with ue8m0)
                    rx = (per_token_cast_back(packed_x[0][i], packed_x[1][i]) if dispatch_fp8 else packed_x[i])[:n]
                    assert torch.equal(rx[:, :-128].amin(-1), rx[:, :-128].amax(-1))
                    if round_scale:
                        assert calc_diff(rx[:, -1], si[:n]) < 0.007
                    else:
                        assert (rx[:, -128:] - si[:n].view(-1, 1) % T).sum().item() == 0
                        amin = rx[:, :-128].amin(-1)
                        for j in range(R):
                            begin, cnt = (lr[j] >> 32).item(), (lr[j] & 0xFFFFFFFF).item()
                            assert (amin == j - 128).sum().item() == (all_topk_idx[j] == expert_id).sum().item()
                            assert (rx[begin:begin + cnt, :-128] - j + 128).sum().item() == 0
                for zero_copy in (False, True):
                    if zero_copy:
                        buffer.get_next_low_latency_combine_buffer(handle)[:, :, :] = sim
                    out = torch.empty((T, H), dtype=torch.bfloat16)
                    combined, event, hook = buffer.low_latency_combine(
                        sim, topk_idx, topk_weights, handle, async_finish=not hook_mode, zero_copy=zero_copy,
                        return_recv_hook=hook_mode, out=out)
                    hook() if hook_mode else event.current_stream_wait()
                    assert combined is out
                    assert torch.isnan(combined).sum().item() == 0
                    if not round_scale and T:
                        ref = current_x * topk_weights.masked_fill(topk_idx == -1, 0).sum(dim=1).view(-1, 1)
                        assert calc_diff(ref, combined) < (9e-4 if dispatch_fp8 else 1e-5)


def _two_micro_batches(buffer, comm) -> None:
    """DeepEP's overlap pattern: dispatch A and B with hooks, then both hooks; then the two combines."""
    R, me, T, H, E = comm.world_size, comm.rank, 12, 256, 4 * comm.world_size
    xs = [torch.full((T, H), float(me + 10 * b), dtype=torch.bfloat16) for b in range(2)]
    idx = [torch.stack([torch.randperm(E)[:3] for _ in range(T)]) for _ in range(2)]
    w = [torch.rand(T, 3) for _ in range(2)]
    got = [buffer.low_latency_dispatch(xs[b], idx[b], T, E, use_fp8=False, return_recv_hook=True) for b in range(2)]
    for b in range(2):
        xs[b].fill_(-1)  # the call published a copy: the input may be reused before the hook
    for b in range(2):
        got[b][4]()
    outs = []
    for b in range(2):
        recv_x, count, handle = got[b][0], got[b][1], got[b][2]
        for i in range(E // R):
            n = int(count[i])
            src = (handle[1][i] >> 32, handle[1][i] & 0xFFFFFFFF)
            for j in range(R):
                rows = recv_x[i, int(src[0][j]):int(src[0][j] + src[1][j])]
                assert bool((rows == j + 10 * b).all())
            assert n == int(src[1].sum())
        outs.append(buffer.low_latency_combine(recv_x, idx[b], w[b], handle, return_recv_hook=True))
    for b in range(2):
        outs[b][2]()
        expect = float(me + 10 * b) * w[b].sum(1, keepdim=True)
        assert torch.allclose(outs[b][0].float(), expect.expand(T, H), rtol=1e-2)


def _logfmt(buffer, comm) -> None:
    """use_logfmt: DeepEP's LogFMT-10 numbers (lossy for groups with max |y| < 1), exact bf16 otherwise."""
    from zbccl.ep.layout import logfmt_roundtrip

    me, T, H, E = comm.rank, 10, 256, 2 * comm.world_size
    torch.manual_seed(me)
    x = torch.randn(T, H, dtype=torch.bfloat16) * 0.1
    x[:, 128:] *= 100  # second group: max >= 1, not cast
    idx = torch.stack([torch.randperm(E)[:2] for _ in range(T)])
    w = torch.rand(T, 2)
    recv_x, _, handle, _, _ = buffer.low_latency_dispatch(x, idx, T, E, use_fp8=False)
    exact = buffer.low_latency_combine(recv_x, idx, w, handle)[0]
    lossy = buffer.low_latency_combine(recv_x, idx, w, handle, use_logfmt=True)[0]
    ref = (logfmt_roundtrip(x) * w.sum(1, keepdim=True)).to(torch.bfloat16)
    assert torch.allclose(lossy.float(), ref.float(), rtol=1e-2, atol=1e-3) and not torch.equal(lossy[:, :128], exact[:, :128])
    assert torch.equal(lossy[:, 128:], exact[:, 128:]) and calc_diff(lossy, exact) < 1e-5


def _masks(comm) -> None:
    """Shrink masks (DeepEP's semantics for the ranks that mask): nothing received from a masked rank,
    combine drops the slots of experts on it; the mask APIs need enable_shrink."""
    import zbccl
    import zbccl.ep as deep_ep

    R, me, T, H, E = comm.world_size, comm.rank, 9, 256, 2 * comm.world_size
    L = E // R
    plain = deep_ep.Buffer(comm, low_latency_mode=True, explicitly_destroy=True)
    with pytest.raises(zbccl.ZbcclInvalidUsageError, match="enable_shrink"):
        plain.low_latency_update_mask_buffer(R - 1, True)
    plain.destroy()
    buffer = deep_ep.Buffer(comm, low_latency_mode=True, explicitly_destroy=True, enable_shrink=True)
    x = torch.full((T, H), float(me + 1), dtype=torch.bfloat16)
    idx = torch.stack([torch.randperm(E)[:3] for _ in range(T)])
    w = torch.rand(T, 3)
    all_idx = torch.empty(R * T, 3, dtype=idx.dtype)
    zbccl.all_gather_into_tensor(all_idx, idx, comm=comm)
    all_idx = all_idx.view(R, T, 3)
    dead = R - 1
    buffer.low_latency_update_mask_buffer(dead, True)
    status = torch.zeros(R, dtype=torch.int)
    buffer.low_latency_query_mask_buffer(status)
    assert status.nonzero().flatten().tolist() == [dead]
    recv_x, count, handle, _, _ = buffer.low_latency_dispatch(x, idx, T, E, use_fp8=False)
    for i in range(L):
        per_src = (all_idx == me * L + i).sum(dim=[1, 2])
        per_src[dead] = 0
        assert int(count[i]) == int(per_src.sum()) and int(handle[1][i, dead] & 0xFFFFFFFF) == 0
        for j in range(R):
            b, n = int(handle[1][i, j] >> 32), int(handle[1][i, j] & 0xFFFFFFFF)
            assert n == int(per_src[j]) and bool((recv_x[i, b:b + n] == j + 1).all())
    combined = buffer.low_latency_combine(recv_x, idx, w, handle)[0]
    kept = w.masked_fill(idx // L == dead, 0).sum(1, keepdim=True)
    if me != dead:
        assert torch.allclose(combined.float(), (me + 1) * kept.expand(T, H), rtol=1e-2)
    buffer.low_latency_clean_mask_buffer()
    buffer.low_latency_query_mask_buffer(status)
    assert int(status.sum()) == 0
    buffer.destroy()


def _ll_world(ctx, cases):
    import zbccl
    import zbccl.ep as deep_ep

    torch.set_num_threads(1)  # 2+ ranks per core here: torch's thread pool would stall on oversubscription
    comm = ctx.init(heap_size=96 * MiB)
    for kw in cases:
        T, H, E = kw["T"], kw["H"], kw["E"]
        hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, comm.world_size, E)
        buffer = deep_ep.Buffer(comm, num_rdma_bytes=hint, low_latency_mode=True, num_qps_per_rank=E // comm.world_size,
                                allow_nvlink_for_low_latency_mode=True, explicitly_destroy=True, allow_mnnvl=False)
        buffer.clean_low_latency_buffer(T, H, E)
        _low_latency(buffer, comm, **kw)
        _two_micro_batches(buffer, comm)
        _logfmt(buffer, comm)
        buffer.destroy()
    _masks(comm)
    zbccl.finalize()
    return True


def test_low_latency_world2():
    cases = [dict(T=32, H=512, K=4, E=8), dict(T=16, H=1024, K=3, E=6, skew=True, seed=5)]
    assert all(run_world(_ll_world, 2, cases=cases, timeout=120))


@pytest.mark.slow
def test_low_latency_world4():
    assert all(run_world(_ll_world, 4, cases=[dict(T=16, H=512, K=5, E=16)], timeout=120))
