"""Normal dispatch and combine over a group that spans hosts (DeepEP's internode mode).

Protocol (rounds of :mod:`.wire`; ``docs/ep-internode.md``). **Dispatch**:

1. each sender packs, per destination host ``h``, the union of its tokens bound for any rank of
   ``h`` (ascending token index) into one heap send block: one row per token, ``[source token,
   routing mask over h's local ranks, top-k ids, top-k weights, scales, x]`` (:class:`Rows`);
   its header carries the tokens per destination rank, and per host the row count and the part's
   offset;
2. header round: every rank knows every count, so every receiver sizes its outputs exactly. A part
   for another host of up to the eager limit rides in the round, to that host's **forwarder** of the
   sender (``HostWire.forwarder``: the rank of ``h`` with ``s``'s local index);
3. the forwarder of sender ``s`` on host ``h`` leaves an eager part in its slot, or reads a larger one
   in one transfer into its heap staging, then posts where each lies and ``FORWARD``: a token bound for
   several ranks of one host crosses the network once;
4. each receiver copies, by source rank then token, the rows whose mask names it: a source of its
   own host straight from that sender's send block, a remote one from the local forwarder's staging
   (through shm views);
5. no closing round: a rank keeps its send block and staging until the header round of its next op, which
   every peer enters only after it finished this one (so ``x`` may change as soon as dispatch returns:
   it was copied into the send block).

**Combine** is the reverse (:mod:`.internode_combine`).
"""

from __future__ import annotations

import torch

from ..errors import ZbcclRemoteError
from ..native.abi import EP_OP_DISPATCH as OP_DISPATCH
from ..native.abi import ep_args
from ..ops.dtypes import CODE_DTYPES, CODES
from .exchange import HDR_LEN, STATUS_NOMEM, F, Fail
from .fast import _call
from .normal import FLAG_CACHED, FLAG_FP8, FLAG_TOPK, _check_counts, _layout, _split_x, _tensor
from .wire import AUX_OFFS, FAILED

__all__ = ["dispatch", "Rows", "host_parts"]

#: The native receive's argument block (abi.EP_ARGS): head, then one row per source.
_RECV, _RECV_ROW = ep_args("zb_ep_hosts_recv")
_PACK, _ = ep_args("zb_ep_hosts_pack")
_HANDLE, _ = ep_args("zb_ep_hosts_handle")


class Rows:
    """Byte layout of one packed dispatch row: ``[src int64][mask int64][idx K int64][w K float32][scales][x]``."""

    def __init__(self, xrow: int, srow: int, K: int) -> None:
        self.K, self.xrow, self.srow = K, xrow, srow
        self.idx, self.w, self.s, self.x = 16, 16 + 8 * K, 16 + 12 * K, 16 + 12 * K + srow
        self.nbytes = -(-(self.x + xrow) // 8) * 8


def _ptr(t: torch.Tensor | None) -> int:
    return t.data_ptr() if t is not None else 0


def host_parts(w, in_rank: torch.Tensor, layout: Rows, x: torch.Tensor | None = None, scales=None, idx=None, wts=None,
               dst: int = 0) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per host of ``w`` (a :class:`~.wire.HostWire`): ``(tokens [n] int64 ascending, masks [n] int64)``, the tokens
    that ``in_rank`` (bool ``[T, R]``, contiguous) sends to any of its ranks and for each the bits of its local ranks
    (bit ``j``: ``hosts[h][j]``) it goes to, and the rows of all hosts. With ``dst`` (a block of that many ``layout``
    rows) instead, the inputs (contiguous; ``idx`` int64, ``wts`` fp32) packed there, each host's part in host
    order, and no per-host list. One native pass either way (``ep_hosts_pack``)."""
    T, H = in_rank.size(0), w.H
    counts = torch.empty(H, dtype=torch.int64)
    toks = masks = None
    if not dst:
        toks, masks = torch.empty(2, H, T, dtype=torch.int64)
    table = w.host_table.data_ptr()
    a = _PACK(T=T, R=w.R, H=H, in_rank=in_rank.data_ptr(), host_of=table, bit_of=table + 8 * w.R, K=layout.K,
              nbytes=layout.nbytes, idx_at=layout.idx, w_at=layout.w, s_at=layout.s, srow=layout.srow, x_at=layout.x,
              xrow=layout.xrow, x=_ptr(x), s=_ptr(scales), idx=_ptr(idx), w=_ptr(wts), dst=dst,
              counts_out=counts.data_ptr(), toks_out=_ptr(toks), masks_out=_ptr(masks))
    total = _call(w.caps.hosts_pack, a)
    if total < 0:
        raise AssertionError(f"dispatch: a bad host table {w.host_table.tolist()}")  # internal: built by the wire
    if dst:
        return total, []
    return total, [(toks[h, :n], masks[h, :n]) for h, n in enumerate(counts.tolist())]


def _prepare(buf, a: dict, fields: dict, keep: list) -> dict:
    """Local checks, the packed send block and the header vector of a dispatch; raises :class:`Fail`."""
    w, R = buf.wire, buf.wire.R
    if a["error"]:
        raise Fail(a["error"])
    if a["int8"]:
        raise Fail("int8 is not available across hosts, expected int8=False, got True")
    x, scales = _split_x(a["x"])
    T, H = x.shape
    fields.update({F.H: H, F.T: T, F.WORST: a["num_worst_tokens"], F.CHANNELS: a["config"].num_channels})
    handle, extra = a["handle"], None
    if handle is not None:
        if a["topk_idx"] is not None or a["topk_weights"] is not None:
            raise Fail("a cached dispatch (handle given) takes no topk_idx/topk_weights, expected None, got tensors")
        if not isinstance(handle, (tuple, list)) or len(handle) != 10:
            raise Fail(f"handle must be the 10-tuple an internode dispatch returned, got {type(handle).__name__}")
        fields[F.HANDLE], extra = buf.lookup(handle[7], "dispatch")
        in_rank = handle[0]
        if not isinstance(in_rank, torch.Tensor) or in_rank.dtype != torch.bool or in_rank.dim() != 2 \
                or in_rank.size(1) != R:
            raise Fail(f"handle[0] must be the dispatch's is_token_in_rank, expected bool [tokens, {R}], got "
                       f"{getattr(in_rank, 'dtype', type(in_rank).__name__)} {tuple(getattr(in_rank, 'shape', ()))}")
        if in_rank.size(0) != T:
            raise Fail(f"x does not match the handle, expected {in_rank.size(0)} tokens, got {T}")
        rows, valid = handle[7].size(0), int(handle[6][-1])
        fields[F.NRECV], fields[F.WORST] = valid, rows if rows != valid else 0
        fields[F.FLAGS] = FLAG_CACHED
        E, idx, wts, counts = 0, None, None, in_rank.sum(0)
    else:
        in_rank, per_expert, idx, wts, counts = _layout(a, T, R, w.caps, getattr(buf, "layout_memo", None))
        if not torch.equal(in_rank.sum(0), counts.long()):
            raise Fail(f"num_tokens_per_rank does not match is_token_in_rank, expected {in_rank.sum(0).tolist()}, "
                       f"got {counts.tolist()}")
        E = per_expert.numel()
        fields[F.FLAGS] = FLAG_TOPK if idx is not None else 0
    K = idx.size(1) if idx is not None else 0
    srow = scales.size(1) * scales.element_size() if scales is not None else 0
    layout = Rows(H * x.element_size(), srow, K)
    in_rank = in_rank.contiguous()
    n_all, per_host = host_parts(w, in_rank, layout)
    rdma = a.get("num_tokens_per_rdma_rank")
    if rdma is not None and handle is None:
        _tensor(rdma, "num_tokens_per_rdma_rank", 1, (torch.int32, torch.int64), (w.H,))
        if rdma.tolist() != [t.numel() for t, _ in per_host]:
            raise Fail(f"num_tokens_per_rdma_rank does not match is_token_in_rank, expected "
                       f"{[t.numel() for t, _ in per_host]}, got {rdma.tolist()}")
    fields.update({F.E: E, F.K: K, F.DTYPE: CODES[x.dtype], F.XROW: layout.xrow, F.SROW: srow,
                   F.SDTYPE: CODES[scales.dtype] if scales is not None else 0})
    if scales is not None and x.dtype == torch.float8_e4m3fn:
        fields[F.FLAGS] |= FLAG_FP8
    parts: list = [None] * R
    vector = [int(c) for c in counts.tolist()] + _pack_block(buf, layout, in_rank, n_all, per_host, x, scales, idx, wts,
                                                             keep, parts)
    return {"in_rank": in_rank, "per_host": per_host, "rows": layout, "H": H, "out_dtype": x.dtype,
            "cached": handle is not None, "extra": extra, "vector": vector, "parts": parts}


def _pack_block(buf, layout: Rows, in_rank: torch.Tensor, n_all: int, per_host: list, x, scales, idx, wts, keep: list,
                parts: list) -> list[int]:
    """Fill one heap send block with each host's part (``per_host``, ``n_all`` rows in all); returns ``[rows, offset]``
    per host for the header, and puts each other host's part of up to the eager limit in ``parts`` (at that host's
    forwarder of this rank)."""
    w = buf.wire
    block = w.heap_block(n_all * layout.nbytes, "send block")
    keep.append(block)
    host_parts(w, in_rank, layout, x.contiguous(), scales.contiguous() if scales is not None else None,
               idx.long().contiguous() if idx is not None else None, wts.contiguous() if wts is not None else None,
               block.data_ptr())
    base, at, out = w.offset_of(block), 0, []
    for h, (toks, _) in enumerate(per_host):
        n = toks.numel()
        out += [n, base + at]
        if w.rides(w.forwarder(w.me, h), n * layout.nbytes):
            parts[w.forwarder(w.me, h)] = block[at:at + n * layout.nbytes]
        key = "nvl_bytes" if h == w.my_host else "rdma_send_bytes"
        w.stats[key] += n * layout.nbytes
        at += n * layout.nbytes
    return out


def _matrix(rows: torch.Tensor, R: int, H: int) -> tuple[torch.Tensor, list[list[int]], list[list[int]]]:
    """``(counts [R, R] int64 (source, destination), union rows [R][H], part offsets [R][H])`` from the headers."""
    counts = rows[:, HDR_LEN:HDR_LEN + R].clone()
    tail = rows[:, HDR_LEN + R:HDR_LEN + R + 2 * H].tolist()
    unions = [t[0::2] for t in tail]
    offs = [t[1::2] for t in tail]
    bad = [r for r in range(R) if bool((counts[r] < 0).any()) or min(unions[r], default=0) < 0]
    if bad:
        raise ZbcclRemoteError(f"dispatch: rank {bad[0]}'s header holds negative counts, expected counts >= 0",
                               ranks=tuple(bad))
    return counts, unions, offs


def _forward(buf, layout: Rows, unions, offs, header_round: int, keep: list) -> dict[int, torch.Tensor]:
    """The forwarder's part: each remote sender's rows for this host, in this rank's slot (eager) or read (one
    transfer each) into heap staging, then post where they lie and ``FORWARD``; returns the rows per sender
    (group rank -> ``[n, nbytes]``)."""
    w, me, h = buf.wire, buf.wire.me, buf.wire.my_host
    srcs = [s for s in range(w.R) if w.host_of[s] != h and w.forwarder(s, h) == me and unions[s][h] > 0]
    total = sum(unions[s][h] for s in srcs) * layout.nbytes
    staged, where, at = {}, {}, 0
    try:
        for s in srcs:
            nbytes = unions[s][h] * layout.nbytes
            if w.rides(s, nbytes):
                staged[s], where[s] = w.part(s, nbytes).view(-1, layout.nbytes), w.part_offset(s)
    except ZbcclRemoteError:  # a sender that wrote less than its header says: this host's ranks raise too
        w.post_forward(header_round, {}, FAILED)
        raise
    late = [s for s in srcs if s not in staged]
    staging = None
    if late:
        try:
            staging = w.heap_block(sum(unions[s][h] for s in late) * layout.nbytes, "forwarding staging")
        except Fail:
            w.post_forward(header_round, {}, STATUS_NOMEM)
            raise
        keep.append(staging)
    try:
        for s in late:
            nbytes = unions[s][h] * layout.nbytes
            part = staging[at:at + nbytes]
            w.read(s, offs[s][h], nbytes, "dispatch", out=part)
            staged[s], where[s] = part.view(-1, layout.nbytes), w.offset_of(staging) + at
            at += nbytes
    except BaseException:
        w.post_forward(header_round, {}, FAILED)
        raise
    w.stats["rdma_recv_bytes"] += total
    w.stats["rdma_peak_bytes"] = max(w.stats["rdma_peak_bytes"], total)
    w.moved += total
    w.post_forward(header_round, where)
    return staged


def _receive(buf, layout: Rows, counts: torch.Tensor, unions, offs, header_round: int) -> list[tuple[int, int, int, int]]:
    """Where this rank's rows lie, by source rank: per source with rows for it, ``(source, address of its packed
    block (the sender's send block, or the forwarder's slot or staging, on this host), the block's rows, the rows
    of it for this rank)``, each block bounds-checked."""
    w, me, h = buf.wire, buf.wire.me, buf.wire.my_host
    mine = counts[:, me].tolist()
    need = sorted({w.forwarder(s, h) for s in range(w.R) if w.host_of[s] != h and mine[s] > 0})
    aux = w.wait_forward(need, header_round, "dispatch")
    out = []
    for s, want in enumerate(mine):
        if not want:
            continue
        n = unions[s][h]
        if w.host_of[s] == h:
            owner, off = s, offs[s][h]
        else:
            owner = w.forwarder(s, h)
            off = aux[owner][AUX_OFFS + s]
        out.append((s, w.addr(owner, off, n * layout.nbytes, "dispatch"), n, want))
        w.moved += want * layout.nbytes
    return out


def _outputs(buf, rl: list, layout: Rows, sources: list, loc: dict) -> dict:
    """The received rows into exact-size outputs (``num_worst_tokens`` rows when asked): one native pass
    (``ep_hosts_recv``) over the sources' blocks (:func:`_receive`)."""
    w, me = buf.wire, buf.wire.me
    h = rl[me]
    n, K, H = sum(src[3] for src in sources), h[F.K], loc["H"]
    total = h[F.WORST] or n
    out = {"x": w.reuse("recv_x", [((total, H), CODE_DTYPES[h[F.DTYPE]])])[0]}
    s = None
    if h[F.SROW]:
        s = out["s"] = torch.empty(total, h[F.SROW] // 4, dtype=CODE_DTYPES[h[F.SDTYPE]])
    L = h[F.E] // w.R if K else 0
    i = wt = None
    if K:
        i, wt = out["i"], out["w"] = w.reuse("recv_topk", [((total, K), torch.int64), ((total, K), torch.float32)])
    src_idx = out["src_idx"] = torch.empty(total, dtype=torch.int32)
    per_expert = torch.empty(L, dtype=torch.int64)
    err = torch.zeros(1, dtype=torch.int64)
    a = _RECV(nsrc=len(sources), nbytes=layout.nbytes, bit=w.local_index[me], K=K, lo=me * L, L=L, idx_at=layout.idx,
              w_at=layout.w, s_at=layout.s, srow=h[F.SROW], x_at=layout.x, xrow=layout.xrow, n=n, total=total,
              x_dst=out["x"].data_ptr(), s_dst=_ptr(s), i_dst=_ptr(i), w_dst=_ptr(wt), src_dst=src_idx.data_ptr(),
              per_expert_out=per_expert.data_ptr(), err_out=err.data_ptr())
    for _, blk, rows, want in sources:
        a += _RECV_ROW(blk=blk, nrows=rows, want=want)
    got = _call(w.caps.hosts_recv, a)
    if got < 0:
        s_bad, want = sources[-got - 1][0], sources[-got - 1][3]
        raise ZbcclRemoteError(f"dispatch: rank {s_bad}'s rows disagree with its header, expected {want} rows for "
                               f"rank {me}, got {int(err[0]) if int(err[0]) <= want else 'more'}", ranks=(s_bad,))
    if K:
        out["per_expert"] = per_expert.tolist()
    return out


def dispatch(buf, a: dict):
    """Normal dispatch across hosts (see :meth:`zbccl.ep.Buffer.dispatch`; the handle is DeepEP's internode 10-tuple)."""
    w = buf.wire
    for key in ("rdma_send_bytes", "rdma_recv_bytes", "nvl_bytes"):
        w.stats[key] = 0
    fields, keep, fail, loc = {F.OP: OP_DISPATCH, F.SEQ: buf.seq}, [], None, None
    try:
        loc = _prepare(buf, a, fields, keep)
    except Fail as exc:
        fail = exc
    rows = w.publish("dispatch", fields, loc["vector"] if loc else [], fail, loc["parts"] if loc else None)
    header_round = w.round
    rl = rows.tolist()
    w.agree("dispatch", rl, ((F.OP, "the op"), (F.FLAGS, "the mode (cached, fp8, top-k)"), (F.E, "num_experts"),
                             (F.H, "the hidden size"), (F.DTYPE, "x's dtype"),
                             (F.SDTYPE, "the scales' dtype (0: no scales)"),
                             (F.SROW, "the scales' row width in bytes (0: no scales)"), (F.K, "num_topk"),
                             (F.HANDLE, "the handle (from which dispatch)"), (F.CHANNELS, "config.num_sms")))
    counts, unions, offs = _matrix(rows, w.R, w.H)
    _check_counts(rl, counts)
    layout = loc["rows"]
    try:
        staged = _forward(buf, layout, unions, offs, header_round, keep)
        got = _receive(buf, layout, counts, unions, offs, header_round)
        out = _outputs(buf, rl, layout, got, loc)
        fwd_masks = {s: rows_s.view(torch.int64)[:, 1].clone() for s, rows_s in staged.items()}
    finally:
        w.hold(keep)  # no closing round: peers read the send block and staging until the next op's header round
    recv_x = (out["x"], out["s"]) if "s" in out else out["x"]
    if loc["cached"]:
        return recv_x, None, None, None, None
    align = a["expert_alignment"]
    lst = [] if a["num_worst_tokens"] else [-(-c // align) * align for c in out.get("per_expert", [])]
    handle = handle_fields(w, loc["in_rank"], counts, out["src_idx"], [r[F.T] for r in rl], a["config"].num_channels)
    # what a combine with this handle needs of the dispatch: the counts (and their prefix over sources), the rows
    # this rank forwarded, and its own tokens per host
    buf.register(handle[7], {"counts": counts, "upto": counts.numpy().cumsum(0), "fwd": fwd_masks,
                             "per_host": loc["per_host"]})
    return recv_x, out.get("i"), out.get("w"), lst, handle


def handle_fields(w, in_rank: torch.Tensor, counts: torch.Tensor, src_idx: torch.Tensor, T_of: list[int],
                  C: int) -> tuple:
    """DeepEP's internode handle: ``(is_token_in_rank, rdma_channel_prefix_matrix [H, C],
    gbl_channel_prefix_matrix [R, C], recv_rdma_channel_prefix_matrix [H, C], recv_rdma_rank_prefix_sum [H],
    recv_gbl_channel_prefix_matrix [R, C], recv_gbl_rank_prefix_sum [R], recv_src_idx [rows] int32,
    send_rdma_head [T, H], send_nvl_head [T, R])`` (``docs/ep-internode.md`` defines each here), from the sender's
    routing ``in_rank`` ``[T, R]`` (bool, contiguous), the op's ``counts`` ``[R, R]`` (source, destination), this
    rank's received source tokens ``src_idx`` and every sender's token count ``T_of``, over the hosts of ``w`` (a
    :class:`~.wire.HostWire`): one native pass (``ep_hosts_handle``)."""
    R, H, T = w.R, w.H, in_rank.size(0)
    i32 = torch.int32
    out = [torch.empty(H, C, dtype=i32), torch.empty(R, C, dtype=i32), torch.empty(H, C, dtype=i32),
           torch.empty(H, dtype=i32), torch.empty(R, C, dtype=i32), torch.empty(R, dtype=i32),
           torch.empty(T, H, dtype=i32), torch.empty(T, R, dtype=i32)]
    counts = counts.contiguous()
    T_of_t = torch.tensor(T_of, dtype=torch.int64)
    scratch = torch.empty(R * C, dtype=torch.int64)
    a = _HANDLE(T=T, R=R, H=H, C=C, me=w.me, in_rank=in_rank.data_ptr(), host_of=w.host_table.data_ptr(),
                counts=counts.data_ptr(), src_idx=src_idx.data_ptr(), T_of=T_of_t.data_ptr(), scratch=scratch.data_ptr(),
                rdma_chan_out=out[0].data_ptr(), gbl_chan_out=out[1].data_ptr(), recv_rdma_chan_out=out[2].data_ptr(),
                recv_rdma_rank_out=out[3].data_ptr(), recv_gbl_chan_out=out[4].data_ptr(),
                recv_gbl_rank_out=out[5].data_ptr(), rdma_head_out=out[6].data_ptr(), nvl_head_out=out[7].data_ptr())
    rc = _call(w.caps.hosts_handle, a)
    if rc < -1:
        raise ZbcclRemoteError(f"dispatch: rank {-rc - 2} sent a row with a negative source token, expected tokens >= 0",
                               ranks=(-rc - 2,))
    if rc != 0:
        raise AssertionError(f"dispatch: the handle kernel refused R={R}, H={H}, C={C}")  # internal: checked before
    return (in_rank, *out[:6], src_idx, out[6], out[7])
