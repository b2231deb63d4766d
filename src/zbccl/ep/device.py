"""EP on a device heap (CUDA): DeepEP's normal and low-latency modes over the device collectives.

What moves the rows is the communicator's device ``all_to_all_v`` (``ops/device.py``: one Triton kernel over
the peers' pointer tables, enqueued on the current stream): each receiver pulls its rows straight out of the
senders' heap blocks into its outputs. The routing around it (the layout, the packing of each sender's rows
by destination, the placement of received rows, the sums of combine) is torch on the same stream.

Normal mode (:func:`dispatch`, :func:`combine`). One header all_gather per dispatch carries every rank's
error flag, its tokens per rank and per expert: every rank then knows the ``[R, R]`` count matrix and sizes
its outputs exactly (one host sync here, where DeepEP's normal dispatch has its own), or raises with the rank
that failed. Each sender publishes the list of its rows by destination, and the peers pull each row from ``x``
where it is (``all_to_all_v(rows=)``): ``x`` itself when it is a heap tensor (``heap_scope``), else one heap copy
of it. One metadata row per token travels too (its top-k, weights, index and fp8 scales, as int32). The
receiver's rows come out ordered by source rank, then source token (DeepEP's order), and its top-k ids are
mapped to local experts (-1 elsewhere, weight 0). Combine sends each row back by the same splits reversed and
sums each token's rows in fp32, by source rank in order, then the biases: the same numbers on every run.
With ``num_worst_tokens`` (and for a cached dispatch, and while a CUDA graph is captured) the normal mode runs
with no host sync at all (:func:`_dispatch_free`), and so can be captured.

Low-latency mode (:func:`ll_dispatch`, :func:`ll_combine`): no host sync at all (no ``nonzero``, no
``bincount``: nothing whose size depends on device values), and its heap blocks are the Buffer's, sized for
the worst case and kept (:meth:`DeviceEP.block`): a call can be captured in a CUDA graph and replayed
(the rest of its memory comes from torch's allocator, which keeps a graph's). The per-expert counts go through a device all_to_all, the rows through an all_to_all_v whose
splits are device tensors, into a block sized for the worst case (``R * tmax * K`` rows); each row
then lands in its expert's slot, by source rank then source token. Expert ids outside ``[0, E)`` are
dropped (treated as -1) rather than checked, as checking would sync the host. Combine returns each expert
row to its source by the reverse splits, and the source sums ``weight * row`` per token in fp32 in
ascending expert order. FP8 (e4m3, per-128-channel scales, ``round_scale``/``ue8m0``) as on the CPU path.
Rank masks (``enable_shrink``) and LogFMT are not available on a device heap (the calls say so).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..errors import ZbcclError, ZbcclInvalidUsageError, ZbcclRemoteError
from .layout import fp8_quantize

__all__ = ["DeviceEP", "layout", "dispatch", "combine", "ll_dispatch", "ll_combine"]


@dataclass
class DeviceEP:
    """A Buffer's device side: ``ops(name)`` gives the group's device ops for op ``name`` (ordered on the current
    stream), ``empty(shape, dtype)`` a heap tensor on the device, ``in_heap(t)`` whether the peers can read ``t``
    where it is, ``rank``/``R`` this rank and the group size,
    ``ranks`` the group's global ranks (for error messages)."""

    ops: Callable[[str], object]
    empty: Callable[[tuple, torch.dtype], torch.Tensor]
    in_heap: Callable[[torch.Tensor], bool]
    rank: int
    R: int
    ranks: tuple
    #: The low-latency mode's heap blocks, kept by (role, shape, dtype): their sizes follow the Buffer's fixed
    #: worst case, not the call's tokens, and their addresses never change (a captured graph keeps them).
    blocks: dict = field(default_factory=dict)

    def block(self, role: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """A heap tensor of ``shape`` kept for ``role`` (contents undefined): the same one at every call."""
        key = (role, shape, dtype)
        t = self.blocks.get(key)
        if t is None:
            t = self.blocks[key] = self.empty(shape, dtype)
        return t

    def fail(self, op: str, error: str, launches: int = 1):
        """This rank's call is wrong where the peers cannot see it: they are told through the kernels' ERROR
        handshake (their next check raises :class:`ZbcclRemoteError` naming this rank), then this rank raises.
        ``launches``: the device ops the peers' calls enqueue (each is paired, so later calls stay in step)."""
        ops = self.ops(op)
        ops.refuse(op, ZbcclInvalidUsageError(f"{op}: {error}"), launches)


# ---------------------------------------------------------------------------------------- routing maths
def layout(topk_idx: torch.Tensor, num_experts: int, R: int):
    """``(num_tokens_per_rank [R] int32, num_tokens_per_expert [E] int32, is_token_in_rank [T, R] bool)`` on
    ``topk_idx``'s device (``-1``, and on a device any id outside ``[0, E)``, selects nothing)."""
    L = num_experts // R
    idx = topk_idx.long()
    ok = (idx >= 0) & (idx < num_experts)
    T = idx.size(0)
    ranks = torch.where(ok, idx // L, R)
    in_rank = torch.zeros(T, R + 1, dtype=torch.bool, device=idx.device).scatter_(1, ranks, True)[:, :R].contiguous()
    # a scatter into E + 1 bins, not bincount (which reads the largest id on the host): no sync, capturable
    bins = torch.where(ok, idx + 1, 0).reshape(-1)
    per_expert = torch.zeros(num_experts + 1, dtype=torch.int64, device=idx.device).scatter_add_(
        0, bins, torch.ones_like(bins))[1:]
    return in_rank.sum(0, dtype=torch.int32), per_expert.to(torch.int32), in_rank


def _send_order(in_rank: torch.Tensor) -> torch.Tensor:
    """The tokens a sender packs: for each destination rank in order, its tokens ascending."""
    return in_rank.t().nonzero()[:, 1].contiguous()


def _send_list(in_rank: torch.Tensor) -> torch.Tensor:
    """:func:`_send_order` without a host sync: int64 ``[R * T]``, its valid entries first (their count stays a
    device quantity), ``-1`` after them."""
    T, R = in_rank.shape
    m = in_rank.t().reshape(-1)
    pos = torch.where(m, torch.cumsum(m, 0) - 1, R * T)               # the entries past the valid ones: a spare
    out = torch.full((R * T + 1,), -1, dtype=torch.int64, device=in_rank.device)
    out.scatter_(0, pos, torch.arange(R * T, device=in_rank.device) % max(T, 1))
    return out[:R * T]


def _capturing(t: torch.Tensor) -> bool:
    """Whether ``t``'s stream is being captured into a CUDA graph (nothing may read device values then)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _channel_prefix(in_rank: torch.Tensor, C: int) -> torch.Tensor:
    """``[R, C]`` int32, DeepEP's channel_prefix_matrix (channel ``c`` owns tokens ``[c * ceil(T/C), ...)``)."""
    T, R = in_rank.shape
    per = max(-(-T // C), 1)
    chan = torch.arange(T, device=in_rank.device) // per
    counts = torch.zeros(C, R, dtype=torch.int64, device=in_rank.device)
    if T:
        counts.index_add_(0, chan, in_rank.long())
    return counts.cumsum(0).t().contiguous().to(torch.int32)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A float32/int32 tensor's bits as int32 (the metadata rows carry both)."""
    return t.contiguous().view(torch.int32) if t.dtype == torch.float32 else t.to(torch.int32)


# ---------------------------------------------------------------------------------------- normal mode
def dispatch(d: DeviceEP, x, topk_idx, topk_weights, in_rank, ntpr, ntpe, handle, *, expert_alignment: int = 1,
             num_worst_tokens: int = 0, num_channels: int = 10, error: str | None = None, known: bool = False,
             free: bool | None = None):
    """DeepEP's normal dispatch on device tensors: ``(recv_x, recv_topk_idx, recv_topk_weights, list, handle)``
    (a cached dispatch, ``handle`` given: ``(recv_x, None, None, None, None)``). ``x``: a tensor ``[T, H]`` or
    ``(x_fp8, scales [T, S])``; see :meth:`zbccl.ep.Buffer.dispatch`. ``known``: the layout tensors are, unchanged,
    what :func:`layout` made of this ``topk_idx``: the checks that read them on the host are skipped (each costs a
    device sync; ids outside ``[0, E)`` reach no expert either way). ``free``: no host sync at all
    (:func:`_dispatch_free`); by default with ``num_worst_tokens``, with a handle, and while capturing a CUDA
    graph (which needs ``num_worst_tokens``, as DeepEP's does)."""
    op, R, me = "dispatch", d.R, d.rank
    xq, scales = x if isinstance(x, tuple) else (x, None)
    cached = handle is not None
    if free is None:
        free = cached or num_worst_tokens > 0 or (isinstance(xq, torch.Tensor) and _capturing(xq))
    if error is None:
        error = _normal_error(d, xq, scales, topk_idx, topk_weights, in_rank, ntpr, ntpe, handle, expert_alignment,
                              num_worst_tokens, known or free)
        if error is None and free and not cached and num_worst_tokens <= 0:
            error = ("a dispatch captured in a CUDA graph needs num_worst_tokens > 0 (its outputs' sizes are fixed "
                     "at capture), got 0")
    if free:
        if error is not None:
            d.fail(op, error, launches=2 if cached else 3)  # the peers' header all_gather and two all_to_all_v
        return _dispatch_free(d, xq, scales, topk_idx, topk_weights, in_rank, ntpe, handle, num_worst_tokens,
                              num_channels)
    idx = topk_idx.long() if topk_idx is not None and error is None else None
    # The header: [flag, tokens to each rank, tokens per expert, the channels' prefix to each rank],
    # all_gathered: one host sync, and every rank learns which ranks failed their own checks (a failed rank
    # sends its flag and zero counts).
    E = ntpe.numel() if isinstance(ntpe, torch.Tensor) else 0
    C = num_channels
    n = 1 + R + E + R * C
    head = d.empty((n,), torch.int64)
    _header(head, R, E, C, in_rank, ntpe, error)
    heads = torch.empty(R * n, dtype=torch.int64, device=head.device)
    ops = d.ops(op)
    try:
        ops.all_gather(heads, head)
        ops.check(wait=True)  # a header of another length on some rank is reported here, by the kernels
    except ZbcclError:
        if error is not None:  # (this rank's call, wrong before its header's length was known)
            raise ZbcclInvalidUsageError(f"{op}: {error}") from None
        raise
    rows = heads.view(R, n).cpu()
    if error is not None:
        raise ZbcclInvalidUsageError(f"{op}: {error}")
    bad = [q for q in range(R) if rows[q, 0]]
    if bad:
        glob = tuple(d.ranks[q] for q in bad)
        raise ZbcclRemoteError(f"{op}: group rank(s) {bad} (global {list(glob)}) failed their own checks of this "
                               "call, expected a valid call on every rank, got an error raised there", ranks=glob)
    matrix = rows[:, 1:1 + R].tolist()
    T, H = xq.shape
    to = matrix[me]                                # rows this rank sends to each rank
    frm = [matrix[q][me] for q in range(R)]        # rows it receives from each rank
    n_recv = sum(frm)
    order = _send_order(in_rank)
    send_x, listed = _sendable(d, xq, order, None)
    K = idx.size(1) if idx is not None else 0
    S = scales.size(1) if scales is not None else 0
    meta = _meta(d.empty((order.numel(), 1 + 2 * K + S), torch.int32), order, idx, topk_weights, scales)
    recv_x = d.empty((n_recv, H), xq.dtype)
    recv_meta = torch.empty(n_recv, meta.size(1), dtype=torch.int32, device=xq.device)
    ops = d.ops(op)
    ops.all_to_all_v(_raw(recv_x), _raw(send_x), frm, to, rows=listed)
    ops.all_to_all_v(recv_meta, meta, frm, to)
    L = E // R
    recv_idx, recv_w, recv_scales = _received(recv_meta, None, me, L, K, scales)
    lst = None
    if K:
        per = rows[:, 1 + R + me * L:1 + R + (me + 1) * L].sum(0).tolist()
        lst = [-(-c // expert_alignment) * expert_alignment for c in per]
    h = _handle(rows.to(xq.device), R, E, num_channels, me, in_rank, recv_meta[:, 0].contiguous())
    return (recv_x, recv_scales) if S else recv_x, recv_idx, recv_w, lst, h


def _header(head: torch.Tensor, R: int, E: int, C: int, in_rank, ntpe, error: str | None) -> None:
    """A dispatch's header ``[flag, tokens to each rank, tokens per expert, the channels' prefix to each rank]``
    (a failed rank: its flag and zeros), written on the device."""
    head.zero_()
    if error is not None:
        head[0] = 1
    else:
        head[1:1 + R] = in_rank.sum(0)
        head[1 + R:1 + R + E] = ntpe.to(torch.int64)
        head[1 + R + E:] = _channel_prefix(in_rank, C).reshape(-1)


def _sendable(d: DeviceEP, xq: torch.Tensor, order: torch.Tensor, keep) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x where the peers read it, the row list by destination)``: ``x`` itself when it is a contiguous heap
    tensor, else a heap copy (every rank then passes a list, so every rank's pull is the same kind). ``keep``:
    a kept-block maker (:meth:`DeviceEP.block`) for a captured call, else None (fresh heap tensors)."""
    listed = _scratch(d, keep, "normal_rows", (order.numel(),), torch.int64)
    listed.copy_(order)
    if xq.is_contiguous() and d.in_heap(xq):
        return xq, listed
    send_x = _scratch(d, keep, "normal_x", tuple(xq.shape), xq.dtype)
    _raw(send_x).copy_(_raw(xq))
    return send_x, listed


def _meta(meta: torch.Tensor, order: torch.Tensor, idx, topk_weights, scales) -> torch.Tensor:
    """The metadata rows ``[token, top-k ids, top-k weights' bits, scales' bits]`` int32, by destination (``order``;
    its entries ``-1`` give rows that are never sent)."""
    K = idx.size(1) if idx is not None else 0
    tok = order.clamp(min=0)
    meta[:, 0] = order.to(torch.int32)
    if K:
        meta[:, 1:1 + K] = idx.long()[tok].to(torch.int32)
        meta[:, 1 + K:1 + 2 * K] = _bits(topk_weights.float()[tok])
    if scales is not None:
        meta[:, 1 + 2 * K:] = _bits(scales[tok])
    return meta


def _received(recv_meta: torch.Tensor, valid, me: int, L: int, K: int, scales):
    """``(recv_topk_idx, recv_topk_weights, recv_scales)`` from the received metadata rows: ids of this rank's
    experts made local, the others -1 with weight 0; ``valid`` (bool [rows] or None: all) marks the rows that
    arrived, the others get -1, 0 and zero scales."""
    recv_idx = recv_w = recv_scales = None
    if K:
        raw = recv_meta[:, 1:1 + K].long()
        local = (raw >= me * L) & (raw < (me + 1) * L)
        if valid is not None:
            local &= valid.unsqueeze(1)
        recv_idx = torch.where(local, raw - me * L, -1)
        recv_w = torch.where(local, recv_meta[:, 1 + K:1 + 2 * K].contiguous().view(torch.float32), 0.0)
    if scales is not None:
        raw = recv_meta[:, 1 + 2 * K:].contiguous()
        recv_scales = raw.view(torch.float32) if scales.dtype == torch.float32 else raw
        if valid is not None:
            recv_scales = torch.where(valid.unsqueeze(1), recv_scales, 0)
    return recv_idx, recv_w, recv_scales


def _handle(rows: torch.Tensor, R: int, E: int, C: int, me: int, in_rank: torch.Tensor, src_idx: torch.Tensor):
    """DeepEP's handle ``(rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx,
    is_token_in_rank, send_head)`` from the gathered headers ``rows`` ``[R, n]`` int64 (on the device)."""
    prefix = rows[:, 1:1 + R].cumsum(0).to(torch.int32)
    chans = rows[:, 1 + R + E:].reshape(R, R, C)      # [sender, destination, channel]
    chan = chans[me].to(torch.int32)
    # recv_channel_prefix_matrix: for each source, where each of its channels' rows start among its rows here
    recv_chan = torch.zeros(R, C, dtype=torch.int32, device=rows.device)
    recv_chan[:, 1:] = chans[:, me, :-1]
    pos = in_rank.long().cumsum(0) - 1
    send_head = torch.where(in_rank, pos, -1).to(torch.int32)
    return prefix, chan, recv_chan, src_idx, in_rank, send_head


def _dispatch_free(d: DeviceEP, xq, scales, topk_idx, topk_weights, in_rank, ntpe, handle, worst: int, C: int):
    """The normal dispatch with no host sync (capturable in a CUDA graph), DeepEP's ``num_worst_tokens`` mode:
    the outputs have ``worst`` rows (a cached dispatch: the handle's ``recv_src_idx`` rows), those past the
    received ones ``-1`` / 0 (their ``x`` undefined). The counts stay on the device: the header all_gather's rows
    give the splits of two ``all_to_all_v`` (``partial``: each pull bounded by the output, what does not fit
    reported by the kernels at the next check, never written). The layout's agreement with ``topk_idx`` is not
    checked (each check would read the device): ids outside this rank's experts arrive as -1."""
    op, R, me = "dispatch", d.R, d.rank
    dev = xq.device
    T, H = xq.shape
    keep = d.block if _capturing(xq) else None   # a replay reuses every heap address of the capture
    ops = d.ops(op)
    E = 0
    if handle is not None:
        counts, in_rank = _counts(handle[0]), handle[4]
        rows_out = handle[3].size(0)
    else:
        E = ntpe.numel()
        n = 1 + R + E + R * C
        head = _scratch(d, keep, "normal_head", (n,), torch.int64)
        _header(head, R, E, C, in_rank, ntpe, None)
        heads = torch.empty(R * n, dtype=torch.int64, device=dev)
        ops.all_gather(heads, head)
        rows = heads.view(R, n)
        counts = rows[:, 1:1 + R]
        rows_out = worst
    to = in_rank.sum(0)                                              # int64 [R]: rows to each rank
    frm = counts[:, me].contiguous()                                 # rows from each rank
    order = _send_list(in_rank)
    send_x, listed = _sendable(d, xq, order, keep)
    idx = topk_idx if handle is None else None
    K = idx.size(1) if idx is not None else 0
    S = scales.size(1) if scales is not None else 0
    shape = (order.numel(), 1 + 2 * K + S)
    meta = _meta(_scratch(d, keep, "normal_meta", shape, torch.int32), order, idx, topk_weights, scales)
    # the outputs: heap tensors eagerly; under capture torch's (the graph's pool keeps them for the replays)
    recv_x = d.empty((rows_out, H), xq.dtype) if keep is None else torch.empty(rows_out, H, dtype=xq.dtype, device=dev)
    recv_meta = torch.empty(rows_out, shape[1], dtype=torch.int32, device=dev)
    what = (f"all_to_all_v of dispatch into recv_x ({rows_out} rows: "
            + ("the handle's recv_src_idx" if handle is not None else "num_worst_tokens") + ")")
    ops.all_to_all_v(_raw(recv_x), _raw(send_x), frm, to, partial=True, rows=listed, name=what)
    ops.all_to_all_v(recv_meta, meta, frm, to, partial=True, name=what)
    valid = torch.arange(rows_out, device=dev) < frm.sum()
    L = E // R
    recv_idx, recv_w, recv_scales = _received(recv_meta, valid, me, L, K, scales)
    out_x = (recv_x, recv_scales) if S else recv_x
    if handle is not None:
        return out_x, None, None, None, None
    src_idx = torch.where(valid, recv_meta[:, 0], -1).contiguous()
    return out_x, recv_idx, recv_w, [] if K else None, _handle(rows, R, E, C, me, in_rank, src_idx)


def _scratch(d: DeviceEP, keep, role: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """A heap tensor the peers read: fresh, or under capture (``keep``: :meth:`DeviceEP.block`) the block kept for
    ``role`` and this shape, the same at every call."""
    return d.empty(shape, dtype) if keep is None else keep(role, shape, dtype)


def _counts(prefix: torch.Tensor) -> torch.Tensor:
    """The ``[R, R]`` int64 count matrix (rows: senders) from a handle's ``rank_prefix_matrix`` (its cumsum over
    senders), where the handle is."""
    counts = prefix.long()
    return torch.cat([counts[:1], counts[1:] - counts[:-1]])


def _matrix(prefix: torch.Tensor) -> list[list[int]]:
    """:func:`_counts` on the host (one sync)."""
    return _counts(prefix).cpu().tolist()


def _raw(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor as its bytes (the copies move bytes; the device ops take no fp8 dtype)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _normal_error(d, xq, scales, topk_idx, topk_weights, in_rank, ntpr, ntpe, handle, alignment, worst,
                  known: bool = False) -> str | None:
    """This rank's local checks of a normal dispatch (shapes, dtypes, devices; unless ``known``, the top-k range and
    the layout's agreement with it), or None."""
    R, dev = d.R, xq.device if isinstance(xq, torch.Tensor) else None
    if not isinstance(xq, torch.Tensor) or xq.dim() != 2:
        return f"x must be a [num_tokens, hidden] tensor, got {type(xq).__name__}"
    if xq.dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn):
        return f"x has the wrong dtype, expected bfloat16, float16, float32 or (float8_e4m3fn, scales), got {xq.dtype}"
    if (xq.dtype == torch.float8_e4m3fn) != (scales is not None):
        return "an fp8 x comes with its scales, expected (x_fp8, scales), got one without the other"
    if scales is not None and (scales.dim() != 2 or scales.size(0) != xq.size(0)
                               or scales.dtype not in (torch.float32, torch.int32)):
        return f"scales must be [num_tokens, n] float32 or int32, got {scales.dtype} {list(scales.shape)}"
    tensors = [t for t in (xq, scales, topk_idx, topk_weights, in_rank, ntpr, ntpe) if t is not None]
    if any(t.device != dev for t in tensors):
        return f"every tensor must be on {dev}, got {[str(t.device) for t in tensors]}"
    T = xq.size(0)
    if handle is not None:
        if not isinstance(handle, tuple) or len(handle) != 6 or handle[4].shape != (T, R):
            return f"handle must be a dispatch's 6-tuple for these {T} tokens, got {type(handle).__name__}"
        return None
    for name, t in (("num_tokens_per_rank", ntpr), ("is_token_in_rank", in_rank), ("num_tokens_per_expert", ntpe)):
        if t is None:
            return f"{name} is required without a handle, expected a tensor, got None"
    if in_rank.dtype != torch.bool or in_rank.shape != (T, R) or ntpr.shape != (R,):
        return (f"is_token_in_rank must be [{T}, {R}] bool and num_tokens_per_rank [{R}], got "
                f"{in_rank.dtype} {list(in_rank.shape)} and {list(ntpr.shape)}")
    E = ntpe.numel()
    if E == 0 or E % R:
        return f"num_experts must be a positive multiple of the {R} ranks, got {E}"
    if (topk_idx is None) != (topk_weights is None):
        return "topk_idx and topk_weights go together, expected both or neither, got one"
    if topk_idx is not None:
        if topk_idx.dtype not in (torch.int64, torch.int32) or topk_weights.dtype != torch.float32:
            return f"topk_idx must be int64 (or int32) and topk_weights float32, got {topk_idx.dtype} and {topk_weights.dtype}"
        if topk_idx.dim() != 2 or topk_idx.size(0) != T or topk_weights.shape != topk_idx.shape:
            return (f"topk_idx and topk_weights must be [{T}, num_topk], got {list(topk_idx.shape)} and "
                    f"{list(topk_weights.shape)}")
        lo, hi = (-1, -1) if known or not topk_idx.numel() else (int(topk_idx.min()), int(topk_idx.max()))
        if lo < -1 or hi >= E:
            return f"topk_idx out of range, expected -1 or [0, {E}), got values in [{lo}, {hi}]"
        if not known and not torch.equal(layout(topk_idx, E, R)[1], ntpe.to(torch.int32)):
            return "num_tokens_per_expert does not match topk_idx, expected get_dispatch_layout's counts"
    elif worst:
        return "num_worst_tokens needs topk_idx and topk_weights, got neither"
    if alignment < 1:
        return f"expert_alignment must be >= 1, got {alignment}"
    if not known and not torch.equal(ntpr.to(torch.int64), in_rank.sum(0)):
        return (f"num_tokens_per_rank does not match is_token_in_rank, expected {in_rank.sum(0).tolist()}, got "
                f"{ntpr.tolist()}")
    return None


def combine(d: DeviceEP, x: torch.Tensor, handle: tuple, topk_weights=None, bias=(), error: str | None = None,
            free: bool | None = None):
    """DeepEP's normal combine on device tensors: ``(combined_x [T, H], combined_topk_weights or None)``. ``free``:
    no host sync (by default while capturing a CUDA graph): the counts stay on the device, the rows coming back
    land in a block of one row per (token, rank) pair that could exist (``T * R``), and each token's rows are
    summed by source rank in order, as here."""
    op, R, me = "combine", d.R, d.rank
    if error is None:
        if not isinstance(handle, tuple) or len(handle) != 6:
            error = f"handle must be a dispatch's 6-tuple, got {type(handle).__name__}"
        elif not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16,
                                                                                torch.float32):
            error = "x must be a [num_recv, hidden] bfloat16, float16 or float32 tensor"
    launches = 1 + (topk_weights is not None)  # the peers' all_to_all_v of the rows (and of the weights)
    if error is not None:
        d.fail(op, error, launches)
    if free is None:
        free = _capturing(x)
    in_rank = handle[4]
    T = in_rank.size(0)
    if free:
        keep = d.block if _capturing(x) else None
        counts = _counts(handle[0])
        to, frm = counts[me].contiguous(), counts[:, me].contiguous()
        n = T * R  # the most rows that can come back; row n is a zero row for the pairs that do not exist
        start = torch.cumsum(to, 0) - to
        slot = torch.where(in_rank, start.unsqueeze(0) + handle[5].long(), n)   # [T, R]: where (t, q)'s row lands
        rows = None
    else:
        matrix = _matrix(handle[0])
        to, frm = matrix[me], [matrix[q][me] for q in range(R)]
        n_recv = sum(frm)
        if x.size(0) < n_recv or (topk_weights is not None and topk_weights.size(0) < n_recv):
            d.fail(op, f"x must hold the {n_recv} rows this rank received, got {x.size(0)}", launches)
        x, topk_weights = x[:n_recv], topk_weights[:n_recv] if topk_weights is not None else None
        n, keep, rows = sum(to), None, (_send_order(in_rank), to)
    ops = d.ops(op)
    acc = _sum_back(ops, _heap(d, x, keep, "combine_x"), n, T, frm, to, slot if free else None, rows)
    accw = None
    if topk_weights is not None:
        wsrc = _heap(d, topk_weights.float(), keep, "combine_w")
        accw = _sum_back(ops, wsrc, n, T, frm, to, slot if free else None, rows)
    for b in bias or ():
        acc += b.float()
    return acc.to(x.dtype), accw


def _sum_back(ops, src: torch.Tensor, n: int, T: int, frm, to, slot, rows) -> torch.Tensor:
    """Each token's rows sent back (``src``'s, ``frm`` of them from each source) summed in fp32 by source rank in
    order (each source's block holds distinct tokens, so every run gives the same bits). Where they land: ``slot``
    ``[T, R]`` (row ``n`` of ``n + 1``: zeros), or, with host counts, ``rows`` ``(the send order, to)``."""
    back = torch.empty(n + (slot is not None), src.size(1), dtype=src.dtype, device=src.device)
    ops.all_to_all_v(back[:n], src, to, frm, partial=slot is not None)
    acc = torch.zeros(T, src.size(1), dtype=torch.float32, device=src.device)
    if slot is not None:
        back[n:].zero_()
        for q in range(slot.size(1)):
            acc += back[slot[:, q]].float()
        return acc
    order, counts = rows
    start = 0
    for c in counts:
        if c:
            acc.index_add_(0, order[start:start + c], back[start:start + c].float())
        start += c
    return acc


def _heap(d: DeviceEP, t: torch.Tensor, keep=None, role: str = "") -> torch.Tensor:
    """``t`` where the peers can read it: itself when it is a contiguous heap tensor, else a copy in a heap block
    (``keep``: :meth:`DeviceEP.block`'s for ``role``, under capture)."""
    if t.is_contiguous() and d.in_heap(t):
        return t
    out = _scratch(d, keep, role, tuple(t.shape), t.dtype)
    out.copy_(t)
    return out


# ---------------------------------------------------------------------------------------- low-latency mode
def _pairs(topk_idx: torch.Tensor, E: int):
    """``(counts [E] int64, tokens [n], slots [n])``: the valid (token, slot) pairs sorted by expert, then token,
    then slot, on the device (ids outside ``[0, E)`` dropped); ``n`` stays a device quantity of the sort."""
    T, K = topk_idx.shape
    flat = topk_idx.reshape(-1).long()
    valid = (flat >= 0) & (flat < E)
    key = torch.where(valid, flat, E) * (T * K) + torch.arange(T * K, device=flat.device)
    order = torch.sort(key).indices  # invalid pairs sort last (expert E)
    experts = torch.where(valid, flat, E)[order]
    # bincount would read the largest value on the host; a scatter into E + 1 bins does not
    counts = torch.zeros(E + 1, dtype=torch.int64, device=flat.device).scatter_add_(0, experts,
                                                                                    torch.ones_like(experts))[:E]
    return counts, order // K, order, experts


#: The device ops a low-latency dispatch enqueues: the counts' all_to_all and the rows' and metadata's all_to_all_v.
LL_LAUNCHES = 3


def ll_dispatch(d: DeviceEP, x: torch.Tensor, topk_idx: torch.Tensor, tmax: int, E: int, *, use_fp8: bool,
                round_scale: bool, use_ue8m0: bool):
    """DeepEP's low-latency dispatch on device tensors: ``(recv_x or (x_fp8, scales), count [L] int32, src_info
    [L, N] int32, layout_range [L, R] int64)``, with no host sync."""
    op, R = "low_latency_dispatch", d.R
    T, H = x.shape
    K = topk_idx.size(1)
    L, N = E // R, R * tmax
    M = R * tmax * K  # most rows any rank can receive (K per token even if a token repeats an expert)
    dev = x.device
    if T > tmax:  # the blocks are sized for tmax tokens (the Buffer checks this first; here the peers hear of it)
        d.fail(op, f"{T} tokens, expected at most num_max_dispatch_tokens_per_rank ({tmax})", LL_LAUNCHES)
    counts, tokens, _, experts = _pairs(topk_idx, E)
    n_pairs = int(T * K)
    # pairs past the valid ones (expert E) are never sent: every split counts valid ones only
    per_rank = counts.view(R, L).sum(1)                                  # rows to each rank
    ops = d.ops(op)
    # expert counts to each owner: [R, L] -> every source's counts for this rank's experts
    ecount = d.block("ll_counts", (R * L,), torch.int64)
    ecount.copy_(counts)
    # zeros: if a peer's call failed, the kernel moves nothing and reports it (at this rank's next check), and
    # the splits below then move nothing either, instead of whatever the memory held
    got = torch.zeros(R * L, dtype=torch.int64, device=dev)
    ops.all_to_all(got, ecount)
    got = got.view(R, L)                                                 # [source, local expert]
    frm = got.sum(1)                                                     # rows from each source
    if use_fp8:
        xq, sc = fp8_quantize(x, round_scale=round_scale, ue8m0=use_ue8m0)
    else:
        xq, sc = x, None
    S = sc.size(1) if sc is not None else 0
    send = d.block("ll_send", (tmax * K, H), xq.dtype)
    _raw(send)[:n_pairs] = _raw(xq)[tokens]      # sorted by expert, then token: grouped by destination rank
    meta = d.block("ll_meta", (tmax * K, 2 + S), torch.int32)
    meta[:n_pairs, 0] = tokens.to(torch.int32)
    meta[:n_pairs, 1] = (experts % max(L, 1)).to(torch.int32)
    if S:
        meta[:n_pairs, 2:] = _bits(sc[tokens])
    recv = torch.empty(M, H, dtype=xq.dtype, device=dev)
    rmeta = torch.empty(M, 2 + S, dtype=torch.int32, device=dev)
    in_splits, out_splits = per_rank.contiguous(), frm.contiguous()
    ops.all_to_all_v(_raw(recv), _raw(send), out_splits, in_splits, partial=True)
    ops.all_to_all_v(rmeta, meta, out_splits, in_splits, partial=True)
    # each received row's slot: expert le's rows by source rank, then source token
    block = torch.cumsum(frm, 0) - frm                                   # where each source's rows start
    i = torch.arange(M, device=dev)
    total = frm.sum()
    src = torch.searchsorted(torch.cumsum(frm, 0), i, right=True).clamp(max=R - 1)
    le = rmeta[:, 1].long().clamp(0, max(L - 1, 0))
    inner = torch.cumsum(got, 1) - got                                   # [source, le]: le's rows within a block
    begin = torch.cumsum(got, 0) - got                                   # [source, le]: le's slots before source
    pos = begin[src, le] + (i - block[src] - inner[src, le])
    valid = i < total
    flat = torch.where(valid, le * N + pos, L * N)                       # invalid rows go to a spare slot
    out_x = torch.zeros(L * N + 1, H, dtype=_raw(xq).dtype, device=dev)
    out_x[flat] = _raw(recv)
    out_x = out_x.view(xq.dtype)
    src_info = torch.zeros(L * N + 1, dtype=torch.int32, device=dev)
    src_info[flat] = rmeta[:, 0]
    count = got.sum(0).to(torch.int32)
    layout_range = (begin.t() << 32 | got.t()).contiguous()
    recv_x = out_x[:L * N].view(L, N, H)
    if S:
        scales = torch.zeros(L * N + 1, S, dtype=sc.dtype, device=dev)
        raw = rmeta[:, 2:].contiguous()
        scales[flat] = raw.view(torch.float32) if sc.dtype == torch.float32 else raw
        # DeepEP's scales are column-major in the last two dims
        cm = scales[:L * N].view(L, N, S).transpose(1, 2).contiguous().transpose(1, 2)
        recv_x = (recv_x, cm)
    return recv_x, count, src_info[:L * N].view(L, N), layout_range


def ll_combine(d: DeviceEP, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: tuple,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """DeepEP's low-latency combine on device tensors: ``combined [T, H]`` bf16, with no host sync."""
    op, R = "low_latency_combine", d.R
    src_info, layout_range, tmax, H, E = handle
    L, N = E // R, R * tmax
    T, K = topk_idx.shape
    dev = x.device
    M = R * tmax * K
    got = (layout_range & 0xFFFFFFFF).t().contiguous()                   # [source, le]
    begin = (layout_range >> 32).t().contiguous()
    to_src = got.sum(1)                                                  # rows back to each source
    # pack: rows back to each source, by expert then slot (the order that source sent them in)
    start = torch.cumsum(to_src, 0) - to_src
    inner = torch.cumsum(got, 1) - got
    slot = torch.arange(N, device=dev)
    les = torch.arange(L, device=dev)
    # for every (le, slot): its source rank (the block of layout_range it falls in) and its send position
    ends = (begin + got).t()                                             # [le, source]
    src = torch.searchsorted(ends.contiguous(), slot.expand(L, N).contiguous(), right=True).clamp(max=R - 1)
    b = begin.t().gather(1, src)                                         # [le, N]
    valid = slot.unsqueeze(0) < got.sum(0).unsqueeze(1)
    pos = start[src] + inner.t()[les.unsqueeze(1), src] + (slot.unsqueeze(0) - b)
    dest = torch.where(valid, pos, M)
    send = d.block("ll_back", (M + 1, H), x.dtype)
    send[dest.reshape(-1)] = x.reshape(L * N, H)
    counts, tokens, slots, experts = _pairs(topk_idx, E)
    per_rank = counts.view(R, L).sum(1)                                  # what this rank sent to each owner
    back = torch.empty(T * K + 1, H, dtype=x.dtype, device=dev)
    ops = d.ops(op)
    ops.all_to_all_v(back[:T * K], send[:M], per_rank, to_src, partial=True)
    # back[j] is the expert row of pair j (sorted by expert): sum weight * row per token, ascending expert
    rows = torch.zeros(T * K + 1, H, dtype=torch.float32, device=dev)
    n_valid = counts.sum()
    j = torch.arange(T * K, device=dev)
    where = torch.where(j < n_valid, slots, T * K)                        # pair j's (token, slot); invalid: spare
    w = torch.cat([topk_weights.reshape(-1).float(), torch.zeros(1, device=dev)])
    rows[where] = back[:T * K].float() * w[where].unsqueeze(1)
    rows = rows[:T * K].view(T, K, H)
    order = torch.sort(torch.where((topk_idx >= 0) & (topk_idx < E), topk_idx.long(), E), dim=1, stable=True).indices
    acc = torch.zeros(T, H, dtype=torch.float32, device=dev)
    for k in range(K):  # ascending expert per token: the sum's order is fixed, so every run gives the same bits
        acc += rows.gather(1, order[:, k].view(T, 1, 1).expand(T, 1, H)).squeeze(1)
    result = acc.to(torch.bfloat16)
    if out is not None:
        out.copy_(result)
        return out
    return result
