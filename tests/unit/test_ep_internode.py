"""Pure logic of EP across hosts: the per-host token unions and masks, the packed dispatch row, and DeepEP's
internode handle (numpy inside) against its definitions in torch."""

from __future__ import annotations

import pytest
import torch

from zbccl.ep.internode import Rows, handle_fields, host_layout
from zbccl.ep.reference import channel_prefix, send_head


def test_host_layout_is_the_union_per_host_with_local_rank_bits():
    g = torch.Generator().manual_seed(7)
    in_rank = torch.rand(50, 5, generator=g) < 0.3
    hosts = [[0, 1], [2, 3, 4]]
    for h, (toks, masks) in enumerate(host_layout(in_rank, hosts)):
        want = [t for t in range(50) if any(in_rank[t, r] for r in hosts[h])]
        assert toks.tolist() == want
        for t, m in zip(toks.tolist(), masks.tolist()):
            assert m == sum(1 << j for j, r in enumerate(hosts[h]) if in_rank[t, r])
    empty = host_layout(torch.zeros(0, 5, dtype=torch.bool), hosts)
    assert all(t.numel() == 0 and m.numel() == 0 for t, m in empty)


def test_rows_pack_places_every_field_at_its_offset():
    T, H, K = 6, 10, 3  # 10 fp8 bytes: the row is padded to 8 bytes
    x = torch.arange(T * H, dtype=torch.uint8).view(T, H).view(torch.float8_e4m3fn)
    scales = torch.rand(T, 2)
    idx = torch.randint(-1, 9, (T, K))
    w = torch.rand(T, K)
    rows = Rows(H, 8, K)
    assert rows.nbytes % 8 == 0 and rows.nbytes >= 16 + 12 * K + 8 + H
    packed = torch.from_numpy(rows.pack(x, scales, idx, w))
    assert packed.shape == (T, rows.nbytes)
    as64 = packed[:, :16].contiguous().view(torch.int64)
    assert as64[:, 0].tolist() == list(range(T)) and as64[:, 1].tolist() == [0] * T
    assert torch.equal(packed[:, rows.idx:rows.idx + 8 * K].contiguous().view(torch.int64), idx)
    assert torch.equal(packed[:, rows.w:rows.w + 4 * K].contiguous().view(torch.float32), w)
    assert torch.equal(packed[:, rows.s:rows.s + 8].contiguous().view(torch.float32), scales)
    assert torch.equal(packed[:, rows.x:rows.x + H], x.view(torch.uint8))
    assert rows.pack(x[:0], scales[:0], idx[:0], w[:0]).shape == (0, rows.nbytes)


HOSTS = [[0, 1], [2, 3]]
HOST_OF = [0, 0, 1, 1]


def _torch_handle(in_rank, counts, src_idx, T_of, C, me):
    """The fields as docs/ep-internode.md defines them, in torch."""
    R = len(HOST_OF)
    in_host = torch.stack([in_rank[:, r].any(1) for r in HOSTS], 1)
    mine = counts[:, me]
    n = int(mine.sum())
    src = src_idx[:n].long()
    owner = torch.repeat_interleave(torch.arange(R), mine)
    per = torch.tensor([max(-(-t // C), 1) for t in T_of])
    chan = (src // per[owner]).clamp(max=C - 1)
    by_chan = torch.zeros(R, C, dtype=torch.int64)
    by_chan.index_put_((owner, chan), torch.ones(n, dtype=torch.int64), accumulate=True)
    host_sum = torch.zeros(len(HOSTS), C, dtype=torch.int64).index_add_(0, torch.tensor(HOST_OF), by_chan)
    return (in_rank, channel_prefix(in_host, C), channel_prefix(in_rank, C), host_sum.cumsum(1).to(torch.int32),
            host_sum.sum(1).cumsum(0).to(torch.int32), (by_chan.cumsum(1) - by_chan).to(torch.int32),
            mine.cumsum(0).to(torch.int32), src_idx, send_head(in_host), send_head(in_rank))


@pytest.mark.parametrize("T", [0, 1, 31, 512])
@pytest.mark.parametrize("C", [1, 6, 20])
def test_handle_fields_match_their_definitions(T, C):
    g = torch.Generator().manual_seed(T * 97 + C)
    me, R = 1, len(HOST_OF)
    in_rank = torch.rand(T, R, generator=g) < 0.4
    T_of = [T, T + 3, max(T - 5, 0), 17]
    counts = torch.tensor([[int(torch.randint(0, t + 1, (1,), generator=g)) for _ in range(R)] for t in T_of])
    src_idx = torch.cat([torch.sort(torch.randperm(T_of[s], generator=g)[:int(counts[s, me])]).values
                         for s in range(R)]).to(torch.int32)
    got = handle_fields(in_rank, HOSTS, HOST_OF, me, counts, src_idx, T_of, C)
    want = _torch_handle(in_rank, counts, src_idx, T_of, C, me)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (i, a, b)
