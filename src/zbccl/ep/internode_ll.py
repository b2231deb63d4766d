"""Low-latency dispatch and combine over a group that spans hosts: DeepEP's ``[L, R * Tmax, H]`` layout.

Protocol (rounds of :mod:`.wire`; ``docs/ep-internode.md``). DeepEP's low-latency mode sends a token
once per selected expert, straight to the expert's rank (no forwarding), and so does this:

* **dispatch**: each sender sorts its valid ``(token, slot)`` pairs by expert, then token (the native
  ``ep_ll_plan``), casts ``x`` to fp8 when asked, and packs, per destination rank ``o``, ``o``'s
  ``L`` per-expert counts followed by one row per pair, ``[source token int64][scales][x]``, in
  one heap send block; the header carries each part's offset and rows. After the header round,
  ``hook()`` (or the call itself) reads each source's part for this rank (a view on this host, one
  transfer from another) and places the rows by source rank, then token, per local expert. A hook
  ends with a closing round (other ops may run between a publish and its hook); the call itself
  keeps its send block until its next header round instead;
* **combine**: each owner packs, per source rank, the output rows of that source's pairs (expert
  order, then token: the source's own pair order), and publishes their offsets; each source reads
  its part from every owner and sums ``weight * row`` in fp32 per token in ascending expert order,
  as :func:`.reference.low_latency_combine` does (bit for bit).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ..errors import ZbcclInvalidUsageError, ZbcclRemoteError
from ..native.abi import ep_args
from ..ops.hosts.flat import copy
from .exchange import HDR_LEN, F, Fail, heap_empty
from .fast import _call
from .layout import fp8_quantize, logfmt_roundtrip
from .low_latency import (
    _LL_COMBINE,
    FLAG_FP8,
    FLAG_HOOK,
    FLAG_LOGFMT,
    FLAG_ROUND,
    FLAG_UE8M0,
    OP_LL_COMBINE,
    OP_LL_DISPATCH,
    _check_dispatch,
    _pairs,
    combine_args,
)

__all__ = ["dispatch", "combine"]

#: The native receive's argument block (abi.EP_ARGS): head, then one row per source rank.
_LL_RECV, _LL_RECV_ROW = ep_args("zb_ep_hosts_ll_recv")


def _close(w, keep: list, flags: int, op: str) -> None:
    """The end of a receive half. Called from the op itself, the send block lives until the next header round
    (which every peer enters only after this op); from a receive hook, whose op other ops may follow before the
    hooks run, a closing round ends the peers' reads first."""
    if flags & FLAG_HOOK:
        try:
            w.barrier(op)
        finally:
            keep.clear()
    else:
        w.hold(keep)


def _part(rows: torch.Tensor, src: int, me: int) -> tuple[int, int]:
    """``(offset, rows)`` of ``src``'s published part for ``me``."""
    return int(rows[src, HDR_LEN + 2 * me]), int(rows[src, HDR_LEN + 2 * me + 1])


def _publish_dispatch(buf, x, topk_idx, tmax: int, E: int, stats, wait_stats, flags: int, fields: dict,
                      keep: list, parts: list) -> tuple[dict, list[int]]:
    """The sender's half: checks, the pairs, the packed send block; returns ``(plan, header vector)`` and puts in
    ``parts`` each part for a rank of another host of up to the eager limit (it rides in the header round)."""
    w, R = buf.wire, buf.wire.R
    masked = buf._mask.nonzero().flatten().tolist()
    if masked and R > 63:
        raise Fail(f"rank masks need at most 63 ranks, got {R}")
    fields[F.MASK] = sum(1 << r for r in masked)
    x, idx = _check_dispatch(buf, x, topk_idx, tmax, E, stats, wait_stats, flags)
    T, H = x.shape
    L = E // R
    counts, tokens, slots = _pairs(w, idx, E)
    plan = {"tokens": tokens, "slots": slots, "topk_idx": idx.clone(), "T": T, "sizes": (tmax, H, E)}
    if flags & FLAG_FP8:
        xq, s = fp8_quantize(x, round_scale=bool(flags & FLAG_ROUND), ue8m0=bool(flags & FLAG_UE8M0))
        cols = [s.contiguous().view(torch.uint8), xq.contiguous().view(torch.uint8)]
        fields[F.SROW] = s.size(1) * 4
    else:
        cols = [x.contiguous().view(torch.uint8)]
    row = 8 + sum(c.size(1) for c in cols)
    row += -row % 8
    full = np.zeros((T, row), dtype=np.uint8)  # numpy, on this thread (see ``internode.Rows.pack``)
    full[:, :8].view(np.int64)[:, 0] = np.arange(T, dtype=np.int64)
    at = 8
    for c in cols:
        full[:, at:at + c.size(1)] = c.numpy()
        at += c.size(1)
    fields.update({F.H: H, F.T: T, F.K: idx.size(1), F.XROW: row, F.NROWS: tokens.numel()})
    block = w.heap_block(R * L * 8 + tokens.numel() * row, "send block")
    keep.append(block)
    base, at, vector = w.offset_of(block), 0, []
    off = torch.zeros(E + 1, dtype=torch.int64)
    off[1:] = counts.cumsum(0)
    for o in range(R):
        lo, hi = int(off[o * L]), int(off[(o + 1) * L])
        block[at:at + L * 8].view(torch.int64).copy_(counts[o * L:(o + 1) * L])
        part = block[at + L * 8:at + L * 8 + (hi - lo) * row].view(hi - lo, row)
        if hi > lo:
            np.take(full, tokens[lo:hi].numpy(), axis=0, out=part.numpy(), mode="clip")  # (clip: unbuffered)
        vector += [base + at, hi - lo]
        if hi > lo and w.rides(o, L * 8 + (hi - lo) * row):
            parts[o] = block[at:at + L * 8 + (hi - lo) * row]
        key = "nvl_bytes" if w.host_of[o] == w.my_host else "rdma_send_bytes"
        w.stats[key] += (hi - lo) * row
        at += L * 8 + (hi - lo) * row
    return plan, vector


def _arrived(w, sizes: dict, flags: int) -> dict:
    """The parts that rode in the header round (group rank -> nbytes), as views of this rank's slots; copied out
    when a receive hook reads them later (other ops' rounds may reuse the slots first)."""
    got = {r: w.part(r, n) for r, n in sizes.items()}
    return {r: v.clone() for r, v in got.items()} if flags & FLAG_HOOK else got


def dispatch(buf, x, topk_idx, tmax: int, E: int, stats, wait_stats, flags: int, error: str | None):
    """Publish this rank's tokens; returns ``(outputs, plan, recv)`` where ``recv()`` fills the outputs."""
    w, R, me = buf.wire, buf.wire.R, buf.wire.me
    for key in ("rdma_send_bytes", "rdma_recv_bytes", "nvl_bytes"):
        w.stats[key] = 0
    fields, keep, fail = {F.OP: OP_LL_DISPATCH, F.SEQ: buf.seq, F.FLAGS: flags, F.TMAX: tmax, F.E: E}, [], None
    plan, vector, parts = None, [], [None] * R
    try:
        if error:
            raise Fail(error)
        plan, vector = _publish_dispatch(buf, x, topk_idx, tmax, E, stats, wait_stats, flags, fields, keep, parts)
    except Fail as exc:
        fail = exc
    t0 = time.perf_counter_ns()
    rows = w.publish("low_latency_dispatch", fields, vector, fail, parts)
    waited = time.perf_counter_ns() - t0
    w.agree("low_latency_dispatch", rows.tolist(), (
        (F.OP, "the op"), (F.E, "num_experts"), (F.H, "the hidden size"),
        (F.TMAX, "num_max_dispatch_tokens_per_rank"), (F.FLAGS, "use_fp8/round_scale/use_ue8m0/hook")))
    L, N, H = E // R, R * tmax, int(rows[me, F.H])
    got = {s: _part(rows, s, me)[1] for s in range(R)}  # rows each source sent this rank
    early = _arrived(w, {s: L * 8 + n * int(rows[s, F.XROW]) for s, n in got.items()
                         if n > 0 and w.rides(s, L * 8 + n * int(rows[s, F.XROW]))}, flags)
    out = {"x": heap_empty(buf.comm, (L, N, H), torch.float8_e4m3fn if flags & FLAG_FP8 else torch.bfloat16),
           "count": torch.zeros(L, dtype=torch.int32), "src_info": torch.zeros(L, N, dtype=torch.int32),
           "layout": torch.zeros(L, R, dtype=torch.int64)}
    if flags & FLAG_FP8:
        S = H // 512 if flags & FLAG_UE8M0 else H // 128
        dt = torch.int32 if flags & FLAG_UE8M0 else torch.float32
        out["scales"] = heap_empty(buf.comm, (L, S, N), dt).transpose(1, 2) if S > 1 else \
            heap_empty(buf.comm, (L, N, S), dt)
    mask = rows[:, F.MASK].tolist()  # bit s of mask[o]: owner o drops source s (DeepEP's shrink masks)
    plan["skip"] = torch.tensor([bool((m >> me) & 1 or (mask[me] >> o) & 1) for o, m in enumerate(mask)])

    def recv() -> None:
        try:
            _receive(buf, rows, out, L, N, H, mask[me], early)
            plan["received"] = True
        finally:
            _close(w, keep, flags, "low_latency_dispatch")
        if stats is not None:
            stats.add_(out["count"])
        if wait_stats is not None:
            wait_stats.add_(waited)

    return out, plan, recv


def _receive(buf, rows: torch.Tensor, out: dict, L: int, N: int, H: int, drops: int, early: dict) -> None:
    """Read each source's part for this rank (``early``: those that rode in the header round) and place its rows
    per local expert (by source, then token): one native pass (``ep_hosts_ll_recv``) over the parts."""
    w, R, me = buf.wire, buf.wire.R, buf.wire.me
    row = rows[:, F.XROW].tolist()
    srow = int(rows[me, F.SROW])
    xrow = H if out["x"].dtype == torch.float8_e4m3fn else 2 * H
    scales = out.get("scales")
    held, table = [], []
    for s in range(R):
        off, n = _part(rows, s, me)
        if n < 0 or row[s] < 8 + srow + xrow:
            raise ZbcclRemoteError(f"low_latency_dispatch: rank {s}'s header is malformed, expected rows >= 0 of >= "
                                   f"{8 + srow + xrow} bytes, got {n} rows of {row[s]}", ranks=(s,))
        raw = early[s] if s in early else w.read(s, off, L * 8 + n * row[s], "low_latency_dispatch") if n else None
        held.append(raw)
        table += _LL_RECV_ROW(raw=raw.data_ptr() if raw is not None else 0, n=n, row=row[s], dropped=(drops >> s) & 1)
        w.moved += n * row[s]
        if w.host_of[s] != w.my_host:
            w.stats["rdma_recv_bytes"] += n * row[s]
    err = torch.zeros(2, dtype=torch.int64)
    st = scales.stride() if scales is not None else (0, 0, 0)
    a = _LL_RECV(nsrc=R, L=L, N=N, xrow=xrow, srow=srow, x_dst=out["x"].data_ptr(), info_dst=out["src_info"].data_ptr(),
                 s_dst=scales.data_ptr() if scales is not None else 0, s_le=st[0], s_slot=st[1], s_j=st[2],
                 layout_out=out["layout"].data_ptr(), count_out=out["count"].data_ptr(), err_out=err.data_ptr())
    rc = _call(w.caps.hosts_ll_recv, a + table)
    if rc < 0:
        s, (kind, value) = -rc - 1, err.tolist()
        if kind == 2:
            raise ZbcclInvalidUsageError(f"low_latency_dispatch: more rows for one expert than its slots, expected at "
                                         f"most {N} for local expert {value}, got more from rank {s}",
                                         ranks=tuple(range(R)))
        got = f"a negative count ({value})" if value < 0 else f"{value} in all"
        raise ZbcclRemoteError(f"low_latency_dispatch: rank {s}'s counts disagree with its rows, expected "
                               f"{_part(rows, s, me)[1]} in all, got {got}", ranks=(s,))


# ---------------------------------------------------------------------------------------------- combine
def _check_combine(buf, x, topk_idx, topk_weights, handle, out, fields: dict):
    seq, plan, x, idx, wt, (tmax, L, N, H, E, _) = combine_args(buf, buf.wire.R, x, topk_idx, topk_weights, handle,
                                                                out)
    fields.update({F.HANDLE: seq, F.H: H, F.E: E, F.TMAX: tmax, F.XROW: H * 2})
    return plan, x, wt, (L, N, H, E)


def combine(buf, x, topk_idx, topk_weights, handle, zero_copy: bool, out, flags: int, error: str | None):
    """Publish this rank's expert outputs; returns ``(combined, recv)`` where ``recv()`` fills ``combined``."""
    w = buf.wire
    for key in ("rdma_send_bytes", "rdma_recv_bytes", "nvl_bytes"):
        w.stats[key] = 0
    fields, keep, fail = {F.OP: OP_LL_COMBINE, F.SEQ: buf.seq, F.FLAGS: flags}, [], None
    combined = plan = wt = None
    vector: list[int] = []
    parts: list = [None] * w.R
    try:
        if error:
            raise Fail(error)
        plan, x, wt, (L, N, H, E) = _check_combine(buf, x, topk_idx, topk_weights, handle, out, fields)
        combined = out if out is not None else heap_empty(buf.comm, (plan["T"], H), torch.bfloat16)
        src = buf._ll.next_combine_buffer(buf.comm, L, N, H) if zero_copy else x
        vector = _pack_outputs(buf, src, handle[1], keep, parts)
    except Fail as exc:
        fail = exc
    rows = w.publish("low_latency_combine", fields, vector, fail, parts)
    w.agree("low_latency_combine", rows.tolist(), (
        (F.OP, "the op"), (F.HANDLE, "the handle (from which dispatch)"), (F.H, "the hidden size"),
        (F.TMAX, "the handle's num_max_dispatch_tokens_per_rank"), (F.E, "the handle's num_experts"),
        (F.FLAGS, "zero_copy/hook/use_logfmt")))
    counts = {o: _part(rows, o, w.me)[1] for o in range(w.R)}
    early = _arrived(w, {o: n * H * 2 for o, n in counts.items() if w.rides(o, n * H * 2)}, flags)

    def recv() -> None:
        try:
            acc = _reduce(buf, rows, plan, wt, E, H, early, logfmt=bool(flags & FLAG_LOGFMT))
        finally:
            _close(w, keep, flags, "low_latency_combine")
        if combined.dtype == acc.dtype:  # (``use_logfmt`` sums in fp32)
            copy(combined, acc)  # on this thread
        else:
            combined.copy_(acc)

    return combined, recv


def _pack_outputs(buf, src: torch.Tensor, layout: torch.Tensor, keep: list, parts: list) -> list[int]:
    """One heap block holding, per source rank, its pairs' output rows (expert order, then token);
    returns ``[offset, rows]`` per source for the header, and puts in ``parts`` each source's rows that ride in the
    header round (:meth:`.wire.HostWire.rides`)."""
    w = buf.wire
    L, N, H = src.shape
    begin, count = (layout >> 32).tolist(), (layout & 0xFFFFFFFF).tolist()
    total = int((layout & 0xFFFFFFFF).sum())
    block = w.heap_block(total * H * 2, "combine send block")
    keep.append(block)
    # numpy, on this thread (see ``internode.Rows.pack``); int16: the bf16 rows' bits (any strides of ``src``)
    rows = block[:total * H * 2].view(torch.int16).view(total, H).numpy()
    srcn = src.view(torch.int16).numpy()
    base, at, vector = w.offset_of(block), 0, []
    for s in range(w.R):
        start = at
        for le in range(L):
            b, c = begin[le][s], count[le][s]
            if b < 0 or c < 0 or b + c > N:
                raise Fail(f"the handle's layout_range is out of range, expected rows within [0, {N}), got begin {b} "
                           f"count {c}")
            rows[at:at + c] = srcn[le, b:b + c]
            at += c
        vector += [base + start * H * 2, at - start]
        if w.rides(s, (at - start) * H * 2):
            parts[s] = block[start * H * 2:at * H * 2]
        key = "nvl_bytes" if w.host_of[s] == w.my_host else "rdma_send_bytes"
        w.stats[key] += (at - start) * H * 2
    return vector


def _reduce(buf, rows: torch.Tensor, plan: dict, wt: torch.Tensor, E: int, H: int, early: dict, *,
            logfmt: bool) -> torch.Tensor:
    """``sum_k weight * row`` per token in fp32, in ascending expert order (the native ``ep_ll_combine``, bf16; with
    ``logfmt`` each token's pairs pass by pass in torch, fp32);
    ``early``: the owners' rows that rode in the header round."""
    w, R, me = buf.wire, buf.wire.R, buf.wire.me
    L, T = E // R, plan["T"]
    tokens, slots = plan["tokens"], plan["slots"]
    experts = plan["topk_idx"].view(-1)[slots]
    off = torch.zeros(E + 1, dtype=torch.int64)
    off[1:] = torch.bincount(experts, minlength=E).cumsum(0)
    skip = plan["skip"] | buf._mask.bool()  # DeepEP drops the slots of masked owners
    # where each owner's rows lie (read in place: a slot of the header round, a local owner's block, or one transfer);
    # ``base[p]``: the address of pair p's owner's rows, less p's index among all pairs (so row p is base[p] + p * row)
    base = torch.zeros(tokens.numel(), dtype=torch.int64)
    valid = torch.ones(tokens.numel(), dtype=torch.bool)
    parts = []
    for o in range(R):
        lo, hi = int(off[o * L]), int(off[(o + 1) * L])
        if skip[o]:
            valid[lo:hi] = False
            continue
        at, n = _part(rows, o, me)
        if n != hi - lo:
            raise ZbcclRemoteError(f"low_latency_combine: rank {o} returned another number of rows, expected {hi - lo}, "
                                   f"got {n}", ranks=(o,))
        if n:
            raw = early[o] if o in early else w.read(o, at, n * H * 2, "low_latency_combine")
            parts.append((lo, hi, raw))
            base[lo:hi] = raw.data_ptr() - lo * H * 2
            w.moved += n * H * 2
            if w.host_of[o] != w.my_host:
                w.stats["rdma_recv_bytes"] += n * H * 2
    order = torch.sort(tokens, stable=True).indices
    st = tokens[order]
    pos = torch.arange(st.numel())
    starts = torch.ones_like(st, dtype=torch.bool)
    starts[1:] = st[1:] != st[:-1]
    occ = torch.empty_like(pos)
    occ[order] = pos - torch.cummax(torch.where(starts, pos, 0), 0).values  # a pair's place among its token's
    if not logfmt:  # the native weighted sum: each token's rows in that order (ascending expert), bitwise the same
        K = plan["topk_idx"].size(1)
        sel = valid.nonzero().flatten()
        at = tokens[sel] * K + occ[sel]
        addr, wk = torch.zeros(T * K, dtype=torch.int64), torch.zeros(T * K, dtype=torch.float32)
        addr[at] = base[sel] + sel * (H * 2)
        wk[at] = wt.reshape(-1)[slots[sel]]
        out = torch.empty(T, H, dtype=torch.bfloat16)
        scratch = torch.empty(H, dtype=torch.float32)
        _call(w.caps.ll_combine, _LL_COMBINE(T=T, K=K, H=H, dst=out.data_ptr(), src=addr.data_ptr(), w=wk.data_ptr(),
                                             acc=scratch.data_ptr()))  # (``parts`` keeps every row alive)
        return out
    # the rows of every pair in one tensor (numpy, on this thread: see ``internode.Rows.pack``; zeros where an owner
    # is skipped)
    gotn = np.zeros((tokens.numel(), H), dtype=np.int16)
    for lo, hi, raw in parts:
        gotn[lo:hi] = raw.view(torch.int16).view(hi - lo, H).numpy()
    got = torch.from_numpy(gotn).view(torch.bfloat16)
    rows_f = logfmt_roundtrip(got).float() * wt.reshape(-1)[slots].unsqueeze(1)
    acc = torch.zeros(T, H, dtype=torch.float32)
    for j in range(int(occ.max()) + 1 if occ.numel() else 0):
        sel = ((occ == j) & valid).nonzero().flatten()
        acc[tokens[sel]] += rows_f[sel]
    return acc
