"""zbccl.ep pure parts: layout maths against DeepEP's reference, casts, size hints, events."""

from __future__ import annotations

import pytest
import torch

from tests.multiproc.ep_checks import per_token_cast_back, per_token_cast_to_fp8, ref_layout
from zbccl.ep import Config, EventOverlap, get_low_latency_rdma_size_hint
from zbccl.ep.layout import fp8_dequantize, fp8_quantize, int8_dequantize, int8_quantize, logfmt_roundtrip
from zbccl.ep.reference import channel_prefix, dispatch_layout, expert_pairs, rank_lists, send_head


@pytest.mark.parametrize("R,E,T,K", [(2, 8, 50, 3), (4, 16, 33, 5), (3, 9, 0, 2)])
def test_layout_matches_deepep_reference(R, E, T, K):
    torch.manual_seed(R * 7 + T)
    topk_idx = torch.topk(torch.randn(T, E), K).indices
    if T:
        topk_idx[torch.randint(0, T, (5,)), torch.randint(0, K, (5,))] = -1
    per_rank, per_expert, in_rank = dispatch_layout(topk_idx, E, R)
    ref_rank, ref_expert, ref_in_rank = ref_layout(topk_idx, E, R)
    assert torch.equal(per_rank, ref_rank) and per_rank.dtype == torch.int32
    assert torch.equal(per_expert, ref_expert) and per_expert.dtype == torch.int32
    assert torch.equal(in_rank, ref_in_rank)
    counts, tokens = rank_lists(in_rank)
    assert counts.tolist() == per_rank.tolist()
    head = send_head(in_rank)
    start = 0
    for r in range(R):
        toks = tokens[start:start + int(counts[r])]
        start += int(counts[r])
        assert torch.equal(toks, in_rank[:, r].nonzero().flatten())  # ascending
        assert torch.equal(head[toks, r].long(), torch.arange(toks.numel()))
    chan = channel_prefix(in_rank, 4)
    assert chan.shape == (R, 4) and torch.equal(chan[:, -1].long(), counts)


def test_expert_pairs_order():
    topk_idx = torch.tensor([[2, 0], [0, -1], [2, 1]])
    counts, tokens, slots = expert_pairs(topk_idx, 4)
    assert counts.tolist() == [2, 1, 2, 0]
    assert tokens.tolist() == [0, 1, 2, 0, 2] and slots.tolist() == [1, 2, 5, 0, 4]


def test_fp8_cast_matches_deepep_and_roundtrips():
    torch.manual_seed(0)
    x = torch.randn(7, 512, dtype=torch.bfloat16) * 3
    q, s = fp8_quantize(x)
    ref_q, ref_s = per_token_cast_to_fp8(x)
    assert torch.equal(s, ref_s) and torch.equal(q.float(), ref_q.float())
    assert torch.equal(fp8_dequantize(q, s), per_token_cast_back(q, s))
    for ue8m0 in (False, True):
        q, s = fp8_quantize(x, round_scale=True, ue8m0=ue8m0)
        assert s.dtype == (torch.int32 if ue8m0 else torch.float32) and s.shape == (7, 512 // (512 if ue8m0 else 128))
        back = fp8_dequantize(q, s)
        assert torch.equal(back, per_token_cast_back(q, s))
        assert (back.float() - x.float()).abs().max() < x.float().abs().max() / 8
    qi, si = int8_quantize(x)
    assert qi.dtype == torch.int8 and (int8_dequantize(qi, si, torch.float32) - x.float()).abs().max() < 0.05


def test_size_hints_are_deepeps():
    assert get_low_latency_rdma_size_hint(128, 7168, 8, 288) == 2_146_961_792
    cfg = Config(24, 8, 256)
    hint = cfg.get_nvl_buffer_size_hint(7168 * 2, 8)
    assert hint % 128 == 0 and hint == 12 * 8 * 5 * 4 + 12 * 8 * 256 * (7168 * 2 + 8 + 1024 + 512 + 512)
    assert cfg.get_rdma_buffer_size_hint(7168 * 2, 8) == 0
    with pytest.raises(ValueError):
        Config(24, 8, 8)


def test_event_overlap_semantics():
    done = []
    ev = EventOverlap(None)
    with ev:
        pass
    with pytest.raises(AssertionError):
        ev.current_stream_wait()
    from zbccl.ep import EventHandle

    ev = EventOverlap(EventHandle())
    ev.register_hook_after_wait(lambda: done.append(1))
    with ev(release_handle=True):
        pass
    assert done == [1] and ev.event is None


def test_logfmt_roundtrip_follows_deepep_cast_rule():
    torch.manual_seed(0)
    y = (torch.randn(16, 512) * 0.05).to(torch.bfloat16)
    y[:, 128:256] *= 100  # max >= 1: stays bf16
    y[:, 256:384] = 0  # all zero: stays
    y[3, 384:512] = 0.25  # one value (amin == amax): stays
    r = logfmt_roundtrip(y)
    v = y.float()
    assert torch.equal(r[:, 128:384], v[:, 128:384]) and torch.equal(r[3, 384:], v[3, 384:])
    cast = r[:, :128]
    assert not torch.equal(cast, v[:, :128]) and torch.equal(torch.sign(cast), torch.sign(v[:, :128]))
    # 510 log steps over at most 32 octaves: half a step is under 2.2% relative error
    nz = v[:, :128] != 0
    assert bool(((cast - v[:, :128]).abs()[nz] <= v[:, :128].abs()[nz] * 0.0221).all())
