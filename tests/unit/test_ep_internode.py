"""The native local steps of EP across hosts against their definitions in torch: the per-host token unions and
masks, the packed dispatch rows, the receive, DeepEP's internode handle and the low-latency receive, and their
refusals of blocks that disagree with their senders' headers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from zbccl.ep.internode import Rows, handle_fields, host_parts
from zbccl.ep.reference import channel_prefix, send_head
from zbccl.ops.dtypes import CODES


def _pack_rows(rows: Rows, x, scales, idx, w) -> torch.Tensor:
    """Every token's packed row, by its definition (internode.Rows), the mask word zero."""
    T = x.size(0)
    out = torch.zeros(T, rows.nbytes, dtype=torch.uint8)
    out[:, :8] = torch.arange(T, dtype=torch.int64).view(T, 1).view(torch.uint8)
    for t, at in ((idx, rows.idx), (w, rows.w), (scales, rows.s), (x, rows.x)):
        if t is not None and t.numel():
            cols = t.contiguous().view(T, -1).view(torch.uint8)
            out[:, at:at + cols.size(1)] = cols
    return out


class _Hosts:
    """What the pack and the receive read of a HostWire (outputs in plain memory, each followed by a canary row)."""

    def __init__(self, hosts: list[list[int]], me: int = 0):
        from zbccl import native
        from zbccl.ep.caps import Capabilities

        self.hosts, self.me, self.R, self.H = hosts, me, sum(map(len, hosts)), len(hosts)
        self.local_index = [0] * self.R
        host_of = [0] * self.R
        for h, ranks in enumerate(hosts):
            for j, r in enumerate(ranks):
                host_of[r], self.local_index[r] = h, j
        self.host_table = torch.tensor([host_of, self.local_index], dtype=torch.int64)
        self.caps = Capabilities.of(native.core())
        self.blocks = []

    def reuse(self, role, specs):
        out = []
        for shape, dtype in specs:
            block = torch.full((shape[0] + 1, *shape[1:]), 7, dtype=dtype)  # the last row: a canary
            self.blocks.append(block)
            out.append(block[:shape[0]])
        return out


def test_host_parts_are_the_union_per_host_with_local_rank_bits():
    g = torch.Generator().manual_seed(7)
    in_rank = torch.rand(50, 5, generator=g) < 0.3
    hosts = [[0, 1], [2, 3, 4]]
    wire = _Hosts(hosts)
    total, parts = host_parts(wire, in_rank, Rows(8, 0, 0))
    for h, (toks, masks) in enumerate(parts):
        want = [t for t in range(50) if any(in_rank[t, r] for r in hosts[h])]
        assert toks.tolist() == want
        for t, m in zip(toks.tolist(), masks.tolist()):
            assert m == sum(1 << j for j, r in enumerate(hosts[h]) if in_rank[t, r])
    assert total == sum(t.numel() for t, _ in parts)
    total, empty = host_parts(wire, torch.zeros(0, 5, dtype=torch.bool), Rows(8, 0, 0))
    assert total == 0 and all(t.numel() == 0 and m.numel() == 0 for t, m in empty)


@pytest.mark.parametrize("K,srow", [(3, 8), (0, 0)])
def test_native_pack_places_every_field_of_each_hosts_tokens(K, srow):
    """Each host's part: its tokens' rows in order, every field at its offset, the mask word set, padding zero."""
    T, H = 23, 10  # 10 fp8 bytes: the row is padded to 8 bytes
    g = torch.Generator().manual_seed(K)
    x = torch.randint(0, 255, (T, H), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    scales = torch.rand(T, srow // 4, generator=g) if srow else None
    idx = torch.randint(-1, 9, (T, K), generator=g) if K else None
    w = torch.rand(T, K, generator=g) if K else None
    rows = Rows(H, srow, K)
    assert rows.nbytes % 8 == 0 and rows.nbytes >= 16 + 12 * K + srow + H
    wire = _Hosts([[0], [1, 2]])
    in_rank = torch.rand(T, 3, generator=g) < 0.5
    total, parts = host_parts(wire, in_rank, rows)
    block = torch.full((total + 1, rows.nbytes), 0xAB, dtype=torch.uint8)  # the last row: a canary
    assert host_parts(wire, in_rank, rows, x, scales, idx, w, block.data_ptr())[0] == total
    full, at = _pack_rows(rows, x, scales, idx, w), 0
    for toks, masks in parts:
        want = full[toks].clone()
        want[:, 8:16] = masks.view(-1, 1).view(torch.uint8)
        assert torch.equal(block[at:at + toks.numel()], want)
        at += toks.numel()
    assert bool((block[-1] == 0xAB).all())


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
    got = handle_fields(_Hosts(HOSTS, me), in_rank, counts, src_idx, T_of, C)
    want = _torch_handle(in_rank, counts, src_idx, T_of, C, me)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (i, a, b)


def test_handle_fields_refuse_a_negative_source_token():
    """A sender's row whose source token is negative (a corrupt or hostile peer): an error naming it, never a count
    outside the handle's channels."""
    from zbccl.errors import ZbcclRemoteError

    counts = torch.tensor([[2, 1, 0, 0], [1, 3, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]])
    src_idx = torch.tensor([0, 5, -4, 2], dtype=torch.int32)  # rank 1 (3 rows for rank 1 after rank 0's 1): -4
    with pytest.raises(ZbcclRemoteError, match="rank 1 sent a row with a negative source token") as exc:
        handle_fields(_Hosts(HOSTS, 1), torch.ones(3, 4, dtype=torch.bool), counts, src_idx, [3, 6, 0, 0], 4)
    assert exc.value.ranks == (1,)


def _word(b: torch.Tensor, at: int) -> torch.Tensor:
    """Column ``[at, at + 8)`` of packed rows ``b`` as int64, a writable view."""
    return torch.from_numpy(b.numpy()[:, at:at + 8].view(np.int64)[:, 0])


def _sources(seed: int, K: int, H: int, srow: int, bits: int = 2):
    """Three senders' packed blocks: rows of tokens f(source, token), each with a random routing mask."""
    g = torch.Generator().manual_seed(seed)
    rows = Rows(H * 2, srow, K)
    blocks = []
    for s, T in enumerate((9, 0, 14)):
        x = (torch.arange(T * H).view(T, H) + 1000 * s).to(torch.bfloat16)
        scales = torch.rand(T, srow // 4, generator=g) if srow else None
        idx = torch.randint(-1, 16, (T, K), generator=g) if K else None
        w = torch.rand(T, K, generator=g) if K else None
        packed = _pack_rows(rows, x, scales, idx, w)
        _word(packed, 0)[:] = torch.arange(T) * 3 + s  # the source token
        _word(packed, 8)[:] = torch.randint(0, 1 << bits, (T,), generator=g)
        blocks.append(packed)
    return rows, blocks


@pytest.mark.parametrize("K,srow,worst", [(3, 0, 0), (0, 8, 0), (4, 16, 40)])
def test_native_receive_takes_the_rows_whose_mask_names_this_rank(K, srow, worst):
    """``ep_hosts_recv`` against torch: each source's rows for this rank's bit, in order, with the top-k ids as local
    experts (-1 elsewhere) and their weights (0 elsewhere), counted per local expert; rows past n padded."""
    from zbccl.ep import internode
    from zbccl.ep.exchange import F

    me, R, E, H = 1, 4, 16, 8
    L, bit = E // R, 1
    rows, blocks = _sources(K * 10 + srow, K, H, srow)
    want = [int(((_word(b, 8) >> bit) & 1).sum()) for b in blocks]
    n = sum(want)
    sources = [(s, b.data_ptr(), b.size(0), want[s]) for s, b in enumerate(blocks) if want[s]]
    head = [0] * 64
    head[F.K], head[F.E], head[F.WORST], head[F.SROW] = K, E if K else 0, worst, srow
    head[F.DTYPE], head[F.SDTYPE] = CODES[torch.bfloat16], CODES[torch.float32]
    buf = type("Buf", (), {})()
    buf.wire = _Hosts([[0, 1], [2, 3]], me)
    out = internode._outputs(buf, [None, head], rows, sources, {"H": H})
    sel = torch.cat([b[((_word(b, 8) >> bit) & 1).bool()] for b in blocks])
    total = worst or n
    assert out["x"].shape == (total, H) and torch.equal(out["x"][:n].view(torch.uint8),
                                                          sel[:, rows.x:rows.x + 2 * H])
    assert out["src_idx"].tolist() == _word(sel, 0).tolist() + [-1] * (total - n)
    if srow:
        assert torch.equal(out["s"][:n].view(torch.uint8), sel[:, rows.s:rows.s + srow])
    if K:
        ids = sel[:, rows.idx:rows.idx + 8 * K].contiguous().view(torch.int64)
        ws = sel[:, rows.w:rows.w + 4 * K].contiguous().view(torch.float32)
        local = (ids >= me * L) & (ids < (me + 1) * L)
        assert torch.equal(out["i"][:n], torch.where(local, ids - me * L, -1))
        assert torch.equal(out["w"][:n], torch.where(local, ws, 0.0))
        assert bool((out["i"][n:] == -1).all()) and bool((out["w"][n:] == 0).all())
        assert out["per_expert"] == torch.bincount(out["i"][:n][out["i"][:n] >= 0], minlength=L).tolist()
    assert all(bool((b[-1] == 7).all()) for b in buf.wire.blocks)  # nothing written past an output


@pytest.mark.parametrize("delta", [-1, 1])
def test_native_receive_refuses_a_block_that_disagrees_with_its_header(delta):
    """A sender whose block holds more (or fewer) rows for this rank than its header says: an error naming it, and
    never a write past the outputs sized from the headers."""
    from zbccl.ep import internode
    from zbccl.ep.exchange import F
    from zbccl.errors import ZbcclRemoteError

    K, H, bit = 2, 8, 0
    rows, blocks = _sources(5, K, H, 0, bits=1)
    _word(blocks[2], 8)[:] = 1  # every row of source 2 is for this rank
    want = [int(((_word(b, 8) >> bit) & 1).sum()) for b in blocks]
    want[2] -= delta  # its header says one row fewer (delta 1) or more (delta -1)
    sources = [(s, b.data_ptr(), b.size(0), want[s]) for s, b in enumerate(blocks) if want[s]]
    head = [0] * 64
    head[F.K], head[F.E], head[F.DTYPE] = K, 8, CODES[torch.bfloat16]
    buf = type("Buf", (), {})()
    buf.wire = _Hosts([[0], [1]], 0)
    with pytest.raises(ZbcclRemoteError, match="rank 2's rows disagree with its header") as exc:
        internode._outputs(buf, [head, None], rows, sources, {"H": H})
    assert exc.value.ranks == (2,)
    assert all(bool((b[-1] == 7).all()) for b in buf.wire.blocks)


def _ll_part(counts: list[int], s: int, xrow: int, srow: int) -> torch.Tensor:
    """A low-latency part: the per-expert counts, then one row per pair ``[token][scales][x]`` = f(source, row)."""
    n, row = sum(counts), 8 + srow + xrow
    rows = (torch.arange(n * row, dtype=torch.int64).view(n, row) * 7 + 100 * s).remainder(251).to(torch.uint8)
    rows[:, :8] = (torch.arange(n, dtype=torch.int64) * 10 + s).view(n, 1).view(torch.uint8)
    return torch.cat([torch.tensor(counts, dtype=torch.int64).view(torch.uint8), rows.flatten()])


def _ll_recv(parts: list, L: int, N: int, xrow: int, srow: int, dropped: int = 0):
    from zbccl import native
    from zbccl.ep.fast import _call
    from zbccl.native import abi

    head, row = abi.ep_args("zb_ep_hosts_ll_recv")
    out = {"x": torch.zeros(L, N, xrow, dtype=torch.uint8), "info": torch.full((L, N), -1, dtype=torch.int32),
           "s": torch.zeros(L, srow // 4, N, dtype=torch.float32).transpose(1, 2),
           "layout": torch.zeros(L, len(parts), dtype=torch.int64), "count": torch.zeros(L, dtype=torch.int32),
           "err": torch.zeros(2, dtype=torch.int64)}
    st = out["s"].stride()
    vals = head(nsrc=len(parts), L=L, N=N, xrow=xrow, srow=srow, x_dst=out["x"].data_ptr(),
                info_dst=out["info"].data_ptr(), s_dst=out["s"].data_ptr(), s_le=st[0], s_slot=st[1], s_j=st[2],
                layout_out=out["layout"].data_ptr(), count_out=out["count"].data_ptr(), err_out=out["err"].data_ptr())
    for s, (p, n) in enumerate(parts):
        vals += row(raw=p.data_ptr() if p is not None else 0, n=n, row=8 + srow + xrow, dropped=(dropped >> s) & 1)
    return _call(native.core().ep_hosts_ll_recv, vals), out


def test_native_low_latency_receive_places_each_sources_rows_per_expert():
    """``ep_hosts_ll_recv``: source by source, each expert's rows after the earlier sources' (layout begin << 32 |
    count), the token, scales (a transposed layout) and x of each; a masked source's rows skipped."""
    L, N, xrow, srow = 3, 8, 16, 8
    counts = [[2, 0, 1], [1, 3, 0], [0, 0, 0]]
    parts = [(_ll_part(c, s, xrow, srow), sum(c)) for s, c in enumerate(counts)]
    parts[2] = (None, 0)
    for dropped in (0, 2):
        rc, out = _ll_recv(parts, L, N, xrow, srow, dropped)
        assert rc == 0
        begin = [0] * L
        for s, c in enumerate(counts):
            rows = parts[s][0][8 * L:].view(-1, 8 + srow + xrow) if parts[s][0] is not None else None
            at = 0
            for e in range(L):
                take = 0 if (dropped >> s) & 1 else c[e]
                assert int(out["layout"][e, s]) == begin[e] << 32 | take
                for i in range(take):
                    r, slot = rows[at + i], begin[e] + i
                    assert int(out["info"][e, slot]) == int(r[:8].view(torch.int64))
                    assert torch.equal(out["x"][e, slot], r[8 + srow:])
                    assert torch.equal(out["s"][e, slot].contiguous().view(torch.uint8), r[8:8 + srow])
                begin[e] += take
                at += c[e]
        assert out["count"].tolist() == begin


@pytest.mark.parametrize("counts,kind", [([2, -1, 1], 1), ([1, 0, 0], 1), ([9, 0, 0], 2)])
def test_native_low_latency_receive_refuses_a_bad_part(counts, kind):
    """Counts that are negative or do not add up to the header's rows name their source; an expert given more rows
    than its slots is refused, naming its source."""
    L, N, xrow = 3, 8, 16
    good = _ll_part([1, 0, 0], 0, xrow, 0)
    n = 2 if kind == 1 else 9  # the rows its header says
    bad = _ll_part([n, 0, 0], 1, xrow, 0)
    bad[:8 * L] = torch.tensor(counts, dtype=torch.int64).view(torch.uint8)
    rc, out = _ll_recv([(good, 1), (bad, n)], L, N, xrow, 0)
    assert rc == -2 and int(out["err"][0]) == kind
