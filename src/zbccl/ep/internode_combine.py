"""Normal combine over a group that spans hosts (DeepEP's internode mode): the reverse of :mod:`.internode`.

Protocol (rounds of :mod:`.wire`; ``docs/ep-internode.md``): after the header round (each rank's ``x``
and weights, in its heap), each forwarder sums in fp32, for every token it forwarded in the dispatch,
the rows its host's ranks hold for that token (in rank order, read through shm views), stages the sums
in the input's dtype (the weights' in fp32), and pushes each sender the offset and ``FORWARDED[f]``;
each sender sums its own host's rows the same way, waits for its forwarders, reads each host's sums in
one transfer, and adds the per-host sums in host order, then the biases. A barrier of this host's ranks
ends the op (they read ``x`` in place); the staged sums live until the next op's header round.
"""

from __future__ import annotations

import torch

from ..errors import ZbcclInvalidUsageError, ZbcclRemoteError
from ..native.abi import EP_OP_COMBINE as OP_COMBINE
from ..ops.dtypes import CODES
from .exchange import F, Fail
from .internode import host_layout
from .normal import _tensor
from .wire import FAILED, NO_ROOM

__all__ = ["combine"]


def _partial(buf, s: int, masks: torch.Tensor, host: int, rows: list, counts: torch.Tensor, H: int, K: int,
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 sums ``[n, H]`` (and ``[n, K]``) of the rows host ``host``'s ranks hold for sender ``s``'s tokens
    ``masks`` describes (bit ``j``: the host's ``j``-th rank got the token), in rank order."""
    w = buf.wire
    n = masks.numel()
    acc = torch.zeros(n, H, dtype=torch.float32)
    accw = torch.zeros(n, K, dtype=torch.float32) if K else None
    for j, r in enumerate(w.hosts[host]):
        bit = (masks >> j) & 1
        sel = bit.nonzero().flatten()
        if not sel.numel():
            continue
        base = int(counts[:s, r].sum())
        at = base + (bit.cumsum(0) - 1)[sel]
        nrows = rows[r][F.NRECV]
        if int(at.max()) >= nrows or base + sel.numel() > int(counts[:s + 1, r].sum()):
            raise ZbcclRemoteError(f"combine: rank {r}'s rows for rank {s} are out of range, expected < {nrows} "
                                   f"(its x rows)", ranks=(r,))
        xr = w.view(r, rows[r][F.X], nrows * rows[r][F.XROW], "combine").view(dtype).view(nrows, H)
        acc[sel] += xr[at].float()
        if K:
            wr = w.view(r, rows[r][F.W], nrows * K * 4, "combine").view(torch.float32).view(nrows, K)
            accw[sel] += wr[at]
        w.moved += sel.numel() * rows[r][F.XROW]
    return acc, accw


def _stage_sums(buf, rows: list, fwd: dict, counts, H: int, K: int, dtype, header_round: int, keep: list) -> None:
    """The forwarder's part of a combine: each forwarded sender's per-token sums, staged in ``dtype`` (then the
    weights' fp32 sums), then ``FORWARD``."""
    w = buf.wire
    row = H * dtype.itemsize + 4 * K
    total = sum(m.numel() for m in fwd.values()) * row
    try:
        staging = w.heap_block(total, "combine staging")
    except Fail:
        w.push_forwarded(header_round, {s: NO_ROOM for s in fwd}, "combine")
        raise
    keep.append(staging)
    where, at = {}, 0
    try:
        for s, masks in fwd.items():
            n = masks.numel()
            acc, accw = _partial(buf, s, masks, w.my_host, rows, counts, H, K, dtype)
            staging[at:at + n * H * dtype.itemsize].view(dtype).view(n, H).copy_(acc)
            if K:
                staging[at + n * H * dtype.itemsize:at + n * row].view(torch.float32).view(n, K).copy_(accw)
            where[s] = w.offset_of(staging) + at
            at += n * row
    except BaseException:
        w.push_forwarded(header_round, {s: FAILED for s in fwd}, "combine")
        raise
    w.stats["rdma_send_bytes"] += total
    w.stats["rdma_peak_bytes"] = max(w.stats["rdma_peak_bytes"], total)
    w.push_forwarded(header_round, where, "combine")


def _prepare_combine(buf, x, handle, topk_weights, bias, error, fields: dict, keep: list) -> dict:
    w = buf.wire
    if error:
        raise Fail(error)
    x = _tensor(x, "x", 2, (torch.bfloat16, torch.float16, torch.float32))
    if not isinstance(handle, (tuple, list)) or len(handle) != 10:
        raise Fail(f"handle must be the 10-tuple an internode dispatch returned, got {type(handle).__name__}")
    fields[F.HANDLE], extra = buf.lookup(handle[7], "combine")
    if x.size(0) != handle[7].size(0):
        raise Fail(f"x does not match the handle, expected {handle[7].size(0)} rows, got {x.size(0)}")
    T, H = handle[0].size(0), x.size(1)
    biases = [b for b in (bias if isinstance(bias, tuple) else (bias,)) if b is not None]
    for i, b in enumerate(biases):
        _tensor(b, f"bias[{i}]", 2, (x.dtype,), (T, H))
    K = 0
    if topk_weights is not None:
        wt = _tensor(topk_weights, "topk_weights", 2, (torch.float32,), (x.size(0), None))
        K = wt.size(1)
        fields[F.W] = w.place(wt, keep, "topk_weights")
    fields.update({F.H: H, F.K: K, F.DTYPE: CODES[x.dtype], F.NRECV: x.size(0), F.X: w.place(x, keep, "x"),
                   F.XROW: H * x.element_size()})
    return {"T": T, "H": H, "K": K, "dtype": x.dtype, "biases": biases, "extra": extra, "in_rank": handle[0]}


def combine(buf, x, handle, topk_weights, bias, error: str | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Normal combine across hosts (see :meth:`zbccl.ep.Buffer.combine`)."""
    w = buf.wire
    for key in ("rdma_send_bytes", "rdma_recv_bytes", "nvl_bytes"):
        w.stats[key] = 0
    fields, keep, fail, loc = {F.OP: OP_COMBINE, F.SEQ: buf.seq}, [], None, None
    try:
        loc = _prepare_combine(buf, x, handle, topk_weights, bias, error, fields, keep)
    except Fail as exc:
        fail = exc
    rows = w.publish("combine", fields, [], fail)
    header_round = w.round
    rl = rows.tolist()
    w.agree("combine", rl, ((F.OP, "the op"), (F.H, "the hidden size"), (F.DTYPE, "x's dtype"),
                            (F.K, "topk_weights (given, num_topk)"), (F.HANDLE, "the handle (from which dispatch)")))
    T, H, K, dtype, extra = loc["T"], loc["H"], loc["K"], loc["dtype"], loc["extra"]
    counts = extra["counts"]
    for r in range(w.R):
        if rl[r][F.NRECV] < int(counts[:, r].sum()):
            raise ZbcclInvalidUsageError(f"combine: rank {r}'s x does not match its handle, expected >= "
                                         f"{int(counts[:, r].sum())} rows, got {rl[r][F.NRECV]}", ranks=(r,))
    try:
        _stage_sums(buf, rl, extra["fwd"], counts, H, K, dtype, header_round, keep)
        acc, accw = _sum_hosts(buf, rl, loc, counts, header_round)
    finally:
        w.hold(keep)  # the sums staged for other hosts are read until the next op's header round
        w.local_barrier(header_round, "combine")  # x is read in place by this host's ranks: then it may change
    for b in loc["biases"]:
        acc += b.float()
    out = w.reuse("combined_x", [((T, H), dtype)])[0]
    out.copy_(acc)
    return out, accw


def _sum_hosts(buf, rl: list, loc: dict, counts, header_round: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This rank's tokens: the fp32 sum of its own host's rows and every other host's staged sums, in host order."""
    w, me = buf.wire, buf.wire.me
    T, H, K, dtype = loc["T"], loc["H"], loc["K"], loc["dtype"]
    per_host = host_layout(loc["in_rank"], w.hosts)
    need = sorted(w.forwarder(me, h) for h, (t, _) in enumerate(per_host) if h != w.my_host and t.numel())
    offs = w.wait_forwarded(need, header_round, "combine")
    acc = torch.zeros(T, H, dtype=torch.float32)
    accw = torch.zeros(T, K, dtype=torch.float32) if K else None
    row = H * dtype.itemsize + 4 * K
    for h, (toks, masks) in enumerate(per_host):
        n = toks.numel()
        if not n:
            continue
        if h == w.my_host:
            part, partw = _partial(buf, me, masks, h, rl, counts, H, K, dtype)
        else:
            f = w.forwarder(me, h)
            raw = w.read(f, offs[f], n * row, "combine")
            part = raw[:n * H * dtype.itemsize].view(dtype).view(n, H).float()
            partw = raw[n * H * dtype.itemsize:].view(torch.float32).view(n, K) if K else None
            w.stats["rdma_recv_bytes"] += n * row
            w.moved += n * row
        acc[toks] += part
        if K:
            accw[toks] += partw
    return acc, accw
