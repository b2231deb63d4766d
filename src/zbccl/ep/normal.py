"""Normal (high-throughput) dispatch and combine: exact-size receive, rows pulled from peers.

Protocol (see :mod:`.exchange`): each sender publishes its per-destination token lists
(ascending token index), its counts per rank, per expert and per channel, and the heap
offsets of ``x`` (and scales, top-k, weights), staged only when they are not heap tensors.
After the header all_gather every receiver knows the whole ``[R, R]`` count matrix, allocates
``recv_x`` with exactly ``sum_src count[src][me]`` rows in its heap (``num_worst_tokens`` rows
when asked), and copies its rows straight from each sender's ``x``: by source rank, then
source token (DeepEP's order). A barrier ends the op: then senders may reuse ``x``.

Combine is the reverse pull: each original sender reads, for each rank ``r`` it sent to, the
contiguous block of ``r``'s combine input that holds its tokens (block start from the
handle's ``rank_prefix_matrix``) straight from ``r``'s heap, and sums the rows per token in
fp32. Bytes moved per step: dispatch moves ``num_recv * row`` per receiver, combine the same
back; nothing is copied twice unless an operand had to be staged.
"""

from __future__ import annotations

import torch

from ..errors import ZbcclInvalidUsageError
from . import fast
from .exchange import F, Fail, heap_empty, row_runs, row_table
from .layout import channel_prefix, int8_dequantize, int8_quantize, rank_lists, send_head

__all__ = ["dispatch", "combine", "DTYPE_CODES", "OP_DISPATCH", "OP_COMBINE"]

OP_DISPATCH, OP_COMBINE = 1, 2
FLAG_FP8, FLAG_TOPK, FLAG_CACHED, FLAG_INT8 = 1, 2, 4, 8
DTYPE_CODES = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3, torch.float8_e4m3fn: 4}
_CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}


def _tensor(t, name: str, dims: int, dtypes: tuple, shape: tuple | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise Fail(f"{name} must be a tensor, got {type(t).__name__}")
    if t.device.type != "cpu" or t.layout != torch.strided:
        raise Fail(f"{name} must be a strided CPU tensor, got {t.device.type} {t.layout}")
    if t.dim() != dims:
        raise Fail(f"{name} has the wrong rank, expected {dims} dims, got shape {list(t.shape)}")
    if t.dtype not in dtypes:
        raise Fail(f"{name} has the wrong dtype, expected one of {[str(d) for d in dtypes]}, got {t.dtype}")
    if shape is not None:
        for want, got in zip(shape, t.shape):
            if want is not None and want != got:
                raise Fail(f"{name} has the wrong shape, expected {list(shape)} (None: any), got {list(t.shape)}")
    return t


def _split_x(x) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(x, tuple):
        if len(x) != 2:
            raise Fail(f"x must be a tensor or a (x_fp8, scales) pair, got a tuple of {len(x)}")
        xq = _tensor(x[0], "x[0]", 2, (torch.float8_e4m3fn,))
        # DeepEP treats the scales as opaque per-token rows of any width (per-128 blocks are the usual case).
        s = _tensor(x[1], "x[1] (scales)", 2, (torch.float32, torch.int32), (xq.size(0), None))
        return xq, s
    return _tensor(x, "x", 2, (torch.bfloat16, torch.float16, torch.float32)), None


def _check_topk(topk_idx, topk_weights, T: int, E: int, prims=None, known: torch.Tensor | None = None):
    """Checked ``(topk_idx int64, topk_weights, num_tokens_per_expert [E] int32 when prims has the native
    kernels, else None)``; ``known``: those counts, already computed from this unchanged ``topk_idx``
    (range checked then), so the pass over ``topk_idx`` is skipped."""
    if (topk_idx is None) != (topk_weights is None):
        raise Fail("topk_idx and topk_weights go together, expected both or neither, got one")
    idx = _tensor(topk_idx, "topk_idx", 2, (torch.int64, torch.int32), (T, None))
    K = idx.size(1)
    w = _tensor(topk_weights, "topk_weights", 2, (torch.float32,), (T, K))
    per_expert = None
    if known is not None:
        return idx.long(), w, known
    if fast.available(prims):
        got = fast.layout(prims, idx, E, 1, in_rank=False)
        per_expert = got[1] if got is not None else None
        bad = got is None
    else:
        bad = idx.numel() and (int(idx.min()) < -1 or int(idx.max()) >= E)
    if bad:
        raise Fail(f"topk_idx out of range, expected -1 or [0, {E}), got values in [{int(idx.min())}, {int(idx.max())}]")
    return idx.long(), w, per_expert


def _memo_counts(memo, topk_idx, ntpe) -> torch.Tensor | None:
    """``num_tokens_per_expert`` when it is, unchanged, what :meth:`Buffer.get_dispatch_layout` computed from
    this very ``topk_idx``, itself unchanged since (in-place writes bump a tensor's version); else None."""
    if memo is None or topk_idx is not memo[0] or ntpe is not memo[2]:
        return None
    if topk_idx._version != memo[1] or ntpe._version != memo[3] or topk_idx.data_ptr() != memo[4]:
        return None
    return ntpe


def _layout(a: dict, T: int, R: int, prims, memo=None):
    """Checked ``(is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights, tokens per rank)`` of a
    non-cached dispatch (``memo``: the Buffer's last native layout, see :func:`_memo_counts`)."""
    for name in ("num_tokens_per_rank", "is_token_in_rank", "num_tokens_per_expert"):
        if a[name] is None:
            raise Fail(f"{name} is required without a handle, expected a tensor, got None")
    ntpr = _tensor(a["num_tokens_per_rank"], "num_tokens_per_rank", 1, (torch.int32, torch.int64), (R,))
    in_rank = _tensor(a["is_token_in_rank"], "is_token_in_rank", 2, (torch.bool,), (T, R))
    ntpe = _tensor(a["num_tokens_per_expert"], "num_tokens_per_expert", 1, (torch.int32, torch.int64))
    E = ntpe.numel()
    if E == 0 or E % R:
        raise Fail(f"num_experts must be a positive multiple of the {R} ranks, got {E}")
    idx = w = None
    if a["topk_idx"] is not None or a["topk_weights"] is not None:
        known = _memo_counts(memo, a["topk_idx"], ntpe) if fast.available(prims) else None
        idx, w, got = _check_topk(a["topk_idx"], a["topk_weights"], T, E, prims, known)
        if got is None:
            got = torch.bincount(idx.reshape(-1) + 1, minlength=E + 1)[1:]
        if known is None and not torch.equal(got, ntpe.to(got.dtype)):
            raise Fail("num_tokens_per_expert does not match topk_idx, expected get_dispatch_layout's counts")
    elif a["num_worst_tokens"]:
        raise Fail("num_worst_tokens needs topk_idx and topk_weights, got neither")
    if a["expert_alignment"] < 1:
        raise Fail(f"expert_alignment must be >= 1, got {a['expert_alignment']}")
    if not fast.available(prims):  # the native plan checks it (fast.route)
        counts = in_rank.sum(0)
        if not torch.equal(counts, ntpr.long()):
            raise Fail(f"num_tokens_per_rank does not match is_token_in_rank, expected {counts.tolist()}, "
                       f"got {ntpr.tolist()}")
    return in_rank, ntpe.long(), idx, w, ntpr


def _prepare(buf, a: dict, fields: dict, keep: list) -> dict:
    """Local checks, plan and published blocks of a dispatch; raises :class:`Fail`."""
    ex, R = buf.ex, buf.ex.R
    if a["error"]:
        raise Fail(a["error"])
    x, scales = _split_x(a["x"])
    T, H = x.shape
    fields.update({F.H: H, F.T: T, F.WORST: a["num_worst_tokens"], F.CHANNELS: a["config"].num_channels})
    handle = a["handle"]
    if handle is not None:
        if a["topk_idx"] is not None or a["topk_weights"] is not None:
            raise Fail("a cached dispatch (handle given) takes no topk_idx/topk_weights, expected None, got tensors")
        fields[F.HANDLE] = buf.handle_seq(handle, "dispatch")
        in_rank = handle[4]
        if in_rank.shape != (T, R):
            raise Fail(f"x does not match the handle, expected {in_rank.size(0)} tokens, got {T}")
        # A handle from a num_worst_tokens dispatch has num_worst rows (DeepEP's recv_src_idx); the valid
        # ones are rank_prefix_matrix's last row. A cached dispatch returns as many rows as the handle.
        rows, valid = handle[3].size(0), int(handle[0][-1, ex.me])
        if rows < valid:
            raise Fail(f"the handle is inconsistent, expected >= {valid} rows in handle[3], got {rows}")
        fields[F.NRECV], fields[F.WORST] = valid, rows if rows != valid else 0
        fields[F.FLAGS] = FLAG_CACHED
        E, per_expert, idx, w = 0, torch.zeros(0, dtype=torch.int64), None, None
        counts = in_rank.sum(0)
    else:
        in_rank, per_expert, idx, w, counts = _layout(a, T, R, ex.prims, getattr(buf, "layout_memo", None))
        E = per_expert.numel()
        fields[F.FLAGS] = FLAG_TOPK if idx is not None else 0
    head = None
    if fast.available(ex.prims):
        fields[F.META], fields[F.NROWS], chan, head = fast.route(buf, in_rank, counts, per_expert,
                                                                 a["config"].num_channels)
    else:
        counts, tokens = rank_lists(in_rank)
        chan = channel_prefix(in_rank, a["config"].num_channels)
        meta = torch.cat([counts, per_expert, chan.long().flatten(), tokens])
        fields[F.META], fields[F.NROWS] = ex.block(meta, keep), meta.numel()
    fields[F.E], fields[F.K] = E, idx.size(1) if idx is not None else 0
    out_dtype = x.dtype
    if scales is None and a["int8"]:
        if H % 128:
            raise Fail(f"int8 needs a hidden size that is a multiple of 128 (per-128 scales), got {H}")
        x, scales = int8_quantize(x)
        fields[F.FLAGS] |= FLAG_INT8
    fields[F.DTYPE] = DTYPE_CODES.get(x.dtype, 5)
    fields[F.X], fields[F.XROW] = ex.place(x, keep, "x"), H * x.element_size()
    if scales is not None:
        fields[F.FLAGS] |= FLAG_FP8 if x.dtype == torch.float8_e4m3fn else 0
        s = scales.contiguous()
        fields[F.SCALES], fields[F.SROW] = ex.place(s, keep, "scales"), s.size(1) * s.element_size()
        fields[F.DTYPE] |= DTYPE_CODES[torch.float32] << 8 if s.dtype == torch.float32 else 6 << 8
    if idx is not None:
        fields[F.TOPK], fields[F.W] = ex.place(idx, keep, "topk_idx"), ex.place(w, keep, "topk_weights")
    return {"in_rank": in_rank, "chan": chan, "head": head, "H": H, "out_dtype": out_dtype,
            "cached": handle is not None}


def _check_counts(rows, counts: torch.Tensor) -> None:
    """Check the global ``[src, dst]`` token counts against every rank's ``num_worst_tokens`` and handle
    (every rank holds the same counts and headers, so all raise together); ``rows``: tensor or its list."""
    per_dst = counts.sum(0).tolist()
    for r, h in enumerate(rows.tolist() if isinstance(rows, torch.Tensor) else rows):
        worst = h[F.WORST]
        if worst and per_dst[r] > worst:
            raise ZbcclInvalidUsageError(
                f"dispatch: num_worst_tokens too small on rank {r}, expected >= {per_dst[r]}, got {worst}",
                ranks=(r,))
        if h[F.FLAGS] & FLAG_CACHED and h[F.NRECV] != per_dst[r]:
            raise ZbcclInvalidUsageError(
                f"dispatch: the handle on rank {r} does not match this routing, expected {h[F.NRECV]} "
                f"received tokens, got {per_dst[r]}", ranks=(r,))


def _alloc(buf, rows, loc: dict, n: int) -> dict:
    """The exact-size outputs of a dispatch (``n`` rows): ``x`` (int8 staging for int8), ``s``, ``i``, ``w``."""
    h = rows[buf.ex.me].tolist() if isinstance(rows, torch.Tensor) else rows[buf.ex.me]
    H, K, flags, code = loc["H"], h[F.K], h[F.FLAGS], h[F.DTYPE]
    int8 = bool(flags & FLAG_INT8)
    x_dtype = torch.int8 if int8 else _CODE_DTYPES[code & 0xFF]
    s_dtype = torch.float32 if (code >> 8) == DTYPE_CODES[torch.float32] else torch.int32
    # The received rows in a heap block of their own (exact size; int8 rows are private staging), the
    # top-k and weights together in a second one (one allocation fewer, a small block's rounding).
    # Both reuse the previous step's blocks when their sizes repeat and the caller dropped them (Exchange.reuse).
    out = {"x": torch.empty(n, H, dtype=x_dtype) if int8 else buf.ex.reuse("recv_x", [((n, H), x_dtype)])[0]}
    if K:
        out["i"], out["w"] = buf.ex.reuse("recv_topk", [((n, K), torch.int64), ((n, K), torch.float32)])
    if code >> 8:
        out["s"] = torch.empty(n, h[F.SROW] // 4, dtype=s_dtype)
    return out


def _dequantize(buf, out: dict, loc: dict) -> None:
    if out["x"].dtype == torch.int8 and loc["out_dtype"] != torch.int8:
        n, H = out["x"].shape
        out["x"] = heap_empty(buf.comm, (n, H), loc["out_dtype"]).copy_(int8_dequantize(out["x"], out.pop("s"),
                                                                                          loc["out_dtype"]))


def _pull(buf, rows, metas: list, counts, E: int, C: int, loc: dict, worst: int) -> dict:
    """Torch path: allocate the exact-size outputs and copy every sender's rows into them (local writes only)."""
    ex, R, me = buf.ex, buf.ex.R, buf.ex.me
    K = int(rows[me, F.K])
    num_recv = int(counts[:, me].sum())
    n = worst or num_recv
    out = _alloc(buf, rows, loc, n)
    src_idx = torch.full((n,), -1, dtype=torch.int32)  # -1 below num_recv (DeepEP: uninitialised)
    fields = {"x": (F.X, int(rows[me, F.XROW])), "s": (F.SCALES, int(rows[me, F.SROW])),
              "i": (F.TOPK, K * 8), "w": (F.W, K * 4)}
    tables, start, head = [], 0, R + E + R * C
    for r in range(R):
        cnt = int(counts[r, me])
        if not cnt:
            continue
        at = head + int(counts[r, :me].sum())
        toks = metas[r][at:at + cnt]
        src_idx[start:start + cnt] = toks
        T_r, runs = int(rows[r, F.T]), row_runs(toks)
        for key, t in out.items():
            field, row = fields[key]
            tables.append(row_table(t.data_ptr() + start * row, ex.addr(r, int(rows[r, field]), T_r * row), runs, row))
        start += cnt
    ex.copy(tables)
    if K:
        local = out["i"] - me * (E // R)
        out["i"].copy_(torch.where((local >= 0) & (local < E // R), local, -1))
        out["w"].masked_fill_(out["i"] < 0, 0.0)
        out["i"][num_recv:] = -1
        out["w"][num_recv:] = 0.0
    _dequantize(buf, out, loc)
    out["src_idx"] = src_idx
    return out


def _receiver_meta(buf, metas: list, E: int, C: int) -> tuple[list[int], torch.Tensor]:
    """Per local expert receive counts and ``recv_channel_prefix_matrix`` from the senders' plans."""
    R, me = buf.ex.R, buf.ex.me
    L = E // R if E else 0
    per_expert = torch.zeros(L, dtype=torch.int64)
    recv_chan = torch.zeros(R, C, dtype=torch.int32)
    for r in range(R):
        meta = metas[r]
        if L:
            per_expert += meta[R + me * L:R + (me + 1) * L]
        incl = meta[R + E:R + E + R * C].view(R, C)[me]
        recv_chan[r, 1:] = incl[:-1].to(torch.int32)
    return per_expert.tolist(), recv_chan


def dispatch(buf, a: dict):
    """Normal dispatch (see :meth:`zbccl.ep.Buffer.dispatch` for arguments and results)."""
    ex = buf.ex
    fields, keep, fail = {F.OP: OP_DISPATCH, F.SEQ: buf.seq}, [], None
    try:
        loc = _prepare(buf, a, fields, keep)
    except Fail as exc:
        fail, loc = exc, None
    rows = ex.publish("dispatch", fields, fail)
    rl = rows.tolist()
    # Every field a receiver reads a peer's blocks with (it sizes them by its own values) must agree.
    ex.agree("dispatch", rl, ((F.OP, "the op"), (F.FLAGS, "the mode (cached, fp8, int8, top-k)"), (F.E, "num_experts"),
                        (F.H, "the hidden size"), (F.DTYPE, "x's dtype and the scales' dtype (code + 256 * scales' code, "
                                                       "0: no scales)"), (F.K, "num_topk"),
                        (F.SROW, "the scales' row width in bytes (0: no scales)"),
                        (F.HANDLE, "the handle (from which dispatch)"), (F.CHANNELS, "config.num_sms")))
    E, C, worst = rl[0][F.E], rl[0][F.CHANNELS], rl[ex.me][F.WORST]
    if fast.available(ex.prims):
        counts, per_expert, recv_chan, metas = fast.plan(buf, rl)
    else:  # one view of each sender's whole plan block (counts, per expert, per channel, token lists)
        metas = [ex.view(r, int(rows[r, F.META]), (int(rows[r, F.NROWS]),), torch.int64) for r in range(ex.R)]
        counts = torch.stack([m[:ex.R] for m in metas])
    _check_counts(rl, counts)
    try:
        if fast.available(ex.prims):
            num_recv = int(counts[:, ex.me].sum())
            out = _alloc(buf, rl, loc, worst or num_recv)
            out["src_idx"] = fast.pull(buf, rl, counts, metas, out, num_recv)
            _dequantize(buf, out, loc)
        else:
            out = _pull(buf, rows, metas, counts, E, C, loc, worst)
            per_expert, recv_chan = _receiver_meta(buf, metas, E, C)
    finally:
        ex.done("dispatch", fields)
    recv_x = (out["x"], out["s"]) if "s" in out else out["x"]
    if loc["cached"]:
        return recv_x, None, None, None, None
    align = a["expert_alignment"]
    lst = [] if a["num_worst_tokens"] else [-(-c // align) * align for c in per_expert]
    handle = (counts.cumsum(0).to(torch.int32), loc["chan"], recv_chan, out["src_idx"], loc["in_rank"],
              loc["head"] if loc["head"] is not None else send_head(loc["in_rank"]))
    buf.register(handle[3])
    return recv_x, out.get("i"), out.get("w"), lst, handle


def combine(buf, x, handle, topk_weights, bias, error: str | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Normal combine (see :meth:`zbccl.ep.Buffer.combine`): fp32 sum of the rows sent back per token."""
    ex = buf.ex
    fields, keep, fail = {F.OP: OP_COMBINE, F.SEQ: buf.seq}, [], None
    try:
        if error:
            raise Fail(error)
        x = _tensor(x, "x", 2, (torch.bfloat16, torch.float16, torch.float32))
        fields[F.HANDLE] = buf.handle_seq(handle, "combine")
        if x.size(0) != handle[3].size(0):
            raise Fail(f"x does not match the handle, expected {handle[3].size(0)} rows, got {x.size(0)}")
        T, H = handle[4].size(0), x.size(1)
        biases = [b for b in (bias if isinstance(bias, tuple) else (bias,)) if b is not None]
        for i, b in enumerate(biases):
            _tensor(b, f"bias[{i}]", 2, (x.dtype,), (T, H))
        biases = [b.contiguous() for b in biases]
        K = 0
        if topk_weights is not None:
            w = _tensor(topk_weights, "topk_weights", 2, (torch.float32,), (x.size(0), None))
            K = w.size(1)
            fields[F.W] = ex.place(w, keep, "topk_weights")
        fields.update({F.H: H, F.K: K, F.DTYPE: DTYPE_CODES[x.dtype], F.NRECV: x.size(0),
                       F.X: ex.place(x, keep, "x"), F.XROW: H * x.element_size()})
    except Fail as exc:
        fail = exc
    rows = ex.publish("combine", fields, fail)
    ex.agree("combine", rows, ((F.OP, "the op"), (F.H, "the hidden size"), (F.DTYPE, "x's dtype"),
                        (F.K, "topk_weights (given, num_topk)"), (F.HANDLE, "the handle (from which dispatch)")))
    out = ex.reuse("combined_x", [((T, H), x.dtype)])[0]
    try:
        if fast.available(ex.prims) and T:
            accw = fast.combine_sum(buf, rows.tolist(), handle, out, biases, K)
        else:
            acc, accw = _reduce(buf, rows, handle, T, H, K, x.dtype)
            for b in biases:
                acc += b.float()
            out.copy_(acc)
    finally:
        ex.done("combine", fields)
    return out, accw


def _reduce(buf, rows, handle, T: int, H: int, K: int, dtype: torch.dtype):
    """Sum, in fp32 and rank order, the rows each rank holds for this rank's tokens (read in place)."""
    ex, R, me = buf.ex, buf.ex.R, buf.ex.me
    rpm, in_rank = handle[0], handle[4]
    counts, tokens = rank_lists(in_rank)
    acc = buf.scratch("acc", (T, H), torch.float32).zero_()
    accw = torch.zeros(T, K, dtype=torch.float32) if K else None
    start = 0
    for r in range(R):
        cnt = int(counts[r])
        if not cnt:
            continue
        base = int(rpm[me - 1, r]) if me else 0
        toks = tokens[start:start + cnt]
        start += cnt
        xrow = int(rows[r, F.XROW])
        tmp = buf.scratch("rows", (cnt, H), torch.float32)
        tmp.copy_(ex.view(r, int(rows[r, F.X]) + base * xrow, (cnt, H), dtype))
        acc.index_add_(0, toks, tmp)
        ex.moved += cnt * (xrow + K * 4)
        if K:
            accw.index_add_(0, toks, ex.view(r, int(rows[r, F.W]) + base * K * 4, (cnt, K), torch.float32))
    return acc, accw
