"""The native EP plan kernels (native/csrc/ep.c) against the torch oracle in zbccl.ep.reference."""

from __future__ import annotations

from array import array

import pytest
import torch

from zbccl import native
from zbccl.ep.reference import channel_prefix, dispatch_layout, expert_pairs, rank_lists, send_head
from zbccl.native import abi


@pytest.fixture(scope="module")
def core():
    return native.core()


def _call(fn, block: str, **fields) -> int:
    """``fn`` on its argument block ``block`` (abi.EP_ARGS), every field by name."""
    arr = array("q", abi.ep_args(block)[0](**fields))
    return fn(arr.buffer_info()[0])


def _routing(T: int, E: int, K: int, seed: int, skew: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(T, E, generator=g)
    if skew:
        scores[:, :K] += 10 * (torch.rand(T, 1, generator=g) < 0.8)
    idx = torch.topk(scores, K, dim=1).indices
    if T:
        idx[torch.randint(0, T, (max(T // 4, 1),), generator=g), torch.randint(0, K, (max(T // 4, 1),), generator=g)] = -1
    return idx


CASES = [(2, 8, 50, 3, False), (4, 16, 33, 5, True), (3, 9, 0, 2, False), (8, 64, 200, 8, True), (2, 64, 512, 8, False)]


@pytest.mark.parametrize("R,E,T,K,skew", CASES)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_ep_layout_matches_torch(core, R, E, T, K, skew, dtype):
    idx = _routing(T, E, K, R * 100 + T, skew).to(dtype)
    per_rank, per_expert = torch.empty(R, dtype=torch.int32), torch.empty(E, dtype=torch.int32)
    in_rank = torch.empty(T, R, dtype=torch.bool)
    rc = _call(core.ep_layout, "zb_ep_layout", idx=idx.data_ptr(), T=T, K=K, E=E, R=R,
               idx_is_int32=int(dtype == torch.int32), per_rank_out=per_rank.data_ptr(),
               per_expert_out=per_expert.data_ptr(), in_rank_out=in_rank.data_ptr())
    assert rc == -1
    ref = dispatch_layout(idx, E, R)
    assert torch.equal(per_rank, ref[0]) and torch.equal(per_expert, ref[1]) and torch.equal(in_rank, ref[2])


def test_ep_layout_reports_the_first_bad_entry(core):
    idx = torch.zeros(4, 3, dtype=torch.int64)
    idx[2, 1], idx[3, 0] = 8, -2
    out = torch.empty(8, dtype=torch.int32)
    args = dict(idx=idx.data_ptr(), T=4, K=3, E=8, R=2, idx_is_int32=0, per_rank_out=0, per_expert_out=out.data_ptr(),
                in_rank_out=0)
    assert _call(core.ep_layout, "zb_ep_layout", **args) == 2 * 3 + 1
    idx[2, 1] = 7
    assert _call(core.ep_layout, "zb_ep_layout", **args) == 3 * 3 + 0


@pytest.mark.parametrize("R,E,T,K,skew", CASES)
@pytest.mark.parametrize("C", [1, 3, 24])
def test_ep_route_matches_torch(core, R, E, T, K, skew, C):
    _, _, in_rank = dispatch_layout(_routing(T, E, K, R + T + C, skew), E, R)
    counts, tokens = rank_lists(in_rank)
    n = R + E + R * C + int(counts.sum())
    block = torch.full((n,), -7, dtype=torch.int64)
    head = torch.empty(T, R, dtype=torch.int32)
    rc = _call(core.ep_route, "zb_ep_route", in_rank=in_rank.data_ptr(), T=T, R=R, C=C, E=E, meta=block.data_ptr(),
               meta_len=n, head_out=head.data_ptr(), expect=counts.data_ptr())
    assert rc == -1
    assert torch.equal(block[:R], counts)
    assert (block[R:R + E] == -7).all()  # the per-expert counts are the caller's to write
    assert torch.equal(block[R + E:R + E + R * C].view(R, C), channel_prefix(in_rank, C).long())
    assert torch.equal(block[R + E + R * C:], tokens)
    assert torch.equal(head, send_head(in_rank))


def test_ep_route_rejects_wrong_counts_without_writing_past_them(core):
    in_rank = torch.ones(6, 2, dtype=torch.bool)
    wrong = torch.tensor([6, 5])
    block = torch.full((2 + 2 + 11,), -7, dtype=torch.int64)
    head = torch.zeros(6, 2, dtype=torch.int32)
    assert _call(core.ep_route, "zb_ep_route", in_rank=in_rank.data_ptr(), T=6, R=2, C=1, E=0, meta=block.data_ptr(),
                 meta_len=block.numel(), head_out=head.data_ptr(), expect=wrong.data_ptr()) == 1
    assert (block[2:] == -7).all() and (head == 0).all()


def _ll_plan(core, idx: torch.Tensor, E: int):
    T, K = idx.shape
    counts, tokens, slots, err = (torch.full((n,), -7, dtype=torch.int64) for n in (E, T * K, T * K, 2))
    n = _call(core.ep_ll_plan, "zb_ep_ll_plan", T=T, K=K, E=E, idx=idx.data_ptr(), counts_out=counts.data_ptr(),
              tokens_out=tokens.data_ptr(), slots_out=slots.data_ptr(), err_out=err.data_ptr())
    return n, counts, tokens, slots, err


@pytest.mark.parametrize("R,E,T,K,skew", CASES)
def test_ep_ll_plan_matches_torch(core, R, E, T, K, skew):
    """The counting sort gives expert_pairs' pairs in the same order (expert, then token), -1 skipped."""
    idx = _routing(T, E, K, R * 7 + T, skew).contiguous()
    n, counts, tokens, slots, _ = _ll_plan(core, idx, E)
    ref = expert_pairs(idx, E)
    assert n == ref[1].numel()
    assert torch.equal(counts, ref[0]) and torch.equal(tokens[:n], ref[1]) and torch.equal(slots[:n], ref[2])


def test_ep_ll_plan_refuses_bad_entries(core):
    idx = torch.tensor([[0, 1], [2, -1], [3, 3], [9, 0]])
    n, _, _, _, err = _ll_plan(core, idx, 8)
    assert n == -2 and err.tolist() == [2, 3]  # token 2 names expert 3 twice
    idx[2, 1] = 4
    n, _, _, _, err = _ll_plan(core, idx, 8)
    assert n == -1 and err.tolist() == [3, 9]  # token 3: 9 is outside [-1, 8)
    idx[3, 0] = -2
    assert _ll_plan(core, idx, 8)[0] == -1


def test_capabilities_come_from_the_core_once(core):
    from zbccl.ep.caps import Capabilities

    caps = Capabilities.of(core)
    assert caps.ll_pull is core.ep_ll_pull and caps.copy_many is core.copy_many
    with pytest.raises(AttributeError):
        caps.pull = None  # frozen: resolved once, never patched per op


def test_a_core_without_the_ep_kernels_is_a_clear_error():
    from zbccl import ZbcclSystemError
    from zbccl.ep.caps import Capabilities

    with pytest.raises(ZbcclSystemError, match=r"ep: the native core's EP kernels are missing.*zbccl build"):
        Capabilities.of(object())  # what a host without a C compiler has (heap/flags.py's Python stand-in)
