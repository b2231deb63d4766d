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
from ..native.abi import EP_OP_COMBINE as OP_COMBINE
from ..native.abi import EP_OP_DISPATCH as OP_DISPATCH
from ..ops.dtypes import CODE_DTYPES, CODES
from . import fast
from .exchange import F, Fail, heap_empty
from .layout import int8_dequantize, int8_quantize

__all__ = ["dispatch", "combine", "OP_DISPATCH", "OP_COMBINE"]

FLAG_FP8, FLAG_TOPK, FLAG_CACHED, FLAG_INT8 = 1, 2, 4, 8


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


def _check_topk(topk_idx, topk_weights, T: int, E: int, caps, known: torch.Tensor | None = None):
    """Checked ``(topk_idx int64, topk_weights, num_tokens_per_expert [E] int32)``; ``known``: those counts,
    already computed from this unchanged ``topk_idx`` (range checked then), so the pass over it is skipped."""
    if (topk_idx is None) != (topk_weights is None):
        raise Fail("topk_idx and topk_weights go together, expected both or neither, got one")
    idx = _tensor(topk_idx, "topk_idx", 2, (torch.int64, torch.int32), (T, None))
    K = idx.size(1)
    w = _tensor(topk_weights, "topk_weights", 2, (torch.float32,), (T, K))
    if known is not None:
        return idx.long(), w, known
    got = fast.layout(caps, idx, E, 1, in_rank=False)
    if got is None:
        raise Fail(f"topk_idx out of range, expected -1 or [0, {E}), got values in [{int(idx.min())}, {int(idx.max())}]")
    return idx.long(), w, got[1]


def _memo_counts(memo, topk_idx, ntpe) -> torch.Tensor | None:
    """``num_tokens_per_expert`` when it is, unchanged, what :meth:`Buffer.get_dispatch_layout` computed from
    this very ``topk_idx``, itself unchanged since (in-place writes bump a tensor's version); else None."""
    if memo is None or topk_idx is not memo[0] or ntpe is not memo[2]:
        return None
    if topk_idx._version != memo[1] or ntpe._version != memo[3] or topk_idx.data_ptr() != memo[4]:
        return None
    return ntpe


def _layout(a: dict, T: int, R: int, caps, memo=None):
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
        known = _memo_counts(memo, a["topk_idx"], ntpe)
        idx, w, got = _check_topk(a["topk_idx"], a["topk_weights"], T, E, caps, known)
        if known is None and not torch.equal(got, ntpe.to(got.dtype)):
            raise Fail("num_tokens_per_expert does not match topk_idx, expected get_dispatch_layout's counts")
    elif a["num_worst_tokens"]:
        raise Fail("num_worst_tokens needs topk_idx and topk_weights, got neither")
    if a["expert_alignment"] < 1:
        raise Fail(f"expert_alignment must be >= 1, got {a['expert_alignment']}")
    # num_tokens_per_rank against is_token_in_rank: the native plan (fast.route) checks it
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
        in_rank, per_expert, idx, w, counts = _layout(a, T, R, ex.caps, getattr(buf, "layout_memo", None))
        E = per_expert.numel()
        fields[F.FLAGS] = FLAG_TOPK if idx is not None else 0
    fields[F.META], fields[F.NROWS], chan, head = fast.route(buf, in_rank, counts, per_expert, a["config"].num_channels)
    fields[F.E], fields[F.K] = E, idx.size(1) if idx is not None else 0
    out_dtype = x.dtype
    if scales is None and a["int8"]:
        if H % 128:
            raise Fail(f"int8 needs a hidden size that is a multiple of 128 (per-128 scales), got {H}")
        x, scales = int8_quantize(x)
        fields[F.FLAGS] |= FLAG_INT8
    fields[F.DTYPE] = CODES[x.dtype]
    fields[F.X], fields[F.XROW] = ex.place(x, keep, "x"), H * x.element_size()
    if scales is not None:
        fields[F.FLAGS] |= FLAG_FP8 if x.dtype == torch.float8_e4m3fn else 0
        s = scales.contiguous()
        fields[F.SCALES], fields[F.SROW] = ex.place(s, keep, "scales"), s.size(1) * s.element_size()
        fields[F.SDTYPE] = CODES[s.dtype]
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
    H, K, flags = loc["H"], h[F.K], h[F.FLAGS]
    int8 = bool(flags & FLAG_INT8)
    x_dtype = CODE_DTYPES[h[F.DTYPE]]
    # The received rows in a heap block of their own (exact size; int8 rows are private staging), the
    # top-k and weights together in a second one (one allocation fewer, a small block's rounding).
    # Both reuse the previous step's blocks when their sizes repeat and the caller dropped them (Exchange.reuse).
    out = {"x": torch.empty(n, H, dtype=x_dtype) if int8 else buf.ex.reuse("recv_x", [((n, H), x_dtype)])[0]}
    if K:
        out["i"], out["w"] = buf.ex.reuse("recv_topk", [((n, K), torch.int64), ((n, K), torch.float32)])
    if h[F.SROW]:  # scales: fp8 rows, or int8 ones (float32 or int32, 4 bytes each)
        out["s"] = torch.empty(n, h[F.SROW] // 4, dtype=CODE_DTYPES[h[F.SDTYPE]])
    return out


def _dequantize(buf, out: dict, loc: dict) -> None:
    if out["x"].dtype == torch.int8 and loc["out_dtype"] != torch.int8:
        n, H = out["x"].shape
        out["x"] = heap_empty(buf.comm, (n, H), loc["out_dtype"]).copy_(int8_dequantize(out["x"], out.pop("s"),
                                                                                          loc["out_dtype"]))


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
                        (F.H, "the hidden size"), (F.DTYPE, "x's dtype"), (F.SDTYPE, "the scales' dtype (0: no scales)"),
                        (F.SROW, "the scales' row width in bytes (0: no scales)"), (F.K, "num_topk"),
                        (F.HANDLE, "the handle (from which dispatch)"), (F.CHANNELS, "config.num_sms")))
    worst = rl[ex.me][F.WORST]
    counts, per_expert, recv_chan, metas = fast.plan(buf, rl)
    _check_counts(rl, counts)
    try:
        num_recv = int(counts[:, ex.me].sum())
        out = _alloc(buf, rl, loc, worst or num_recv)
        out["src_idx"] = fast.pull(buf, rl, counts, metas, out, num_recv)
        _dequantize(buf, out, loc)
    finally:
        ex.done("dispatch", fields)
    recv_x = (out["x"], out["s"]) if "s" in out else out["x"]
    if loc["cached"]:
        return recv_x, None, None, None, None
    align = a["expert_alignment"]
    lst = [] if a["num_worst_tokens"] else [-(-c // align) * align for c in per_expert]
    handle = (counts.cumsum(0).to(torch.int32), loc["chan"], recv_chan, out["src_idx"], loc["in_rank"], loc["head"])
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
        fields.update({F.H: H, F.K: K, F.DTYPE: CODES[x.dtype], F.NRECV: x.size(0),
                       F.X: ex.place(x, keep, "x"), F.XROW: H * x.element_size()})
    except Fail as exc:
        fail = exc
    rows = ex.publish("combine", fields, fail)
    ex.agree("combine", rows, ((F.OP, "the op"), (F.H, "the hidden size"), (F.DTYPE, "x's dtype"),
                        (F.K, "topk_weights (given, num_topk)"), (F.HANDLE, "the handle (from which dispatch)")))
    out = ex.reuse("combined_x", [((T, H), x.dtype)])[0]
    try:
        accw = fast.combine_sum(buf, rows.tolist(), handle, out, biases, K) if T else None
        if not T and K:  # no tokens: nothing to sum (an empty weight sum, as the kernel would give)
            accw = torch.zeros(0, K, dtype=torch.float32)
    finally:
        ex.done("combine", fields)
    return out, accw
