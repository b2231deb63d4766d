"""Pure logic of EP across hosts: the per-host token unions and masks, and the packed dispatch row."""

from __future__ import annotations

import torch

from zbccl.ep.internode import Rows, host_layout


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
    packed = rows.pack(x, scales, idx, w)
    assert packed.shape == (T, rows.nbytes)
    as64 = packed[:, :16].contiguous().view(torch.int64)
    assert as64[:, 0].tolist() == list(range(T)) and as64[:, 1].tolist() == [0] * T
    assert torch.equal(packed[:, rows.idx:rows.idx + 8 * K].contiguous().view(torch.int64), idx)
    assert torch.equal(packed[:, rows.w:rows.w + 4 * K].contiguous().view(torch.float32), w)
    assert torch.equal(packed[:, rows.s:rows.s + 8].contiguous().view(torch.float32), scales)
    assert torch.equal(packed[:, rows.x:rows.x + H], x.view(torch.uint8))
    assert rows.pack(x[:0], scales[:0], idx[:0], w[:0]).shape == (0, rows.nbytes)
