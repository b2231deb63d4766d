"""The native EP kernels (``native/csrc/ep.c``) and the calls that drive them: one C call each for the layout,
the sender's plan block, the plan read, the row pull and the fp32 combine sum, so that an op's Python cost
does not grow with its rows.

These are the only implementation of EP's local steps: the plain-torch version of every op is
:mod:`.reference`, the tests' oracle, not a fallback. :class:`.caps.Capabilities` names the kernels, resolved
once from the native core when a Buffer is built; a core without them (no C compiler) is a clear
:class:`~zbccl.errors.ZbcclSystemError` there, never a slower path chosen op by op.

The calls run between the handshake (after it every peer's published plan block and operands are
readable) and the closing barrier, read peers' published blocks only through addresses bounds-checked
here for the whole block, and the kernels check every row index they take from a peer against that block.
"""

from __future__ import annotations

import time
from array import array

import torch

from ..errors import ZbcclInvalidUsageError
from ..native.abi import ep_args
from ..ops.dtypes import CODES
from .caps import Capabilities
from .exchange import F, Fail

__all__ = ["layout", "route", "plan", "pull", "combine_sum"]

_FIELDS = (("x", F.X, F.XROW), ("s", F.SCALES, F.SROW), ("i", F.TOPK, None), ("w", F.W, None))


#: Each kernel's argument block (abi.EP_ARGS), filled by field name: (head, per-rank row).
_LAYOUT, _ = ep_args("zb_ep_layout")
_ROUTE, _ = ep_args("zb_ep_route")
_PLAN, _PLAN_ROW = ep_args("zb_ep_plan")
_PULL, _PULL_ROW = ep_args("zb_ep_pull")
_COMBINE, _COMBINE_ROW = ep_args("zb_ep_combine")


def _call(fn, values: list) -> int:
    """``fn(address of the argument block values as int64)``; the block lives until the call returns."""
    arr = array("q", values)
    return fn(arr.buffer_info()[0])


def plan(buf, rows: list) -> tuple[torch.Tensor, list[int], torch.Tensor, list[tuple[int, int]]]:
    """``(counts [R, R] int64, per local expert counts, recv_channel_prefix [R, C] int32, plan blocks)``
    read from every sender's published plan block; ``plan blocks``: ``(address, int64 length)`` per rank."""
    ex, R, me = buf.ex, buf.ex.R, buf.ex.me
    E, C = rows[0][F.E], rows[0][F.CHANNELS]
    L = E // R if E else 0
    counts = torch.empty(R, R, dtype=torch.int64)
    per_expert = torch.empty(L, dtype=torch.int64)
    recv_chan = torch.empty(R, C, dtype=torch.int32)
    metas = [(ex.addr(r, rows[r][F.META], rows[r][F.NROWS] * 8), rows[r][F.NROWS]) for r in range(R)]
    args = _PLAN(R=R, me=me, E=E, C=C, L=L, counts_out=counts.data_ptr(), per_expert_out=per_expert.data_ptr(),
                 recv_chan_out=recv_chan.data_ptr())
    for meta, meta_len in metas:
        args += _PLAN_ROW(meta=meta, meta_len=meta_len)
    bad = _call(ex.caps.plan, args)
    if bad >= 0:
        raise ZbcclInvalidUsageError(f"dispatch: rank {bad}'s plan block is malformed, expected "
                                     f">= {R + E + R * C} int64 with counts >= 0", ranks=(bad,))
    return counts, per_expert.tolist(), recv_chan, metas


def pull(buf, rows: list, counts: torch.Tensor, metas: list, out: dict, num_recv: int) -> torch.Tensor:
    """Copy every sender's rows into ``out`` (``x``, optional ``s``, ``i``, ``w``); returns ``src_idx``
    ``[rows of out["x"]]`` int32 (-1 past ``num_recv``). Top-k become local expert ids (-1: another rank's)."""
    ex, R, me = buf.ex, buf.ex.R, buf.ex.me
    E, Cn, K = rows[me][F.E], rows[me][F.CHANNELS], rows[me][F.K]
    n = out["x"].size(0)
    src_idx = torch.full((n,), -1, dtype=torch.int32)
    widths = {"i": K * 8, "w": K * 4}
    xbytes = out["x"].numel() * out["x"].element_size()
    stream = ex.stores.choose(xbytes)
    fields = {"R": R, "me": me, "head": R + E + R * Cn, "L": E // R if E else 0, "K": K, "n_recv": num_recv,
              "src_idx_out": src_idx.data_ptr(), "stream": stream}
    row_of = []
    for key, _, row_field in _FIELDS:
        t = out.get(key)
        row = (rows[me][row_field] if row_field is not None else widths[key]) if t is not None else 0
        row_of.append(row)
        fields[key + "_dst"], fields[key + "_row"] = t.data_ptr() if t is not None else 0, row
    a = _PULL(**fields)
    for r in range(R):
        T_r = rows[r][F.T]
        src = {key + "_src": ex.addr(r, rows[r][field], T_r * row) if row and T_r else 0
               for (key, field, _), row in zip(_FIELDS, row_of)}
        a += _PULL_ROW(meta=metas[r][0], meta_len=metas[r][1], T=T_r, **src)
    t0 = time.perf_counter_ns()
    moved = _call(ex.caps.pull, a)
    ex.stores.record(stream, xbytes, time.perf_counter_ns() - t0)
    if moved < 0:
        bad = -moved - 1
        raise ZbcclInvalidUsageError(f"dispatch: rank {bad}'s token list is out of range, expected indices in "
                                     f"[0, {rows[bad][F.T]}) and {num_recv} rows in all", ranks=(bad,))
    ex.moved += moved
    if K and n > num_recv:  # num_worst_tokens padding: no expert, weight 0
        out["i"][num_recv:] = -1
        out["w"][num_recv:] = 0.0
    return src_idx


def combine_sum(buf, rows: list, handle, out: torch.Tensor, biases: list, K: int) -> torch.Tensor | None:
    """Sum in fp32, into ``out`` ``[T, H]``, the rows each rank holds for this rank's tokens (in rank order,
    then the biases); returns the summed weights ``[T, K]`` float32, or None without them."""
    ex, R, me = buf.ex, buf.ex.R, buf.ex.me
    rpm, in_rank, head = handle[0], handle[4].contiguous(), handle[5].contiguous()
    T, H = out.shape
    base = rpm[me - 1].tolist() if me else [0] * R
    accw = torch.empty(T, K, dtype=torch.float32) if K else None
    extras = [b.data_ptr() for b in biases] + [0, 0]
    a = _COMBINE(R=R, T=T, in_rank=in_rank.data_ptr(), head=head.data_ptr(),
                 x_dst=out.data_ptr(), x_width=H, x_itemsize=out.element_size(), x_dtype=CODES[out.dtype],
                 x_nextra=len(biases), x_extra0=extras[0], x_extra1=extras[1],
                 w_dst=accw.data_ptr() if K else 0, w_width=K, w_itemsize=4, w_dtype=CODES[torch.float32],
                 w_nextra=0, w_extra0=0, w_extra1=0)
    for r in range(R):
        nrows = rows[r][F.NRECV]
        a += _COMBINE_ROW(base=base[r], nrows=nrows,
                          x=ex.addr(r, rows[r][F.X], nrows * rows[r][F.XROW]) if nrows else 0,
                          w=ex.addr(r, rows[r][F.W], nrows * K * 4) if K and nrows else 0)
    moved = _call(ex.caps.combine, a)
    if moved < 0:
        bad = -moved - 1
        raise ZbcclInvalidUsageError(f"combine: the handle's rows for rank {bad} are out of range, expected < "
                                     f"{rows[bad][F.NRECV]} (its x rows)", ranks=(bad,))
    ex.moved += moved
    return accw


def layout(caps: Capabilities, topk_idx: torch.Tensor, num_experts: int, R: int, *, in_rank: bool = True):
    """``(num_tokens_per_rank [R] int32, num_tokens_per_expert [E] int32, is_token_in_rank [T, R] bool)`` of
    :func:`.reference.dispatch_layout` in one native pass (``in_rank=False``: only the per-expert counts, the
    others None); None when an entry is outside ``[-1, E)`` (the caller raises, naming the values)."""
    idx = topk_idx.contiguous()
    T, K = idx.shape
    per_rank = torch.empty(R, dtype=torch.int32) if in_rank else None
    per_expert = torch.empty(num_experts, dtype=torch.int32)
    where = torch.empty(T, R, dtype=torch.bool) if in_rank else None
    if _call(caps.layout, _LAYOUT(idx=idx.data_ptr(), T=T, K=K, E=num_experts, R=R,
                                  idx_is_int32=int(idx.dtype == torch.int32),
                                  per_rank_out=per_rank.data_ptr() if in_rank else 0,
                                  per_expert_out=per_expert.data_ptr(),
                                  in_rank_out=where.data_ptr() if in_rank else 0)) >= 0:
        return None
    return per_rank, per_expert, where


def route(buf, in_rank: torch.Tensor, counts: torch.Tensor, per_expert: torch.Tensor, C: int):
    """A sender's published plan block (see :mod:`.normal`) and its handle parts: ``(block offset, block
    int64 length, channel_prefix_matrix [R, C] int32, send_head [T, R] int32)``. ``counts`` ``[R]`` are the
    tokens per rank the caller expects (``num_tokens_per_rank``); :class:`Fail` if ``in_rank`` disagrees.
    The block is the Exchange's reusable plan block: the op's closing barrier ends every peer's reads."""
    ex = buf.ex
    T, R = in_rank.shape
    E = per_expert.numel()
    cl = counts.tolist()
    expect = array("q", cl)  # int64 for the kernel without a tensor conversion
    total = sum(c for c in cl if c > 0)
    if total > T * R:  # before sizing the block by it (the kernel checks each count exactly)
        raise Fail(f"num_tokens_per_rank does not match is_token_in_rank, expected {in_rank.sum(0).tolist()}, "
                   f"got {counts.tolist()}")
    n = R + E + R * C + total
    block = ex.plan_block(n)
    if E:
        block[R:R + E] = per_expert
    head = torch.empty(T, R, dtype=torch.int32)
    where = in_rank.contiguous()
    if _call(ex.caps.route, _ROUTE(in_rank=where.data_ptr(), T=T, R=R, C=C, E=E, meta=block.data_ptr(), meta_len=n,
                                   head_out=head.data_ptr(), expect=expect.buffer_info()[0])) >= 0:
        got = in_rank.sum(0)
        raise Fail(f"num_tokens_per_rank does not match is_token_in_rank, expected {got.tolist()}, "
                   f"got {counts.tolist()}")
    chan = block[R + E:R + E + R * C].view(R, C).to(torch.int32)
    return ex.offset_of(block), n, chan, head
