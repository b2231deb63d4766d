"""Normal combine over a group that spans hosts (DeepEP's internode mode): the reverse of :mod:`.internode`.

Protocol (rounds of :mod:`.wire`; ``docs/ep-internode.md``): each forwarder sums in fp32, for every token
it forwarded in the dispatch, the rows its host's ranks hold for that token (in rank order, read through
shm views) and stages the sums in the input's dtype (the weights' in fp32) behind a ``[status, offset]``
word pair. A forwarder alone on its host needs no other rank's ``x``: it sums before the header round and
its pairs ride in it. The others sum after the header round (which says where each local ``x`` lies) and
send them in a second round, which every rank takes part in when any host holds several ranks. A pair
carries its sums up to the eager limit, else ``offset`` says where the sender reads them. Each sender
sums its own host's rows the same way, then, in fp32, the biases and every host's sums in host order
(each rounded to ``x``'s dtype, as a remote host's are when they cross), rounded once into the output;
the sums are the native ``ep_combine`` kernel's. Every rank reads what it needs of this host's ``x``
before it enters the second round, which so ends those reads; the staged sums live until the next op's
header round.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import ZbcclInvalidUsageError, ZbcclOutOfMemoryError, ZbcclRemoteError
from ..native.abi import EP_OP_COMBINE as OP_COMBINE
from ..ops.dtypes import CODES
from .exchange import F, Fail
from .fast import _COMBINE, _COMBINE_ROW, _call
from .normal import _tensor
from .wire import FAILED, NO_ROOM

#: The ``[status, offset]`` int64 pair in front of each forwarded sender's sums (offset -1: the sums follow it).
_PAIR = 16

__all__ = ["combine"]


def _sum_rows(w, in_rank: np.ndarray, sources: list, dst: torch.Tensor, wdst: torch.Tensor | None,
              extras: list, who: list[int], what: str) -> None:
    """The native combine sum (``ep_combine``): for each row ``t`` of ``dst``, in fp32 and in this order, the
    ``extras`` rows, then row ``base + head[t, j]`` of each source ``j`` with ``in_rank[t, j]`` (uint8 ``[n, m]``,
    C order), rounded once into ``dst`` (and the same of the fp32 weights into ``wdst``). ``sources[j]``: ``(base,
    rows, x address, weights address)``; ``who[j]``: the group rank a bad row index of source ``j`` is blamed on."""
    n, m = in_rank.shape
    head = in_rank.cumsum(0, dtype=np.int32) - 1
    K = wdst.size(1) if wdst is not None else 0
    ex = [b.data_ptr() for b in extras] + [0, 0]
    a = _COMBINE(R=m, T=n, in_rank=in_rank.ctypes.data, head=head.ctypes.data, x_dst=dst.data_ptr(),
                 x_width=dst.size(1), x_itemsize=dst.element_size(), x_dtype=CODES[dst.dtype], x_nextra=len(extras),
                 x_extra0=ex[0], x_extra1=ex[1], w_dst=wdst.data_ptr() if K else 0, w_width=K, w_itemsize=4,
                 w_dtype=CODES[torch.float32], w_nextra=0, w_extra0=0, w_extra1=0)
    for base, rows, xa, wa in sources:
        a += _COMBINE_ROW(base=base, nrows=rows, x=xa, w=wa)
    moved = _call(w.caps.combine, a)
    if moved < 0:
        bad = who[-moved - 1]
        raise ZbcclRemoteError(f"combine: rank {bad}'s rows for {what} are out of range, expected each within the "
                               f"rows it published", ranks=(bad,))
    w.moved += moved


def _partial(buf, s: int, masks: torch.Tensor, host: int, rows, upto: np.ndarray, dst: torch.Tensor,
             wdst: torch.Tensor | None) -> None:
    """Into ``dst`` ``[n, H]`` (``x``'s dtype; ``wdst`` ``[n, K]`` fp32): the sums of the rows host ``host``'s ranks
    hold for sender ``s``'s tokens ``masks`` describes (bit ``j``: the host's ``j``-th rank got the token), in fp32
    and rank order. Rank ``r``'s rows for ``s`` follow its rows for the ranks before ``s``, by token (``upto[s, r]``:
    the rows rank ``r`` holds from ranks ``0..s``, the op's counts summed over sources)."""
    w = buf.wire
    ranks = w.hosts[host]
    K = wdst.size(1) if wdst is not None else 0
    bits = ((masks.numpy()[:, None] >> np.arange(len(ranks))) & 1).astype(np.uint8)
    sources = []
    for r in ranks:
        base, nrows = int(upto[s - 1, r]) if s else 0, min(rows[r][F.NRECV], int(upto[s, r]))  # never past s's rows
        xr = w.addr(r, rows[r][F.X], nrows * dst.size(1) * dst.element_size(), "combine") if nrows else 0
        wr = w.addr(r, rows[r][F.W], nrows * K * 4, "combine") if nrows and K else 0
        sources.append((base, nrows, xr, wr))
    _sum_rows(w, bits, sources, dst, wdst, [], ranks, f"rank {s}")


def _sum_layout(n: int, H: int, dtype: torch.dtype, K: int) -> tuple[int, int]:
    """``(offset of the weights' sums, bytes)`` of ``n`` tokens' sums: ``x``'s in ``dtype``, then, 8-byte aligned,
    the weights' in fp32."""
    xb = n * H * dtype.itemsize
    wat = -(-xb // 8) * 8 if K else xb
    return wat, wat + n * K * 4


def _stage_sums(buf, rows, fwd: dict, upto: np.ndarray, H: int, K: int, dtype, keep: list) -> list:
    """The forwarder's part of a combine: each forwarded sender's per-token sums, staged in ``dtype`` (then the
    weights' fp32 sums) behind their ``[status, offset]`` pair; returns the parts of the round that carries them
    (per group rank: the pair, with the sums up to the eager limit). ``rows[r]``: the combine header of each
    rank ``r`` of this host. Raises :class:`Fail` when the heap cannot hold them."""
    w = buf.wire
    parts: list = [None] * w.R
    size = {s: _sum_layout(masks.numel(), H, dtype, K)[1] for s, masks in fwd.items()}
    spans, total = {}, 0
    for s in fwd:
        spans[s] = total
        total += -(-(_PAIR + size[s]) // 64) * 64
    if not fwd:
        return parts
    staging = w.heap_block(total, "combine staging")
    keep.append(staging)
    base = w.offset_of(staging)
    for s, masks in fwd.items():
        n, at = masks.numel(), spans[s]
        body = at + _PAIR
        _partial(buf, s, masks, w.my_host, rows, upto,
                 staging[body:body + n * H * dtype.itemsize].view(dtype).view(n, H),
                 staging[body + _sum_layout(n, H, dtype, K)[0]:body + size[s]].view(torch.float32).view(n, K)
                 if K else None)
        eager = w.rides(s, _PAIR + size[s])
        staging[at:at + _PAIR].view(torch.int64).numpy()[:] = (0, -1 if eager else base + body)
        parts[s] = staging[at:at + (_PAIR + size[s] if eager else _PAIR)]
    w.stats["rdma_send_bytes"] += sum(size.values())
    w.stats["rdma_peak_bytes"] = max(w.stats["rdma_peak_bytes"], total)
    return parts


def _notify(w, fwd: dict, status: int, op: str) -> None:
    """A forwarder that failed: the second round with ``status`` for every sender it forwards for (so they raise
    too, instead of waiting), unless the round itself fails (a lost peer: the error raised already names it)."""
    pair = torch.tensor([status, -1], dtype=torch.int64).view(torch.uint8)
    try:
        w.step([pair if s in fwd else None for s in range(w.R)], op)
    except (ZbcclRemoteError, ZbcclInvalidUsageError):
        pass


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
    biases = [b.contiguous() for b in biases]
    K = 0
    if topk_weights is not None:
        wt = _tensor(topk_weights, "topk_weights", 2, (torch.float32,), (x.size(0), None))
        K = wt.size(1)
        fields[F.W] = w.place(wt, keep, "topk_weights")
    fields.update({F.H: H, F.K: K, F.DTYPE: CODES[x.dtype], F.NRECV: x.size(0), F.X: w.place(x, keep, "x"),
                   F.XROW: H * x.element_size()})
    return {"T": T, "H": H, "K": K, "dtype": x.dtype, "biases": biases, "extra": extra,
            "upto": extra["upto"], "per_host": extra["per_host"]}


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
    # A host of one rank: its rank's sums need no other rank's x, so they ride in the header round; a second round
    # carries the others' (every rank takes part in it when any host holds several ranks).
    alone = [len(rs) == 1 for rs in w.hosts]
    early = None
    if loc is not None and alone[w.my_host]:
        try:
            early = _stage_sums(buf, {w.me: fields}, loc["extra"]["fwd"], loc["upto"], loc["H"], loc["K"],
                                loc["dtype"], keep)
        except Fail as exc:
            fail = exc
    try:
        rows = w.publish("combine", fields, [], fail, early)
        rl = rows.tolist()
        w.agree("combine", rl, ((F.OP, "the op"), (F.H, "the hidden size"), (F.DTYPE, "x's dtype"),
                                (F.K, "topk_weights (given, num_topk)"),
                                (F.HANDLE, "the handle (from which dispatch)")))
        T, H, K, dtype, extra = loc["T"], loc["H"], loc["K"], loc["dtype"], loc["extra"]
        upto = loc["upto"]
        for r in range(w.R):
            if rl[r][F.NRECV] < int(upto[-1, r]):
                raise ZbcclInvalidUsageError(f"combine: rank {r}'s x does not match its handle, expected >= "
                                             f"{int(upto[-1, r])} rows, got {rl[r][F.NRECV]}", ranks=(r,))
        per_host = loc["per_host"]
        got = {}  # host -> its sums for this rank (all read before the second round: x may change after it)
        for h, (toks, masks) in enumerate(per_host):
            n = toks.numel()
            if h == w.my_host and n:
                wat, nbytes = _sum_layout(n, H, dtype, K)
                got[h] = torch.empty(nbytes, dtype=torch.uint8)
                _partial(buf, w.me, masks, h, rl, upto, got[h][:n * H * dtype.itemsize].view(dtype).view(n, H),
                         got[h][wat:].view(torch.float32).view(n, K) if K else None)
            elif alone[h] and n:  # the header round's, copied out if another round follows
                got[h] = _sums(w, w.forwarder(w.me, h), _sum_layout(n, H, dtype, K)[1])
                if not all(alone):  # (numpy: on this thread, see ``internode.Rows.pack``)
                    got[h] = torch.from_numpy(got[h].numpy().copy())
        if not all(alone):
            parts = [None] * w.R
            if not alone[w.my_host]:
                fwd = extra["fwd"]
                try:
                    parts = _stage_sums(buf, rl, fwd, upto, H, K, dtype, keep)
                except Fail:
                    _notify(w, fwd, NO_ROOM, "combine")
                    raise
                except Exception:
                    _notify(w, fwd, FAILED, "combine")
                    raise
            w.step(parts, "combine")
        out = w.reuse("combined_x", [((T, H), dtype)])[0]
        accw = _sum_hosts(buf, loc, out, per_host, got)
    finally:
        w.hold(keep)  # the sums staged for other hosts are read until the next op's header round
    return out, accw


def _sum_hosts(buf, loc: dict, out: torch.Tensor, per_host: list, got: dict) -> torch.Tensor | None:
    """Into ``out`` ``[T, H]``: this rank's tokens, the fp32 sum of the biases, then each host's sums in host order
    (from ``got``: its own host's and the header round's; else the second round's, or read where it says), each
    host's rounded to ``x``'s dtype first, as when it crosses; returns the weights' sums ``[T, K]`` fp32 (None
    without them)."""
    w, me = buf.wire, buf.wire.me
    T, H, K, dtype = loc["T"], loc["H"], loc["K"], loc["dtype"]
    in_host = np.zeros((T, w.H), dtype=np.uint8)
    sources, keep = [], []
    for h, (toks, _) in enumerate(per_host):
        n = toks.numel()
        in_host[toks.numpy(), h] = 1
        if not n:
            sources.append((0, 0, 0, 0))
            continue
        wat, nbytes = _sum_layout(n, H, dtype, K)
        raw = got[h] if h in got else _sums(w, w.forwarder(me, h), nbytes)
        if h != w.my_host:
            w.stats["rdma_recv_bytes"] += nbytes
        keep.append(raw)
        sources.append((0, n, raw.data_ptr(), raw.data_ptr() + wat if K else 0))
    accw = torch.empty(T, K, dtype=torch.float32) if K else None
    _sum_rows(w, in_host, sources, out, accw, loc["biases"], [w.forwarder(me, h) for h in range(w.H)],
              f"rank {me}")
    return accw


def _sums(w, f: int, nbytes: int) -> torch.Tensor:
    """Forwarder ``f``'s sums for this rank (``nbytes``): after their pair in this rank's slot, or read where it
    says; raises what the forwarder reported."""
    status, off = w.part(f, _PAIR).view(torch.int64).tolist()
    if status == NO_ROOM:
        raise ZbcclOutOfMemoryError(f"combine: rank {f} could not stage the sums it forwards (its heap is full)",
                                    ranks=(f,))
    if status != 0:
        raise ZbcclRemoteError(f"combine: rank {f} failed while staging the sums it forwards (its own error names the "
                               f"cause; {w.where(f)})", ranks=(f,))
    if off == -1:
        if not w.rides(f, _PAIR + nbytes):
            raise ZbcclRemoteError(f"combine: rank {f} sent sums in the round beyond the eager limit, expected an "
                                   f"offset for {nbytes} bytes, got none", ranks=(f,))
        return w.part(f, _PAIR + nbytes)[_PAIR:]
    return w.read(f, off, nbytes, "combine")
