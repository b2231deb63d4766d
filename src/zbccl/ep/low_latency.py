"""Low-latency dispatch and combine: DeepEP's ``[num_local_experts, num_ranks * max_tokens, hidden]`` layout.

Protocol (see :mod:`.exchange`): the call prepares and publishes (each sender sorts its valid
``(token, slot)`` pairs by expert, then token, publishes the per-expert counts and token
lists, and casts ``x`` to fp8 with per-128-channel scales into a heap block when asked); the
receive half pulls and ends with the barrier. Without ``return_recv_hook`` both halves run in
the call; with it, the call returns after the publish and ``hook()`` runs the receive half
(every rank must call its hook, in the same order as its other EP ops). A token is sent
once per selected expert. Rows of local expert ``e`` are ordered by source rank, then source
token (``layout_range[e, r] = begin << 32 | count``); ``src_info`` gives the source token.

Combine is the reverse pull: each rank reads, for every one of its ``(token, slot)`` pairs,
the expert's output row straight from the owner's ``x`` (or from the zero-copy buffer, or a
compact staged copy of the valid rows when ``x`` is not a heap tensor) and sums
``weight * row`` per token in fp32. ``use_logfmt`` applies DeepEP's LogFMT-10 cast to every row
read (:func:`.layout.logfmt_roundtrip`: the same numbers a GPU combine sums); the rows still
travel as bf16, so it saves no bytes here.
"""

from __future__ import annotations

import time
from array import array

import torch

from ..errors import ZbcclInvalidUsageError
from ..native.abi import EP_OP_LL_COMBINE as OP_LL_COMBINE
from ..native.abi import EP_OP_LL_DISPATCH as OP_LL_DISPATCH
from ..native.abi import ep_args
from .exchange import F, Fail, heap_empty
from .layout import fp8_quantize, logfmt_roundtrip
from .normal import _tensor

__all__ = ["LowLatencyState", "dispatch", "combine", "OP_LL_DISPATCH", "OP_LL_COMBINE"]

FLAG_FP8, FLAG_ROUND, FLAG_UE8M0, FLAG_HOOK, FLAG_LOGFMT = 1, 2, 4, 8, 16
#: The kernels' argument blocks (abi.EP_ARGS), filled by field name: (head, per-rank row).
_LL_PLAN, _ = ep_args("zb_ep_ll_plan")
_LL_PULL, _LL_PULL_ROW = ep_args("zb_ep_ll_pull")
_LL_ADDRS, _LL_ADDRS_ROW = ep_args("zb_ep_ll_addrs")
_LL_COMBINE, _ = ep_args("zb_ep_ll_combine")


class LowLatencyState:
    """DeepEP's two low-latency buffers: the index toggles on every LL dispatch and combine; only
    the zero-copy combine buffers (allocated on first use, in the heap) are real memory here."""

    def __init__(self) -> None:
        self.idx = 0
        self.combine_buffers: dict[tuple, list] = {}

    def next_combine_buffer(self, comm, L: int, N: int, H: int) -> torch.Tensor:
        pair = self.combine_buffers.setdefault((L, N, H), [None, None])
        if pair[self.idx] is None:
            pair[self.idx] = heap_empty(comm, (L, N, H), torch.bfloat16)
        return pair[self.idx]


def _check_dispatch(buf, x, topk_idx, tmax: int, E: int, stats, wait_stats, flags: int) -> tuple:
    R = buf.ex.R
    x = _tensor(x, "x", 2, (torch.bfloat16,))
    T, H = x.shape
    idx = _tensor(topk_idx, "topk_idx", 2, (torch.int64, torch.int32), (T, None))
    if T > tmax:
        raise Fail(f"too many tokens, expected at most num_max_dispatch_tokens_per_rank={tmax}, got {T}")
    if H % 128 or (flags & FLAG_UE8M0 and H % 512):
        raise Fail(f"hidden size must be a multiple of {512 if flags & FLAG_UE8M0 else 128}, got {H}")
    if E <= 0 or E % R:
        raise Fail(f"num_experts must be a positive multiple of the {R} ranks, got {E}")
    if stats is not None:
        _tensor(stats, "cumulative_local_expert_recv_stats", 1, (torch.int32,), (E // R,))
    if wait_stats is not None:
        _tensor(wait_stats, "dispatch_wait_recv_cost_stats", 1, (torch.int64,), (R,))
    return x, idx.long().contiguous()


def _check_topk(idx: torch.Tensor, E: int) -> None:
    """Raise :class:`Fail` for an entry outside [-1, E), or an expert named twice in one token."""
    if idx.numel() and (int(idx.min()) < -1 or int(idx.max()) >= E):
        raise Fail(f"topk_idx out of range, expected -1 or [0, {E}), got values in [{int(idx.min())}, {int(idx.max())}]")
    if idx.size(1) > 1:  # an expert twice in one token would give it more rows than its N slots
        srt = idx.sort(dim=1).values
        dup = ((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)).any(1).nonzero()
        if dup.numel():
            t = int(dup[0])
            raise Fail(f"topk_idx names an expert twice in one token, expected distinct experts (or -1) per token, "
                       f"got {idx[t].tolist()} for token {t}")


def _pairs(ex, idx: torch.Tensor, E: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`.reference.expert_pairs` of a checked-shape int64 ``idx``, after :func:`_check_topk`'s checks, in
    one native pass (a counting sort, ``ep_ll_plan``): the same pairs in the same order."""
    T, K = idx.shape
    counts, pairs, errs = torch.empty(E, dtype=torch.int64), torch.empty(2, T * K, dtype=torch.int64), array("q", [0, 0])
    args = array("q", _LL_PLAN(T=T, K=K, E=E, idx=idx.data_ptr(), counts_out=counts.data_ptr(),
                               tokens_out=pairs[0].data_ptr(), slots_out=pairs[1].data_ptr(),
                               err_out=errs.buffer_info()[0]))
    n = ex.caps.ll_plan(args.buffer_info()[0])
    if n < 0:
        _check_topk(idx, E)  # the exact message
        raise Fail(f"topk_idx: bad entry {errs[1]} in token {errs[0]}")  # pragma: no cover - the check raised
    return counts, pairs[0, :n], pairs[1, :n]


def dispatch(buf, x, topk_idx, tmax: int, E: int, stats, wait_stats, flags: int, error: str | None):
    """Publish this rank's tokens; returns ``(outputs, recv)`` where ``recv()`` fills the outputs."""
    ex, R, me = buf.ex, buf.ex.R, buf.ex.me
    fields, keep, fail = {F.OP: OP_LL_DISPATCH, F.SEQ: buf.seq, F.FLAGS: flags, F.TMAX: tmax, F.E: E}, [], None
    plan = None
    try:
        if error:
            raise Fail(error)
        masked = buf._mask.nonzero().flatten().tolist()
        if masked and R > 63:
            raise Fail(f"rank masks need at most 63 ranks, got {R}")
        fields[F.MASK] = sum(1 << r for r in masked)
        x, idx = _check_dispatch(buf, x, topk_idx, tmax, E, stats, wait_stats, flags)
        T, H = x.shape
        counts, tokens, slots = _pairs(ex, idx, E)
        plan = {"tokens": tokens, "slots": slots, "topk_idx": idx.clone(), "T": T, "sizes": (tmax, H, E)}
        fields.update({F.H: H, F.T: T, F.K: idx.size(1), F.META: ex.block(torch.cat([counts, tokens]), keep),
                       F.NROWS: E + tokens.numel()})
        if flags & FLAG_FP8:
            xq, s = fp8_quantize(x, round_scale=bool(flags & FLAG_ROUND), ue8m0=bool(flags & FLAG_UE8M0))
            fields.update({F.X: ex.place(xq, keep, "x (fp8)"), F.XROW: H, F.SCALES: ex.place(s, keep, "scales"),
                           F.SROW: s.size(1) * 4})
        else:
            fields.update({F.X: ex.place(x, keep, "x", copy=bool(flags & FLAG_HOOK)), F.XROW: H * 2})
    except Fail as exc:
        fail = exc
    t0 = time.perf_counter_ns()
    rows = ex.publish("low_latency_dispatch", fields, fail)
    waited = time.perf_counter_ns() - t0
    ex.agree("low_latency_dispatch", rows, ((F.OP, "the op"), (F.E, "num_experts"), (F.H, "the hidden size"),
                        (F.TMAX, "num_max_dispatch_tokens_per_rank"), (F.FLAGS, "use_fp8/round_scale/use_ue8m0/hook")))
    L, N, H = E // R, R * tmax, int(rows[me, F.H])
    out = {"x": heap_empty(buf.comm, (L, N, H), torch.float8_e4m3fn if flags & FLAG_FP8 else torch.bfloat16),
           "count": torch.zeros(L, dtype=torch.int32), "src_info": torch.zeros(L, N, dtype=torch.int32),
           "layout": torch.zeros(L, R, dtype=torch.int64)}
    if flags & FLAG_FP8:
        S = H // 512 if flags & FLAG_UE8M0 else H // 128
        dt = torch.int32 if flags & FLAG_UE8M0 else torch.float32
        # Column-major in the last two dims (DeepEP's TMA layout); with one scale per row that layout is
        # also row-major, and allocating it so keeps ``.contiguous()`` views viewable as bytes.
        out["scales"] = heap_empty(buf.comm, (L, S, N), dt).transpose(1, 2) if S > 1 else heap_empty(buf.comm, (L, N, S), dt)

    def recv() -> None:
        try:
            plan["begin"] = _pull(buf, rows, out, E, tmax, plan)
        finally:
            ex.done("low_latency_dispatch", fields)
            keep.clear()
        if stats is not None:
            stats.add_(out["count"])
        if wait_stats is not None:
            wait_stats.add_(waited)

    return out, plan, recv


def _pull(buf, rows, out: dict, E: int, tmax: int, plan: dict) -> torch.Tensor:
    """Copy every sender's rows for this rank's experts; returns this rank's row begin per expert on its owner."""
    me = buf.ex.me
    mask = rows[:, F.MASK].tolist()  # bit s of mask[o]: owner o drops source s (DeepEP's shrink masks)
    # owners that drop my tokens, or whose rows I drop
    plan["skip"] = torch.tensor([bool((m >> me) & 1 or (mask[me] >> o) & 1) for o, m in enumerate(mask)])
    return _pull_native(buf, rows, out, E, tmax, mask)


def _pull_native(buf, rows, out: dict, E: int, tmax: int, mask: list[int]) -> torch.Tensor:
    """The receive half in one native pass (``ep_ll_pull``; :func:`.reference.low_latency_dispatch` is its
    oracle). Every peer address comes bounds-checked for its whole block (plan block, x, scales); the kernel
    checks each count and token it reads against them."""
    ex, R, me = buf.ex, buf.ex.R, buf.ex.me
    L, N, xrow = E // R, R * tmax, int(rows[me, F.XROW])
    keep_of = array("q", [~m for m in mask])
    begin, err = torch.empty(E, dtype=torch.int64), array("q", [0, 0])
    scales = out.get("scales")
    srow = int(rows[me, F.SROW]) if scales is not None else 0
    s_out, s_e, s_slot, s_j = (0, 0, 0, 0) if scales is None else (scales.data_ptr(),
                                                                     *(st * 4 for st in scales.stride()))
    args = array("q", _LL_PULL(R=R, me=me, L=L, N=N, E=E, xrow=xrow, x_out=out["x"].data_ptr(),
                               count_out=out["count"].data_ptr(), src_info_out=out["src_info"].data_ptr(),
                               layout_out=out["layout"].data_ptr(), begin_out=begin.data_ptr(), masked=mask[me],
                               keep_of=keep_of.buffer_info()[0], srow=srow, s_out=s_out, s_e=s_e, s_slot=s_slot,
                               s_j=s_j, err_out=err.buffer_info()[0]))
    for r in range(R):
        T_r, nrows = int(rows[r, F.T]), int(rows[r, F.NROWS])
        args.extend(_LL_PULL_ROW(meta=ex.addr(r, int(rows[r, F.META]), nrows * 8), meta_len=nrows,
                                 x=ex.addr(r, int(rows[r, F.X]), T_r * xrow) if T_r else 0, T=T_r,
                                 s=ex.addr(r, int(rows[r, F.SCALES]), T_r * srow) if srow and T_r else 0))
    moved = ex.caps.ll_pull(args.buffer_info()[0])
    if moved == -2:
        raise ZbcclInvalidUsageError(f"low_latency_dispatch: more rows for one expert than its slots, expected at "
                                     f"most {N}, got {err[1]}", ranks=tuple(range(R)))
    if moved < 0:
        raise ZbcclInvalidUsageError(f"low_latency_dispatch: rank {err[0]}'s published plan is out of bounds "
                                     "(its counts or token indices)", ranks=(err[0],))
    ex.moved += moved
    return begin


def combine(buf, x, topk_idx, topk_weights, handle, zero_copy: bool, out, flags: int, error: str | None):
    """Publish this rank's expert outputs; returns ``(combined, recv)`` where ``recv()`` fills ``combined``."""
    ex, R = buf.ex, buf.ex.R
    fields, keep, fail = {F.OP: OP_LL_COMBINE, F.SEQ: buf.seq, F.FLAGS: flags}, [], None
    combined = plan = None
    try:
        if error:
            raise Fail(error)
        seq, plan, x, idx, w, (tmax, L, N, H, E, T) = combine_args(buf, R, x, topk_idx, topk_weights, handle, out)
        combined = out if out is not None else heap_empty(buf.comm, (T, H), torch.bfloat16)
        src = buf._ll.next_combine_buffer(buf.comm, L, N, H) if zero_copy else x
        base, nrows, bases = _place_outputs(ex, src, handle[1], keep, copy=bool(flags & FLAG_HOOK) and not zero_copy)
        fields.update({F.HANDLE: seq, F.H: H, F.X: base, F.XROW: H * 2, F.NROWS: nrows, F.E: E, F.TMAX: tmax,
                       F.META: ex.block(bases, keep)})
    except Fail as exc:
        fail = exc
    rows = ex.publish("low_latency_combine", fields, fail)
    ex.agree("low_latency_combine", rows, ((F.OP, "the op"), (F.HANDLE, "the handle (from which dispatch)"), (F.H, "the hidden size"),
                        (F.TMAX, "the handle's num_max_dispatch_tokens_per_rank"), (F.E, "the handle's num_experts"),
                        (F.FLAGS, "zero_copy/hook/use_logfmt")))

    def recv() -> None:
        acc = None
        try:
            if flags & FLAG_LOGFMT:  # LogFMT-10's cast of every row read: the torch sum
                acc = _reduce(buf, rows, plan, w, E, H, logfmt=bool(flags & FLAG_LOGFMT))
            else:
                _reduce_native(buf, rows, plan, w, E, H, combined)
        finally:
            ex.done("low_latency_combine", fields)
            keep.clear()
        if acc is not None:
            combined.copy_(acc)

    return combined, recv


def _place_outputs(ex, src: torch.Tensor, layout: torch.Tensor, keep: list, *, copy: bool):
    """``(heap offset, rows, first row of each local expert)`` of the expert outputs peers read:
    ``src`` in place when it is a heap tensor, else its valid rows staged compactly."""
    L, N, H = src.shape
    off = -1 if copy else ex.offset_of(src)
    if off >= 0:
        return off, L * N, torch.arange(L) * N
    counts = (layout & 0xFFFFFFFF).sum(1)
    compact = torch.cat([src[e, :int(counts[e])] for e in range(L)]) if L else src.new_empty(0, H)
    return ex.place(compact, keep, "x (valid rows)"), compact.size(0), counts.cumsum(0) - counts


def _owner_rows(buf, rows, plan: dict, E: int):
    """Yield ``(r, lo, hi, row)`` per owner rank ``r`` not skipped: the expert-sorted ``(token, slot)`` pairs
    ``lo:hi`` whose expert is on ``r``, and their row indices in ``r``'s published block."""
    if "begin" not in plan:
        raise ZbcclInvalidUsageError("low_latency_combine: the dispatch's receive hook was never called, "
                                     "expected hook() before combine, got a pending dispatch")
    ex, R = buf.ex, buf.ex.R
    L, begin = E // R, plan["begin"]
    experts = plan["topk_idx"].view(-1)[plan["slots"]]
    off = torch.zeros(E + 1, dtype=torch.int64)
    off[1:] = torch.bincount(experts, minlength=E).cumsum(0)
    skip = plan["skip"] | buf._mask.bool()  # DeepEP drops the slots of masked owners
    for r in range(R):
        lo, hi = int(off[r * L]), int(off[(r + 1) * L])
        if lo == hi or skip[r]:
            continue
        e = experts[lo:hi]
        bases = ex.view(r, int(rows[r, F.META]), (L,), torch.int64)
        yield r, lo, hi, bases[e - r * L] + begin[e] + (torch.arange(lo, hi) - off[e])


def _reduce_native(buf, rows, plan: dict, w: torch.Tensor, E: int, H: int, out: torch.Tensor) -> None:
    """:func:`_reduce` in one native pass (``ep_ll_combine``), written into ``out`` (bf16 [T, H], contiguous):
    every row address is checked against its owner's published block here, and each token's rows are
    summed in ascending expert order, as :func:`.reference.low_latency_combine` does, so bitwise the same."""
    ex, T, K = buf.ex, plan["T"], plan["topk_idx"].size(1)
    addr, wk = _addrs_native(buf, rows, plan, w, E, H)
    acc = buf.scratch("acc_row", (H,), torch.float32)
    args = array("q", _LL_COMBINE(T=T, K=K, H=H, dst=out.data_ptr(), src=addr.data_ptr(), w=wk.data_ptr(),
                                  acc=acc.data_ptr()))
    ex.moved += ex.caps.ll_combine(args.buffer_info()[0])


def _addrs_native(buf, rows, plan: dict, w: torch.Tensor, E: int, H: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' addresses ``[T, K]`` (0: none) and weights, each token's in ascending expert order, in one
    native pass (``ep_ll_addrs``): each owner's block and first-row table come bounds-checked from Python,
    the kernel checks every row it computes against the owner's rows."""
    if "begin" not in plan:
        raise ZbcclInvalidUsageError("low_latency_combine: the dispatch's receive hook was never called, "
                                     "expected hook() before combine, got a pending dispatch")
    ex, R, T, K = buf.ex, buf.ex.R, plan["T"], plan["topk_idx"].size(1)
    L = E // R
    skip = plan["skip"] | buf._mask.bool()  # DeepEP drops the slots of masked owners
    addr, wk, err = torch.empty(T * K, dtype=torch.int64), torch.empty(T * K, dtype=torch.float32), array("q", [0, 0])
    wc = w.contiguous()
    args = array("q", _LL_ADDRS(T=T, K=K, E=E, L=L, R=R, row_bytes=H * 2, idx=plan["topk_idx"].data_ptr(),
                                w=wc.data_ptr(), begin=plan["begin"].data_ptr(), addr_out=addr.data_ptr(),
                                w_out=wk.data_ptr(), err_out=err.buffer_info()[0]))
    for r, skipped in enumerate(skip.tolist()):
        nrows = int(rows[r, F.NROWS])
        if skipped or not nrows:
            args.extend(_LL_ADDRS_ROW(meta=0, x=0, nrows=-1 if skipped else 0))
            continue
        args.extend(_LL_ADDRS_ROW(meta=ex.addr(r, int(rows[r, F.META]), L * 8),
                                  x=ex.addr(r, int(rows[r, F.X]), nrows * H * 2), nrows=nrows))
    rc = ex.caps.ll_addrs(args.buffer_info()[0])
    if rc == -1:
        raise ZbcclInvalidUsageError(f"low_latency_combine: rank {err[0]}'s expert rows are out of its block, "
                                     f"expected rows in [0, {int(rows[err[0], F.NROWS])}), got {err[1]}",
                                     ranks=(err[0],))
    if rc < 0:
        raise MemoryError("low_latency_combine: no memory for the row tables")
    return addr, wk


def _reduce(buf, rows, plan: dict, w: torch.Tensor, E: int, H: int, *, logfmt: bool = False) -> torch.Tensor:
    """fp32 ``sum_k weight * expert_row`` per token, every row read from its owner's memory: the combine of
    ``use_logfmt``, whose per-row LogFMT-10 cast the native kernel does not have."""
    ex = buf.ex
    tokens, slots = plan["tokens"], plan["slots"]
    wflat = w.reshape(-1)
    acc = buf.scratch("acc", (plan["T"], H), torch.float32).zero_()
    for r, lo, hi, row in _owner_rows(buf, rows, plan, E):
        y = buf.scratch("rows_bf16", (hi - lo, H), torch.bfloat16)
        torch.index_select(ex.view(r, int(rows[r, F.X]), (int(rows[r, F.NROWS]), H), torch.bfloat16), 0, row, out=y)
        tmp = buf.scratch("rows", (hi - lo, H), torch.float32)
        tmp.copy_(logfmt_roundtrip(y) if logfmt else y).mul_(wflat[slots[lo:hi]].unsqueeze(1))
        acc.index_add_(0, tokens[lo:hi], tmp)
        ex.moved += (hi - lo) * H * 2
    return acc


def combine_args(buf, R: int, x, topk_idx, topk_weights, handle, out) -> tuple:
    """low_latency_combine's checks against its dispatch (one host and across hosts):
    ``(seq, plan, x, idx, weights, (tmax, L, N, H, E, T))``; a bad argument raises :class:`Fail`."""
    if not isinstance(handle, (tuple, list)) or len(handle) != 5:
        raise Fail(f"handle must be the 5-tuple low_latency_dispatch returned, got {type(handle).__name__}")
    seq, plan = buf.lookup(handle[0], "low_latency_combine")
    tmax, H, E = int(handle[2]), int(handle[3]), int(handle[4])
    if (tmax, H, E) != plan["sizes"]:
        raise Fail("the handle's (num_max_dispatch_tokens_per_rank, hidden size, num_experts) differ from its "
                   f"dispatch's, expected {plan['sizes']}, got {(tmax, H, E)}")
    L, N, T = E // R, R * tmax, plan["T"]
    x = _tensor(x, "x", 3, (torch.bfloat16,), (L, N, H))
    idx = _tensor(topk_idx, "topk_idx", 2, (torch.int64, torch.int32), (T, plan["topk_idx"].size(1)))
    if not torch.equal(idx.long(), plan["topk_idx"]):
        raise Fail("topk_idx differs from the one low_latency_dispatch was given, expected the same routing")
    w = _tensor(topk_weights, "topk_weights", 2, (torch.float32,), (T, idx.size(1)))
    if out is not None:
        _tensor(out, "out", 2, (torch.bfloat16,), (T, H))
        if not out.is_contiguous():
            raise Fail("out must be contiguous")
    return seq, plan, x, idx, w, (tmax, L, N, H, E, T)
