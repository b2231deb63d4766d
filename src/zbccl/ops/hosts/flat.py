"""The flat algorithms across hosts: every op as one chunked exchange among all members (``HostOps.exchange``).

Each works for any topology (an unequal number of ranks per host included). The agreement step carries
the first chunk of every payload, so a message of up to one chunk costs one step: a put and a signal per
peer, then a local wait. Reductions sum the members' chunks in member order, bit-equal to the plain-torch
reference (:func:`zbccl.ops.reference.reduce_ref`: floats accumulate in fp32, fp64 for float64, and round
once; :func:`reduce_into`), so every rank's result is bitwise identical and equal to the reference.

Bytes each rank sends to the others: all_reduce ``(n-1) N``; all_gather ``(n-1) N_in``; reduce_scatter and
all_to_all only what each peer must get; broadcast ``(n-1) N`` from the root.
"""

from __future__ import annotations

import threading
from functools import partial

import numpy as np
import torch

from ... import native
from ...native.abi import (
    MAX_WORLD,
    OP_ALL_GATHER,
    OP_ALL_REDUCE,
    OP_ALL_TO_ALL,
    OP_BARRIER,
    OP_BROADCAST,
    OP_REDUCE_SCATTER,
)
from ..dtypes import CODES, MAX, MIN, PROD, SUM
from ..reference import reduce_ref
from .state import NOTHING_BIG, F, Got, HostOps, view_of

__all__ = ["all_reduce", "gather", "reduce_scatter", "all_to_all", "broadcast", "barrier", "reduce_into", "reduce_at",
           "copy", "copy_got", "reduce_got", "landing", "scratch", "split"]

# The native core and numpy, not torch, for the copies and reductions of the steps: torch splits an op over its
# intra-op threads above a grain size, and on oversubscribed cores (the ranks of several "hosts" share them)
# waiting for those threads costs milliseconds per chunk; these run on the calling thread, and give the same
# bits (IEEE element-wise ops; integers wrap; maximum/minimum propagate NaN as torch does).
_UFUNC = {SUM: np.add, PROD: np.multiply, MAX: np.maximum, MIN: np.minimum}
#: The most parts the native kernel reduces at once (its ZB_MAXW); more go through numpy.
_MAX_PARTS = MAX_WORLD
_EXACT = (torch.float32, torch.float64, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
#: The 16-bit floats the native kernel reduces for any reduce op (fp32 accumulator); fp32 it sums (member order).
_HALF = (torch.bfloat16, torch.float16)
_PTRS = threading.local()  # per thread: the part addresses handed to the native kernel


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes, flat (uint8; a view)."""
    if t.dim() == 1:  # (one view instead of two: on every op's path)
        return t.view(torch.uint8)
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def np_of(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's memory as a numpy array (no copy)."""
    return t.detach().numpy()


def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[:] = src`` (same dtype and number of elements): one native copy on this thread when both are
    contiguous (torch's copy fans out to its intra-op threads, whose spinning afterwards holds off the peers and
    the transport's threads on busy cores; numpy's cost 6 us more per call in views), else torch's; nothing when
    they are the same memory."""
    n = dst.numel()
    if not n:
        return
    d = dst.data_ptr()
    if d == src.data_ptr():
        return
    if dst.is_contiguous() and src.is_contiguous():
        native.core().memcpy(d, src.data_ptr(), n * dst.element_size())
    else:
        dst.copy_(src.view(dst.shape) if src.is_contiguous() else src.reshape(dst.shape))


def copy_got(addr: int, g: Got | None) -> None:
    """The bytes of ``g`` (what :meth:`HostOps.exchange` handed a consumer for one member) to address ``addr`` of
    this rank's memory, by the native copy; nothing when there are none or they are already there."""
    if g is not None and g[1] and g[0] != addr:
        native.core().memcpy(addr, g[0], g[1])


def reduce_got(out: torch.Tensor, out_at: int, isz: int, lo: int, got: list[Got], count: int, red: int) -> None:
    """``out[lo:lo + count]`` (flat, contiguous, at address ``out_at``; ``isz`` bytes per element) = the reduction
    of the ``count``-element pieces ``got`` in member order, as :func:`reduce_into` (its native kernel straight
    over the pieces' addresses where it serves; the destination may be the first or second piece)."""
    if not count:
        return
    addrs = [g[0] for g in got]
    dst = out_at + lo * isz
    if dst not in addrs[2:] and reduce_at(dst, addrs, count, out.dtype, red):
        return
    reduce_into(out[lo:lo + count], [view_of(g).view(out.dtype) for g in got], red)


def reduce_into(dst: torch.Tensor, parts: list[torch.Tensor], red: int) -> None:
    """``dst`` = the reduction of ``parts`` in list order, bit-equal to :func:`reduce_ref`, on this thread: the
    native kernel for bf16/fp16 (fp32 accumulator, one rounding at the store, as the reference; torch's
    reference took 3-6x longer and fanned out to its intra-op threads) and for fp32 sums (summed in list order,
    as the reference; a 4 KiB one in 1 us against numpy's 4); one numpy pass per part for the other ops and
    dtypes that need no wider accumulator (float32/64 and integers); else the reference itself. ``dst`` may
    alias ``parts[0]`` or ``parts[1]`` (element-wise: an element is read before it is written)."""
    fn = _UFUNC.get(red)
    aliased = any(p.data_ptr() == dst.data_ptr() for p in parts[2:] if p.numel())
    if (not aliased and dst.numel() and dst.is_contiguous()
            and all(p.is_contiguous() and p.numel() == dst.numel() for p in parts)
            and reduce_at(dst.data_ptr(), [p.data_ptr() for p in parts], dst.numel(), dst.dtype, red)):
        return
    if fn is None or dst.dtype not in _EXACT or len(parts) < 2 or aliased:
        res = reduce_ref(parts, red)
        if res.data_ptr() != dst.data_ptr():
            dst.copy_(res)
        return
    out = np_of(dst)
    fn(np_of(parts[0]), np_of(parts[1]), out=out)
    for p in parts[2:]:
        fn(out, np_of(p), out=out)


def reduce_at(dst: int, parts: list[int], count: int, dtype: torch.dtype, red: int) -> bool:
    """:func:`reduce_into`'s native kernel over addresses: ``count`` elements at ``dst`` = the reduction of the
    ones at ``parts`` (contiguous, in list order; ``dst`` may be ``parts[0]`` or ``parts[1]``, no other); False,
    doing nothing, where the kernel does not serve ``dtype`` and ``red`` (then :func:`reduce_into` decides)."""
    if not (dtype in _HALF or (dtype == torch.float32 and red == SUM)) or red not in _UFUNC \
            or not 2 <= len(parts) <= _MAX_PARTS:
        return False
    ptrs = getattr(_PTRS, "a", None)
    if ptrs is None:
        ptrs = _PTRS.a = np.zeros(_MAX_PARTS, dtype=np.uint64)
        _PTRS.addr = ptrs.ctypes.data
    ptrs[:len(parts)] = parts
    native.core().reduce_n(dst, _PTRS.addr, len(parts), count, CODES[dtype], red, 1.0, 1)
    return True


def landing(h: HostOps, out: torch.Tensor | None, numel: int, dtype: torch.dtype, incoming: list[int],
            offs: list[int]) -> tuple[torch.Tensor, list[int]]:
    """Where an op's received bytes land (its output, flat, contiguous) and the offers of :meth:`HostOps.exchange`:
    ``out`` (contiguous, or None) when it lies in this rank's heap, else a heap scratch when a member sends more
    than the direct threshold (``incoming[i]`` bytes, at byte ``offs[i]``), else ordinary memory; ``dests[i]``:
    the heap offset of member ``i``'s bytes, -1 without a place in the heap, ``NOTHING_BIG`` when none is
    needed (nothing over the threshold comes from that member)."""
    big = min(h.direct_min, h.chunk)
    base = -1 if out is None else h.ctx.heap.offset_of(out)
    if base < 0 and any(nb > big for i, nb in enumerate(incoming) if i != h.me):
        room = scratch(h, numel * dtype.itemsize)
        if room is not None:
            out, base = room.view(dtype), h.ctx.heap.offset_of(room)
    if out is None:
        out = torch.empty(numel, dtype=dtype)
    return out.view(-1), [base + offs[i] if base >= 0 else -1 if incoming[i] > big else NOTHING_BIG
                          for i in range(h.n)]


def scratch(h: HostOps, nbytes: int) -> torch.Tensor | None:
    """``nbytes`` of this rank's heap (uint8, freed when the tensor dies), or None when the heap is full."""
    sma, heap = h.ctx.sma, h.ctx.heap
    off = sma.try_malloc(max(nbytes, 1), kind="hosts")
    if off is None:
        return None
    return heap.view(heap.rank, off, (nbytes,), torch.uint8, release=partial(sma.free, off), op="hosts")


def all_reduce(h: HostOps, op: str, tensor: torch.Tensor, dt: int, red: int, error: str | None, secs: float,
               *, data: bool = True) -> torch.Tensor | None:
    """Flat all_reduce in place. ``data`` False: the agreement step only (the hierarchical algorithm's);
    returns the contiguous working tensor then, None otherwise."""
    n, ok = h.n, error is None
    if ok and data and split(h, tensor.numel() * tensor.element_size()):
        _split_all_reduce(h, op, tensor, dt, red, secs)
        return None
    work = tensor.contiguous() if ok else None
    src = _bytes(work) if ok and data else None
    flat = work.view(-1) if ok else None
    isz = tensor.element_size() if ok else 1

    me, base = h.me, work.data_ptr() if ok and data else 0

    def consume(got: list, at: list[int]) -> None:  # (got[me]: this rank's own bytes, where the result goes)
        reduce_got(flat, base, isz, at[me] // isz, got, got[me][1] // isz, red)

    fields = {F.DTYPE: dt, F.REDOP: red, F.NUMEL: tensor.numel() if ok else -1}
    h.exchange(op, OP_ALL_REDUCE, fields, [], error, [src] * n, consume if data else None, timeout=secs,
               same=(F.DTYPE, F.REDOP, F.NUMEL))
    if not data:
        return work
    if work is not tensor:
        copy(tensor, work)
    return None


def split(h: HostOps, nbytes: int) -> bool:
    """Whether a flat all_reduce of ``nbytes`` runs as a reduce_scatter and an all_gather, each member's slice put
    straight into place and reduced once, by its owner, rather than as one exchange of the whole tensor (every
    member sends all of it to every peer and reduces all of it): when the slices are over the direct threshold
    and either there are three members or more (each rank then sends 2(n-1)/n of the tensor instead of n-1
    times it: by host id at 3 x 1, 4 MiB in 14 ms instead of 21) or a slice is over one chunk (at two members
    the bytes are the same, and below that one transfer of the whole tensor beat two of half of it: 0.74x
    against 0.61x gloo at 4 MiB, 2 x 1 namespace hosts). Identical on every rank that agrees on the size."""
    slice_ = nbytes // max(h.n, 1)
    return h.n > 1 and slice_ > min(h.direct_min, h.chunk) and (h.n > 2 or slice_ > h.chunk)


def _split_all_reduce(h: HostOps, op: str, tensor: torch.Tensor, dt: int, red: int, secs: float) -> None:
    """all_reduce in place as a reduce_scatter into this rank's slice (member order, as the one exchange reduces:
    the same bits), then an all_gather of the slices in place. Each member's slice crosses to every peer once
    in each half, as in the one exchange; each element is reduced once instead of on every member."""
    work = tensor if tensor.is_contiguous() else tensor.contiguous()
    flat, n, me = work.view(-1), h.n, h.me
    N = flat.numel()
    counts = [N // n + (1 if i < N % n else 0) for i in range(n)]
    lo = sum(counts[:me])
    mine = flat[lo:lo + counts[me]]
    reduce_scatter(h, op, mine, flat, dt, red, counts, counts, 0, None, secs, whole=True)
    gather(h, op, flat, mine, dt, counts, 0, [], None, secs)
    if work is not tensor:
        copy(tensor, work)


def gather(h: HostOps, op: str, output: torch.Tensor, input: torch.Tensor, dt: int, counts: list[int], d: int,
           shapes: list[tuple], error: str | None, secs: float, *, data: bool = True) -> list:
    """all_gather(_v) along dim ``d``: member ``i`` gives ``counts[i]`` elements (its input, shaped ``shapes[i]``).
    ``data`` False: the agreement step only (the hierarchical algorithm's), whose headers (returned) offer
    the heap offset of every member's place in this rank's output when it lies in the heap."""
    n, ok = h.n, error is None
    src = _bytes(input.contiguous()) if ok and data else None
    isz = input.element_size() if ok else 1
    offs = [sum(counts[:i]) * isz for i in range(n)]
    buf, dests = None, None
    if ok and data:
        whole = output if d == 0 and output.is_contiguous() else None
        buf, dests = landing(h, whole, sum(counts), output.dtype, [c * isz for c in counts], offs)
    elif ok:
        base = h.ctx.heap.offset_of(output) if output.is_contiguous() else -1
        dests = [base + offs[i] if base >= 0 else -1 for i in range(n)]
    out_at = buf.data_ptr() if buf is not None and buf.numel() else 0

    def consume(got: list, at: list[int]) -> None:
        for i, g in enumerate(got):
            copy_got(out_at + offs[i] + at[i], g)  # (in place, this rank's slice is its input already: skipped)

    heads = h.exchange(op, OP_ALL_GATHER, {F.DTYPE: dt, F.AUX: d}, counts if ok else [], error, [src] * n,
                       consume if data else None, timeout=secs, same=(F.DTYPE, F.AUX), same_vec=True, dests=dests,
                       heads=not data)
    if not data or output.numel() == 0:  # nothing arrived (along ``d`` too: the other dims may be empty)
        return heads
    if d:
        flat = buf.view(-1)
        parts = [flat[offs[i] // isz:offs[i] // isz + counts[i]].view(shapes[i]) for i in range(n)]
        output.copy_(torch.cat(parts, d))
    elif buf.data_ptr() != output.data_ptr():
        copy(output, buf)
    return heads


def reduce_scatter(h: HostOps, op: str, output: torch.Tensor, input: torch.Tensor, dt: int, red: int,
                   counts: list[int], rows: list[int], d: int, error: str | None, secs: float, *,
                   whole: bool = False, data: bool = True) -> None:
    """reduce_scatter(_v) along dim ``d``: member ``i`` gets ``counts[i]`` elements (``rows[i]`` along ``d``).
    Pieces over the direct threshold land in a heap scratch (one slot per member) and are reduced from there.
    ``whole``: the first half of :func:`all_reduce` (its header: the agreement of an all_reduce of ``input``).
    ``data`` False: the agreement step only (the hierarchical algorithm's)."""
    n, me, ok = h.n, h.me, error is None
    if not data:
        fields = {F.DTYPE: dt, F.REDOP: red, F.AUX: d, F.NUMEL: input.numel() if ok else -1}
        h.exchange(op, OP_REDUCE_SCATTER, fields, counts if ok else [], error, [None] * n, None, timeout=secs,
                   same=tuple(fields), same_vec=True)
        return
    isz = input.element_size() if ok else 1
    sends: list = [None] * n
    if ok:
        if d == 0:
            raw = _bytes(input.contiguous())
            at = [sum(counts[:i]) * isz for i in range(n)]
            sends = [raw[at[i]:at[i] + counts[i] * isz] for i in range(n)]
        else:
            at = [sum(rows[:i]) for i in range(n)]
            sends = [_bytes(input.narrow(d, at[i], rows[i]).contiguous()) for i in range(n)]
    out = output.view(-1) if ok and output.is_contiguous() else (torch.empty(counts[me], dtype=output.dtype)
                                                                  if ok else None)
    piece = counts[me] * isz if ok else 0  # what every member sends this rank
    slots, dests = None, [NOTHING_BIG] * n
    if ok and piece > min(h.direct_min, h.chunk) and n > 1:
        slots = scratch(h, n * piece)
        base = -1 if slots is None else h.ctx.heap.offset_of(slots)
        dests = [base + i * piece if base >= 0 else -1 for i in range(n)]

    out_at = out.data_ptr() if ok else 0

    def consume(got: list, at: list[int]) -> None:
        if any(g is None for g in got):  # (None: a piece that lands in the scratch)
            return
        reduce_got(out, out_at, isz, at[me] // isz, got, got[0][1] // isz, red)

    if whole:
        fields, opcode, vec, same = {F.DTYPE: dt, F.REDOP: red, F.NUMEL: input.numel()}, OP_ALL_REDUCE, [], False
    else:
        fields = {F.DTYPE: dt, F.REDOP: red, F.AUX: d, F.NUMEL: input.numel() if ok else -1}
        opcode, vec, same = OP_REDUCE_SCATTER, counts if ok else [], True
    h.exchange(op, opcode, fields, vec, error, sends, consume, timeout=secs, same=tuple(fields), same_vec=same,
               dests=dests)
    if slots is not None and h.direct_done:  # every piece landed in the scratch: reduce them from there
        parts = [sends[me] if i == me else slots[i * piece:(i + 1) * piece] for i in range(n)]
        reduce_into(out, [p.view(input.dtype) for p in parts], red)
    if ok and out.data_ptr() != output.data_ptr():
        copy(output, out)


def all_to_all(h: HostOps, op: str, output: torch.Tensor, input: torch.Tensor, dt: int, ins: list[int],
               outs: list[int], error: str | None, secs: float) -> None:
    """all_to_all_single: ``ins[i]`` elements of this rank's input to member ``i``, ``outs[i]`` from it."""
    n, ok = h.n, error is None
    isz = input.element_size() if ok else 1
    sends: list = [None] * n
    if ok:
        sends = list(torch.split_with_sizes(_bytes(input.contiguous()), [c * isz for c in ins]))  # (one call)
    offs = [sum(outs[:i]) * isz for i in range(n)]
    buf, dests = None, None
    if ok:
        buf, dests = landing(h, output if output.is_contiguous() else None, sum(outs), output.dtype,
                             [c * isz for c in outs], offs)
    out_at = buf.data_ptr() if ok and buf.numel() else 0

    def consume(got: list, at: list[int]) -> None:
        for i, g in enumerate(got):
            copy_got(out_at + offs[i] + at[i], g)

    h.exchange(op, OP_ALL_TO_ALL, {F.DTYPE: dt}, ins + outs if ok else [], error, sends, consume, timeout=secs,
               same=(F.DTYPE,), pairwise=ok, dests=dests)
    if ok and buf.data_ptr() != output.data_ptr():
        copy(output, buf)


def broadcast(h: HostOps, op: str, tensor: torch.Tensor, dt: int, src: int, error: str | None, secs: float, *,
              data: bool = True) -> None:
    """The root puts its tensor into every peer's slots; the others copy it out. ``data`` False: the agreement
    step only (the hierarchical algorithm's)."""
    n, ok, root = h.n, error is None, h.me == src
    sends: list = [None] * n
    if not data:
        fields = {F.DTYPE: dt, F.ROOT: src, F.NUMEL: tensor.numel() if ok else -1}
        h.exchange(op, OP_BROADCAST, fields, [], error, sends, None, timeout=secs, same=(F.DTYPE, F.ROOT, F.NUMEL))
        return
    if ok and root:
        data = _bytes(tensor.contiguous())
        sends = [None if i == h.me else data for i in range(n)]
    work, dests = tensor, [NOTHING_BIG] * n
    if ok and not root:
        nbytes = tensor.numel() * tensor.element_size()
        work, dests = landing(h, tensor if tensor.is_contiguous() else None, tensor.numel(), tensor.dtype,
                              [nbytes if i == src else 0 for i in range(n)], [0] * n)
    work_at = work.data_ptr() if ok and not root else None

    def consume(got: list, at: list[int]) -> None:
        if work_at is not None:
            copy_got(work_at + at[src], got[src])

    fields = {F.DTYPE: dt, F.ROOT: src, F.NUMEL: tensor.numel() if ok else -1}
    h.exchange(op, OP_BROADCAST, fields, [], error, sends, consume, timeout=secs, same=(F.DTYPE, F.ROOT, F.NUMEL),
               dests=dests)
    if work_at is not None and work_at != tensor.data_ptr():
        copy(tensor, work)


def barrier(h: HostOps, op: str, tag: int, error: str | None, secs: float) -> list[int] | None:
    """One header-only step; returns every member's tag when they differ (every rank gets the same list)."""
    heads = h.exchange(op, OP_BARRIER, {F.AUX: tag}, [], error, [None] * h.n, None, timeout=secs, heads=True)
    tags = [int(x[F.AUX]) for x in heads]
    return tags if len(set(tags)) > 1 else None
