"""EP in plain torch, from every rank's inputs at once: the tests' oracle, never run by the product.

Every EP op runs on the native kernels (:mod:`.fast`, :mod:`.low_latency`). This module says what they
must produce: given every rank's inputs (a test rebuilds them from seeds, as payloads that encode their
source), each function returns what one rank must receive, in DeepEP's order and with the same
rounding, so tests compare the native results with these bit for bit.

Conventions (DeepEP's): ``R`` ranks, ``E`` experts, ``L = E // R`` local experts, expert ``e`` lives on
rank ``e // L``; ``topk_idx == -1`` selects no expert. A token goes to a rank once, however many of
that rank's experts it selected (normal mode), and once per selected expert (low-latency mode).
Sums are fp32, in the order the kernels add: normal combine by source rank, then the biases;
low-latency combine by ascending expert.
"""

from __future__ import annotations

import torch

from .layout import fp8_quantize

__all__ = ["dispatch_layout", "rank_lists", "channel_prefix", "send_head", "expert_pairs", "dispatch", "combine",
           "low_latency_dispatch", "low_latency_combine"]


# ---------------------------------------------------------------------------------------- routing maths
def dispatch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int):
    """``(num_tokens_per_rank [R] int32, num_tokens_per_expert [E] int32, is_token_in_rank [T, R] bool)``."""
    L = num_experts // num_ranks
    idx = topk_idx.long()
    T = idx.size(0)
    ranks = torch.where(idx >= 0, idx // L, num_ranks)  # -1 goes to a spare column, dropped below
    in_rank = torch.zeros(T, num_ranks + 1, dtype=torch.bool).scatter_(1, ranks, True)[:, :num_ranks].contiguous()
    per_expert = torch.bincount(idx.reshape(-1) + 1, minlength=num_experts + 1)[1:].to(torch.int32)
    return in_rank.sum(0, dtype=torch.int32), per_expert, in_rank


def rank_lists(is_token_in_rank: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(counts [R] int64, tokens [sum] int64)``: for each rank in order, its tokens ascending."""
    pairs = is_token_in_rank.t().nonzero()
    counts = torch.bincount(pairs[:, 0], minlength=is_token_in_rank.size(1))
    return counts, pairs[:, 1].contiguous()


def channel_prefix(is_token_in_rank: torch.Tensor, num_channels: int) -> torch.Tensor:
    """``[R, C]`` int32: inclusive prefix over channels of the tokens each channel sends to each rank.

    Channel ``c`` owns tokens ``[c * ceil(T / C), (c + 1) * ceil(T / C))`` (DeepEP's split).
    """
    T, R = is_token_in_rank.shape
    per = max(-(-T // num_channels), 1)
    chan = torch.arange(T) // per
    counts = torch.zeros(num_channels, R, dtype=torch.int64)
    if T:
        counts.index_add_(0, chan, is_token_in_rank.long())
    return counts.cumsum(0).t().contiguous().to(torch.int32)


def send_head(is_token_in_rank: torch.Tensor) -> torch.Tensor:
    """``[T, R]`` int32: position of token ``t`` among the tokens sent to rank ``r`` (-1: not sent)."""
    pos = is_token_in_rank.long().cumsum(0) - 1
    return torch.where(is_token_in_rank, pos, -1).to(torch.int32)


def expert_pairs(topk_idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Low-latency plan: ``(counts [E] int64, tokens [n] int64, slots [n] int64)``.

    The valid ``(token, slot)`` pairs sorted by expert, then token, then slot: expert ``e``'s
    rows are ``tokens[off[e]:off[e+1]]``; ``slots`` is the flat index ``t * K + k``.
    """
    T, K = topk_idx.shape
    flat = topk_idx.reshape(-1).long()
    slots = (flat >= 0).nonzero().flatten()
    experts = flat[slots]
    order = torch.sort(experts * (T * K) + slots, stable=True).indices
    slots = slots[order]
    counts = torch.bincount(experts, minlength=num_experts)
    return counts, slots // K, slots


# ---------------------------------------------------------------------------------------- normal mode
def _rows(x, sel):
    return (x[0][sel], x[1][sel]) if isinstance(x, tuple) else x[sel]


def _cat(parts: list):
    if parts and isinstance(parts[0], tuple):
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    return torch.cat(parts)


def dispatch(xs: list, in_ranks: list[torch.Tensor], rank: int, num_experts: int, *,
             topk_idx: list[torch.Tensor] | None = None, topk_weights: list[torch.Tensor] | None = None,
             expert_alignment: int = 1, num_channels: int | None = None) -> dict:
    """What ``rank`` receives from a normal dispatch: per source rank ``r`` (in rank order) the rows of
    ``xs[r]`` (a tensor, or an ``(x_fp8, scales)`` pair) whose ``in_ranks[r][:, rank]`` is set, in token order.

    Returns ``x`` (rows, or the pair), ``topk_idx`` (local expert ids, -1 for another rank's), ``topk_weights``
    (0 where -1), ``num_recv_tokens_per_expert_list`` (aligned up to ``expert_alignment``), ``rank_prefix_matrix``
    ``[R, R]`` int32 (``cumsum`` over sources of the token counts), ``src_idx`` int32 (the source tokens), and
    with ``num_channels`` the handle's ``channel_prefix_matrix``, ``recv_channel_prefix_matrix`` and
    ``send_head`` of ``rank``. Only the first ``num_recv`` rows are defined: ``num_worst_tokens`` padding is
    the caller's (DeepEP leaves it uninitialised but for -1 / 0 in top-k).
    """
    R = len(xs)
    L = num_experts // R
    sel = [m[:, rank] for m in in_ranks]
    out = {"x": _cat([_rows(x, s) for x, s in zip(xs, sel)]),
           "src_idx": torch.cat([s.nonzero().flatten() for s in sel]).to(torch.int32),
           "rank_prefix_matrix": torch.stack([m.sum(0) for m in in_ranks]).cumsum(0).to(torch.int32)}
    if topk_idx is not None:
        raw = torch.cat([i[s].long() for i, s in zip(topk_idx, sel)])
        local = (raw >= rank * L) & (raw < (rank + 1) * L)
        out["topk_idx"] = torch.where(local, raw - rank * L, torch.full_like(raw, -1))
        out["topk_weights"] = torch.where(local, torch.cat([w[s] for w, s in zip(topk_weights, sel)]), torch.zeros(()))
        counts = torch.bincount(out["topk_idx"][out["topk_idx"] >= 0], minlength=L).tolist()
        out["num_recv_tokens_per_expert_list"] = [-(-c // expert_alignment) * expert_alignment for c in counts]
    if num_channels is not None:
        out["channel_prefix_matrix"] = channel_prefix(in_ranks[rank], num_channels)
        recv = torch.zeros(R, num_channels, dtype=torch.int32)
        for r in range(R):
            recv[r, 1:] = channel_prefix(in_ranks[r], num_channels)[rank, :-1]
        out["recv_channel_prefix_matrix"] = recv
        out["send_head"] = send_head(in_ranks[rank])
    return out


def combine(ys: list[torch.Tensor], in_ranks: list[torch.Tensor], rank: int, *,
            topk_weights: list[torch.Tensor] | None = None, bias: tuple = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What ``rank`` gets back from a normal combine: ``ys[r]`` is rank ``r``'s combine input (its received rows,
    in dispatch order); each of ``rank``'s tokens sums, in fp32 and source-rank order, the row every rank it went
    to holds for it, then each bias; the result in ``ys``' dtype, and the same sum of ``topk_weights`` rows
    (fp32) when given."""
    R, mine = len(ys), in_ranks[rank]
    T, H = mine.size(0), ys[0].size(1)
    acc = torch.zeros(T, H, dtype=torch.float32)
    accw = torch.zeros(T, topk_weights[0].size(1), dtype=torch.float32) if topk_weights is not None else None
    head = send_head(mine).long()
    for r in range(R):
        toks = mine[:, r].nonzero().flatten()
        base = sum(int(in_ranks[s][:, r].sum()) for s in range(rank))  # rank's block in r's received rows
        rows = base + head[toks, r]
        acc[toks] += ys[r][rows].float()
        if accw is not None:
            accw[toks] += topk_weights[r][rows].float()
    for b in bias:
        acc += b.float()
    return acc.to(ys[0].dtype), accw


# ---------------------------------------------------------------------------------------- low-latency mode
def _drops(masks: list[int] | None, owner: int, source: int) -> bool:
    """Whether ``owner`` drops ``source``'s tokens (bit ``source`` of ``masks[owner]``: DeepEP's shrink masks)."""
    return masks is not None and bool((masks[owner] >> source) & 1)


def low_latency_dispatch(xs: list[torch.Tensor], topk_idx: list[torch.Tensor], rank: int, num_max_tokens: int,
                         num_experts: int, *, masks: list[int] | None = None, use_fp8: bool = False,
                         round_scale: bool = False, use_ue8m0: bool = False) -> dict:
    """What ``rank`` receives from a low-latency dispatch of every rank's ``xs[r]`` (bf16 ``[T_r, H]``) routed by
    ``topk_idx[r]``: a row per (token, selected expert) for this rank's experts, each local expert's rows
    ordered by source rank then source token.

    Returns ``x`` ``[L, N, H]`` (``N = R * num_max_tokens``; fp8 with ``use_fp8``, each source's rows cast by
    :func:`.layout.fp8_quantize`), ``scales`` ``[L, N, S]`` with ``use_fp8``, ``count`` ``[L]`` int32,
    ``src_info`` ``[L, N]`` int32 (the source token), ``layout_range`` ``[L, R]`` int64 (``begin << 32 | count``
    per source). Slots past ``count`` are undefined (zero here). ``masks[o]`` bit ``s``: owner ``o`` drops
    source ``s`` (all zero by default).
    """
    R, L, N = len(xs), num_experts // len(xs), len(xs) * num_max_tokens
    H = xs[0].size(1)
    cast = [fp8_quantize(x, round_scale=round_scale, ue8m0=use_ue8m0) if use_fp8 else (x, None) for x in xs]
    out = {"x": torch.zeros(L, N, H, dtype=cast[0][0].dtype), "count": torch.zeros(L, dtype=torch.int32),
           "src_info": torch.zeros(L, N, dtype=torch.int32), "layout_range": torch.zeros(L, R, dtype=torch.int64)}
    if use_fp8:
        out["scales"] = torch.zeros(L, N, cast[0][1].size(1), dtype=cast[0][1].dtype)
    for r in range(R):
        counts, tokens, _ = expert_pairs(topk_idx[r], num_experts)
        off = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
        for le in range(L):
            e = rank * L + le
            toks = tokens[off[e]:off[e] if _drops(masks, rank, r) else off[e + 1]]  # a dropped source: none
            begin, n = int(out["count"][le]), toks.numel()
            out["layout_range"][le, r] = begin << 32 | n
            out["x"][le, begin:begin + n] = cast[r][0][toks]
            out["src_info"][le, begin:begin + n] = toks.to(torch.int32)
            if use_fp8:
                out["scales"][le, begin:begin + n] = cast[r][1][toks]
            out["count"][le] += n
    return out


def low_latency_combine(expert_outputs: list[torch.Tensor], topk_idx: list[torch.Tensor], rank: int,
                        topk_weights: torch.Tensor, *, masks: list[int] | None = None) -> torch.Tensor:
    """What ``rank`` gets back from a low-latency combine: ``expert_outputs[o]`` ``[L, N, H]`` bf16 is owner ``o``'s
    output for the rows it received (as :func:`low_latency_dispatch` placed them, from every rank's
    ``topk_idx``); token ``t`` sums ``topk_weights[t, k] * row`` in fp32 over its selected experts in ascending
    expert order, skipping owners that drop ``rank`` or that ``rank`` drops; bf16 ``[T, H]``."""
    R = len(expert_outputs)
    L, _, H = expert_outputs[0].shape
    E = R * L
    idx = topk_idx[rank].long()
    T, K = idx.shape
    acc = torch.zeros(T, H, dtype=torch.float32)
    # where rank's rows start on each expert's owner: after the rows of the sources before it that it keeps
    before = torch.zeros(E, dtype=torch.int64)
    for s in range(rank):
        counts = expert_pairs(topk_idx[s], E)[0]
        kept = torch.tensor([not _drops(masks, e // L, s) for e in range(E)])
        before += counts * kept
    seen = torch.zeros(E, dtype=torch.int64)
    for t in range(T):
        for k in sorted(range(K), key=lambda k: int(idx[t, k])):  # ascending expert (-1 first, skipped)
            e = int(idx[t, k])
            if e < 0:
                continue
            o = e // L
            slot = int(before[e] + seen[e])
            seen[e] += 1
            if _drops(masks, o, rank) or _drops(masks, rank, o):
                continue
            acc[t] += expert_outputs[o][e - o * L, slot].float() * topk_weights[t, k]
    return acc.to(torch.bfloat16)
