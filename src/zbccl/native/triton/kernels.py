"""The collective kernels: pull-based, zero-buffer, over int64 tables of the ranks' data and kernel-slot bases.

Every kernel follows :mod:`.sync`'s protocol (publish, signal, bounded wait, agree, work, exit barrier)
and reads the peers' tensors where they are, in their heaps (the offsets come from the peers' argument
rows): nothing is staged. Reductions read rank 0, 1, ..., W-1 in that order on every rank and
accumulate in float32 (float16, bfloat16, float32) or float64, integers in their own type (wrapping):
every rank's result is bit-identical, and equal to ``ops/reference.py``'s.

Work split: block ``b`` of ``G`` takes the ``b``-th of ``G`` equal BLOCK-aligned chunks of each range it
moves, so that block ``b``'s barriers only ever need block ``b`` of the peers.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import geometry as g
from .sync import begin, bound, finish, helper, row_of, sync, vsum

__all__ = ["barrier_kernel", "all_reduce_kernel", "all_gather_kernel", "reduce_scatter_kernel",
           "all_to_all_kernel", "broadcast_kernel"]

_STEP_EXIT = tl.constexpr(g.STEP_EXIT)
_KOP_ERROR = tl.constexpr(g.KOP["ERROR"])
_A_IN_OFF = tl.constexpr(g.A_FIELDS.index("IN_OFF"))
_A_OUT_OFF = tl.constexpr(g.A_FIELDS.index("OUT_OFF"))
_A_SPLITS = tl.constexpr(g.A_SPLITS)
_SUM, _PROD, _MAX, _MIN, _AVG = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2), tl.constexpr(3), tl.constexpr(4)


# ------------------------------------------------------------------ element access
# Every data pointer is built as ``anchor + (addr - anchor) // size`` from ``anchor``, a 16-byte aligned
# pointer argument (the data table): the compiler then knows the pointer's alignment from the offset's
# (``tl.multiple_of`` when the address is 16-byte aligned, VEC) and moves 16 bytes per access, which it
# cannot do for a pointer made from a loaded integer.
@helper
def _cast(anchor, DT: tl.constexpr, INTERP: tl.constexpr):
    """``anchor`` as a pointer to dtype code DT (``native/abi.py`` DTYPES); bfloat16 as raw uint16 under the
    interpreter, whose own bfloat16 conversions do not round to nearest even; bool as bytes."""
    if DT == 0:
        p = anchor.to(tl.pointer_type(tl.float32), bitcast=True)
    elif DT == 1:
        if INTERP:
            p = anchor.to(tl.pointer_type(tl.uint16), bitcast=True)
        else:
            p = anchor.to(tl.pointer_type(tl.bfloat16), bitcast=True)
    elif DT == 2:
        p = anchor.to(tl.pointer_type(tl.float16), bitcast=True)
    elif DT == 3:
        p = anchor.to(tl.pointer_type(tl.float64), bitcast=True)
    elif DT == 4:
        p = anchor.to(tl.pointer_type(tl.int8), bitcast=True)
    elif DT == 6:
        p = anchor.to(tl.pointer_type(tl.int16), bitcast=True)
    elif DT == 7:
        p = anchor.to(tl.pointer_type(tl.int32), bitcast=True)
    elif DT == 8:
        p = anchor.to(tl.pointer_type(tl.int64), bitcast=True)
    else:  # 5 uint8, 9 bool (bytes 0/1)
        p = anchor.to(tl.pointer_type(tl.uint8), bitcast=True)
    return p


@helper
def _at(anchor, addr, DT: tl.constexpr, ESZ: tl.constexpr, INTERP: tl.constexpr, VEC: tl.constexpr):
    """A pointer of dtype DT (ESZ bytes) to byte address ``addr`` (VEC: 16-byte aligned)."""
    d = (addr - anchor.to(tl.int64)) // ESZ
    if VEC:
        d = tl.multiple_of(d, 16 // ESZ)
    return _cast(anchor, DT, INTERP) + d


@helper
def _aligned(srcs, addr, W: tl.constexpr, KW: tl.constexpr):
    """Whether ``addr`` and the W addresses in ``srcs`` are all 16-byte aligned."""
    lanes = tl.arange(0, KW)
    odd = vsum((((srcs & 15) != 0) & (lanes < W)).to(tl.int32))
    return (odd == 0) & ((addr & 15) == 0)


@helper
def _load_acc(p, mask, DT: tl.constexpr, INTERP: tl.constexpr, MASKED: tl.constexpr):
    if MASKED:
        x = tl.load(p, mask=mask, other=0)
    else:
        x = tl.load(p)
    if DT == 1:
        if INTERP:
            acc = (x.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            acc = x.to(tl.float32)
    elif DT == 0 or DT == 2:
        acc = x.to(tl.float32)
    else:
        acc = x
    return acc


@helper
def _store_acc(p, acc, mask, DT: tl.constexpr, INTERP: tl.constexpr, MASKED: tl.constexpr):
    if DT == 1:
        if INTERP:  # round to nearest even, as torch and the GPU's cvt.rn do
            u = acc.to(tl.uint32, bitcast=True)
            r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
            r = tl.where(acc != acc, 0x7FC0, r)
            v = r.to(tl.uint16)
        else:
            v = acc.to(tl.bfloat16)
    else:
        v = acc.to(p.dtype.element_ty)
    if MASKED:
        tl.store(p, v, mask=mask)
    else:
        tl.store(p, v)


@helper
def _combine(acc, x, RED: tl.constexpr, DT: tl.constexpr):
    if RED == 0 or RED == 4:
        r = acc + x
    elif RED == 1:
        r = acc * x
    elif RED == 2:
        if DT <= 3:
            r = tl.maximum(acc, x, propagate_nan=tl.PropagateNan.ALL)
        else:
            r = tl.maximum(acc, x)
    else:
        if DT <= 3:
            r = tl.minimum(acc, x, propagate_nan=tl.PropagateNan.ALL)
        else:
            r = tl.minimum(acc, x)
    return r


@helper
def _average(acc, W: tl.constexpr, DT: tl.constexpr):
    if DT == 3:  # float64 division rounds to nearest already (div.rn.f64)
        r = acc / tl.full(acc.shape, W, acc.dtype)
    else:  # float32: ask for the correctly rounded division, not the fast one
        r = tl.math.div_rn(acc, tl.full(acc.shape, W, acc.dtype))
    return r


# ------------------------------------------------------------------ shared pieces
@helper
def _pack(op, dt, red, algo, root, outer, inner, numel, in_off, out_off, variant):
    """The argument row's fields (geometry.A_FIELDS order; EPOCH is written by begin)."""
    fl = tl.arange(0, 16)
    f = tl.zeros([16], tl.int64)
    f = tl.where(fl == 1, op, f)
    f = tl.where(fl == 2, dt, f)
    f = tl.where(fl == 3, red, f)
    f = tl.where(fl == 4, algo, f)
    f = tl.where(fl == 5, tl.num_programs(0), f)
    f = tl.where(fl == 6, root, f)
    f = tl.where(fl == 7, outer, f)
    f = tl.where(fl == 8, inner, f)
    f = tl.where(fl == 9, numel, f)
    f = tl.where(fl == 10, in_off, f)
    f = tl.where(fl == 11, out_off, f)
    f = tl.where(fl == 12, variant, f)
    return f


@helper
def _bases(data, peers_kb, E, W: tl.constexpr, FIELD: tl.constexpr, KW: tl.constexpr):
    """[KW] vector: each rank's data base plus the offset it published in row field FIELD."""
    lanes = tl.arange(0, KW)
    mask = lanes < W
    off = tl.load((row_of(peers_kb, E) + FIELD * 8).to(tl.pointer_type(tl.int64)), mask=mask, other=0,
                  volatile=True)
    return tl.load(data + lanes, mask=mask, other=0) + off


@helper
def _pick(vec, q, KW: tl.constexpr):
    return vsum(tl.where(tl.arange(0, KW) == q, vec, 0))


@helper
def _chunk(n, BLOCK: tl.constexpr):
    """Block b's share ``[lo, hi)`` of ``n`` items: G equal BLOCK-aligned chunks."""
    G = tl.num_programs(0)
    b = tl.program_id(0)
    per = ((n + G - 1) // G + BLOCK - 1) // BLOCK * BLOCK
    lo = b.to(tl.int64) * per
    hi = tl.minimum(lo + per, n)
    return lo, hi


@helper
def _leave(kb, peers_kb, me, E, go, arrived, timeout_ns, KW: tl.constexpr):
    """A block that skipped the work (mismatch) still does the exit barrier among the ranks that came."""
    if go == 0:
        sync(kb, peers_kb, me, tl.program_id(0), E, _STEP_EXIT, arrived, timeout_ns, KW)
    finish(kb, E)


@helper
def _reduce_tile(anchor, srcs, offs, m, W: tl.constexpr, DT: tl.constexpr, RED: tl.constexpr, ESZ: tl.constexpr,
                 INTERP: tl.constexpr, VEC: tl.constexpr, MASKED: tl.constexpr, KW: tl.constexpr):
    """The rank-order reduction of ``offs`` (elements from each rank's address in ``srcs``), in the
    accumulation type (all W loads issued before any is consumed: the rank loop is unrolled)."""
    acc = _load_acc(_at(anchor, _pick(srcs, 0, KW), DT, ESZ, INTERP, VEC) + offs, m, DT, INTERP, MASKED)
    for q in tl.static_range(1, W):
        x = _load_acc(_at(anchor, _pick(srcs, q, KW), DT, ESZ, INTERP, VEC) + offs, m, DT, INTERP, MASKED)
        acc = _combine(acc, x, RED, DT)
    if RED == 4:
        acc = _average(acc, W, DT)
    return acc


@helper
def _reduce_span(anchor, srcs, out_addr, lo, hi, W: tl.constexpr, DT: tl.constexpr, RED: tl.constexpr,
                 ESZ: tl.constexpr, BLOCK: tl.constexpr, INTERP: tl.constexpr, VEC: tl.constexpr, KW: tl.constexpr):
    """Elements ``[lo, hi)`` of the output at ``out_addr`` = their reduction over the ranks' ``srcs``: whole
    tiles unmasked (16-byte accesses when VEC), then the tail masked."""
    out = _at(anchor, out_addr, DT, ESZ, INTERP, VEC)
    full = lo + (hi - lo) // BLOCK * BLOCK
    for start in range(bound(lo), bound(full), BLOCK):
        offs = tl.multiple_of(start, 16) + tl.arange(0, BLOCK)
        acc = _reduce_tile(anchor, srcs, offs, offs < hi, W, DT, RED, ESZ, INTERP, VEC, False, KW)
        _store_acc(out + offs, acc, offs < hi, DT, INTERP, False)
    if full < hi:
        offs = full + tl.arange(0, BLOCK)
        m = offs < hi
        acc = _reduce_tile(anchor, srcs, offs, m, W, DT, RED, ESZ, INTERP, VEC, True, KW)
        _store_acc(out + offs, acc, m, DT, INTERP, True)


@helper
def _copy_span(anchor, src_addr, dst_addr, lo, hi, CDT: tl.constexpr, ESZ: tl.constexpr, BLOCK: tl.constexpr,
               INTERP: tl.constexpr, VEC: tl.constexpr):
    """Copy elements ``[lo, hi)`` from ``src_addr`` to ``dst_addr`` (CDT: the dtype code moved)."""
    src = _at(anchor, src_addr, CDT, ESZ, INTERP, VEC)
    dst = _at(anchor, dst_addr, CDT, ESZ, INTERP, VEC)
    full = lo + (hi - lo) // BLOCK * BLOCK
    for start in range(bound(lo), bound(full), BLOCK):
        offs = tl.multiple_of(start, 16) + tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.load(src + offs))
    if full < hi:
        offs = full + tl.arange(0, BLOCK)
        m = offs < hi
        tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)


@helper
def _copy(anchor, src_addr, dst_addr, lo, hi, CDT: tl.constexpr, ESZ: tl.constexpr, BLOCK: tl.constexpr,
          INTERP: tl.constexpr):
    """Copy elements ``[lo, hi)`` (ESZ bytes each) from ``src_addr`` to ``dst_addr``: as 8-byte words with
    16-byte accesses when both byte ranges start 16-byte aligned (whatever the dtype), then the last bytes."""
    sb = src_addr + lo * ESZ
    db = dst_addr + lo * ESZ
    nb = (hi - lo) * ESZ
    if ((sb | db) & 15) == 0:
        nw = nb // 8
        _copy_span(anchor, sb, db, 0, nw, 8, 8, BLOCK * ESZ // 8, INTERP, True)
        _copy_span(anchor, sb + nw * 8, db + nw * 8, 0, nb - nw * 8, 5, 1, 16, INTERP, False)
    else:
        _copy_span(anchor, src_addr, dst_addr, lo, hi, CDT, ESZ, BLOCK, INTERP, False)


@helper
def _reduce(anchor, srcs, out_addr, lo, hi, W: tl.constexpr, DT: tl.constexpr, RED: tl.constexpr,
            ESZ: tl.constexpr, BLOCK: tl.constexpr, INTERP: tl.constexpr, KW: tl.constexpr):
    """:func:`_reduce_span` of ``[lo, hi)``, with 16-byte accesses when every address allows."""
    shift = lo * ESZ
    if _aligned(srcs + shift, out_addr + shift, W, KW):
        _reduce_span(anchor, srcs + shift, out_addr + shift, 0, hi - lo, W, DT, RED, ESZ, BLOCK, INTERP, True, KW)
    else:
        _reduce_span(anchor, srcs + shift, out_addr + shift, 0, hi - lo, W, DT, RED, ESZ, BLOCK, INTERP, False, KW)


# ------------------------------------------------------------------ kernels
@triton.jit
def barrier_kernel(pads, splits, slot_off, me, W: tl.constexpr, op, check, timeout_ns, KW: tl.constexpr):
    """Entry handshake only (one block). ``op`` is BARRIER, or ERROR for a rank whose call failed
    validation: it then waits for the peers' exit barrier too, as the ops they run do."""
    fields = _pack(op, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0)
    kb, peers_kb, E, go, arrived = begin(pads, slot_off, me, W, fields, splits, check, timeout_ns, 0, 0, KW)
    if (go == 1) & (op == _KOP_ERROR):
        sync(kb, peers_kb, me, tl.program_id(0), E, _STEP_EXIT, arrived, timeout_ns, KW)
    _leave(kb, peers_kb, me, E, go, arrived, timeout_ns, KW)


@triton.jit
def all_reduce_kernel(data, pads, splits, slot_off, me, W: tl.constexpr, in_off, out_addr, out_off, N, check,
                      timeout_ns, DT: tl.constexpr, ESZ: tl.constexpr, RED: tl.constexpr, TWO_SHOT: tl.constexpr,
                      INPLACE: tl.constexpr, BLOCK: tl.constexpr, KW: tl.constexpr, INTERP: tl.constexpr):
    """All-reduce of N elements. One-shot: every rank reduces the whole range from every rank's input into
    ``out_addr`` (in place: each tile is stored only after a barrier says every peer has read it). Two-shot:
    rank r reduces slice r into its output (a heap tensor: ``out_off``), a barrier, then every rank copies
    the other slices from their owners' outputs."""
    fields = _pack(2, DT, RED, 1 + TWO_SHOT, 0, 1, 1, N, in_off, out_off, INPLACE)
    kb, peers_kb, E, go, arrived = begin(pads, slot_off, me, W, fields, splits, check, timeout_ns, 0, 0, KW)
    b = tl.program_id(0)
    if go == 1:
        srcs = _bases(data, peers_kb, E, W, _A_IN_OFF, KW)
        if TWO_SHOT:
            S = ((N + W - 1) // W + 15) // 16 * 16  # slices of 16 elements: 16-byte aligned when the tensors are
            s_lo = tl.minimum(me.to(tl.int64) * S, N)
            s_hi = tl.minimum(s_lo + S, N)
            lo, hi = _chunk(s_hi - s_lo, BLOCK)
            _reduce(data, srcs, out_addr, s_lo + lo, s_lo + hi, W, DT, RED, ESZ, BLOCK, INTERP, KW)
            alive = sync(kb, peers_kb, me, b, E, 1, arrived, timeout_ns, KW)
            if alive == 1:
                dsts = _bases(data, peers_kb, E, W, _A_OUT_OFF, KW)
                for q in range(W):
                    if q != me:
                        q_lo = tl.minimum(q * S, N)
                        q_hi = tl.minimum(q_lo + S, N)
                        lo, hi = _chunk(q_hi - q_lo, BLOCK)
                        _copy(data, _pick(dsts, q, KW), out_addr, q_lo + lo, q_lo + hi, DT, ESZ, BLOCK, INTERP)
                sync(kb, peers_kb, me, b, E, _STEP_EXIT, arrived, timeout_ns, KW)
        elif INPLACE:
            # Each tile is stored only after every peer has read it (a barrier per tile); the block's last
            # tile's barrier is its exit barrier (STEP_EXIT), so that in- and out-of-place calls pair.
            lo, hi = _chunk(N, BLOCK)
            vec = _aligned(srcs, out_addr, W, KW)
            alive = 1
            step = 1
            for start in range(bound(lo), bound(hi), BLOCK):
                if alive == 1:
                    offs = start + tl.arange(0, BLOCK)
                    m = offs < hi
                    whole = start + BLOCK <= hi
                    if vec & whole:
                        acc = _reduce_tile(data, srcs, offs, m, W, DT, RED, ESZ, INTERP, True, False, KW)
                    else:
                        acc = _reduce_tile(data, srcs, offs, m, W, DT, RED, ESZ, INTERP, False, True, KW)
                    if start + BLOCK >= hi:
                        step = _STEP_EXIT
                    alive = sync(kb, peers_kb, me, b, E, step, arrived, timeout_ns, KW)
                    step += 1
                    if alive == 1:
                        if vec & whole:
                            _store_acc(_at(data, out_addr, DT, ESZ, INTERP, True) + offs, acc, m, DT, INTERP, False)
                        else:
                            _store_acc(_at(data, out_addr, DT, ESZ, INTERP, False) + offs, acc, m, DT, INTERP, True)
            if lo >= hi:
                sync(kb, peers_kb, me, b, E, _STEP_EXIT, arrived, timeout_ns, KW)
        else:
            lo, hi = _chunk(N, BLOCK)
            _reduce(data, srcs, out_addr, lo, hi, W, DT, RED, ESZ, BLOCK, INTERP, KW)
            sync(kb, peers_kb, me, b, E, _STEP_EXIT, arrived, timeout_ns, KW)
    _leave(kb, peers_kb, me, E, go, arrived, timeout_ns, KW)


@triton.jit
def all_gather_kernel(data, pads, splits, slot_off, me, W: tl.constexpr, in_off, out_addr, dt, outer, inner, cnt,
                      total, check, timeout_ns, CDT: tl.constexpr, ESZ: tl.constexpr, VAR: tl.constexpr,
                      ROWS: tl.constexpr, SKIP_SELF: tl.constexpr, BLOCK: tl.constexpr, KW: tl.constexpr,
                      INTERP: tl.constexpr):
    """Gather along a dim: the input is ``[outer, size_q * inner]`` on rank q, the output
    ``[outer, total * inner]``; rank q's part starts at column ``(size_0 + ... + size_{q-1}) * inner``.
    ``size_q``: ``cnt`` (all_gather) or ``splits[q]`` (VAR: all_gather_v, every rank passes all sizes).
    ROWS: outer > 1 (else the parts are contiguous). SKIP_SELF: the input already is this rank's part.
    CDT: the dtype code of ESZ-byte words, which the copies move."""
    fields = _pack(3, dt, 0, 0, 0, outer, inner, outer * cnt * inner, in_off, 0, VAR)
    kb, peers_kb, E, go, arrived = begin(pads, slot_off, me, W, fields, splits, check, timeout_ns,
                                         KW if VAR else 0, 1 if VAR else 0, KW)
    if go == 1:
        srcs = _bases(data, peers_kb, E, W, _A_IN_OFF, KW)
        pre = tl.zeros([], tl.int64)
        row = total * inner
        for q in range(W):
            if VAR:
                sz = tl.load(splits + q)
            else:
                sz = cnt + tl.zeros([], tl.int64)
            L = sz * inner
            if (not SKIP_SELF) | (q != me):
                lo, hi = _chunk(outer * L, BLOCK)
                if ROWS:  # strided parts: element by element
                    src = _at(data, _pick(srcs, q, KW), CDT, ESZ, INTERP, False)
                    out = _at(data, out_addr, CDT, ESZ, INTERP, False)
                    for start in range(bound(lo), bound(hi), BLOCK):
                        i = start + tl.arange(0, BLOCK)
                        m = i < hi
                        o = i // L
                        tl.store(out + o * row + pre * inner + (i - o * L), tl.load(src + i, mask=m), mask=m)
                else:
                    _copy(data, _pick(srcs, q, KW), out_addr + pre * inner * ESZ, lo, hi, CDT, ESZ, BLOCK, INTERP)
            pre += sz
        sync(kb, peers_kb, me, tl.program_id(0), E, _STEP_EXIT, arrived, timeout_ns, KW)
    _leave(kb, peers_kb, me, E, go, arrived, timeout_ns, KW)


@triton.jit
def reduce_scatter_kernel(data, pads, splits, slot_off, me, W: tl.constexpr, in_off, out_addr, outer, inner, cnt,
                          total, check, timeout_ns, DT: tl.constexpr, ESZ: tl.constexpr, RED: tl.constexpr,
                          VAR: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, KW: tl.constexpr,
                          INTERP: tl.constexpr):
    """Reduce-scatter along a dim: every rank's input is ``[outer, total * inner]``; this rank's output
    ``[outer, size_me * inner]`` is the rank-order reduction of the columns from
    ``(size_0 + ... + size_{me-1}) * inner`` of every input. ``size_q``: ``cnt`` or ``splits[q]`` (VAR)."""
    fields = _pack(4, DT, RED, 0, 0, outer, inner, outer * total * inner, in_off, 0, VAR)
    kb, peers_kb, E, go, arrived = begin(pads, slot_off, me, W, fields, splits, check, timeout_ns,
                                         KW if VAR else 0, 1 if VAR else 0, KW)
    if go == 1:
        if VAR:
            sl = tl.arange(0, KW)
            sp = tl.load(splits + sl, mask=sl < W, other=0)
            pre = vsum(tl.where(sl < me, sp, 0))
            sz = vsum(tl.where(sl == me, sp, 0))
        else:
            pre = me.to(tl.int64) * cnt
            sz = cnt + tl.zeros([], tl.int64)
        L = sz * inner
        # Every rank's part starts ``pre * inner`` elements into its input.
        srcs = _bases(data, peers_kb, E, W, _A_IN_OFF, KW) + pre * inner * ESZ
        lo, hi = _chunk(outer * L, BLOCK)
        if ROWS:  # strided parts: element by element
            out = _at(data, out_addr, DT, ESZ, INTERP, False)
            row = total * inner
            for start in range(bound(lo), bound(hi), BLOCK):
                i = start + tl.arange(0, BLOCK)
                m = i < hi
                o = i // L
                acc = _reduce_tile(data, srcs, o * row + (i - o * L), m, W, DT, RED, ESZ, INTERP, False, True, KW)
                _store_acc(out + i, acc, m, DT, INTERP, True)
        else:
            _reduce(data, srcs, out_addr, lo, hi, W, DT, RED, ESZ, BLOCK, INTERP, KW)
        sync(kb, peers_kb, me, tl.program_id(0), E, _STEP_EXIT, arrived, timeout_ns, KW)
    _leave(kb, peers_kb, me, E, go, arrived, timeout_ns, KW)


@triton.jit
def all_to_all_kernel(data, pads, splits, slot_off, me, W: tl.constexpr, in_off, out_addr, dt, inner, cnt, numel,
                      check, timeout_ns, CDT: tl.constexpr, ESZ: tl.constexpr, VAR: tl.constexpr,
                      BLOCK: tl.constexpr, KW: tl.constexpr, INTERP: tl.constexpr):
    """All-to-all of rows of ``inner`` elements: this rank pulls, from each rank q, the rows q addressed to
    it (``cnt``, or q's in_splits[me] at row q.in_splits[0] + ... + q.in_splits[me-1] of q's input) into its
    output at row ``out_splits[0] + ... + out_splits[q-1]``. VAR: ``splits`` holds this rank's in_splits,
    then (from KW) its out_splits; every rank checks q's in_splits[me] against its out_splits[q]."""
    fields = _pack(5, dt, 0, 0, 0, 1, inner, numel, in_off, 0, VAR)
    kb, peers_kb, E, go, arrived = begin(pads, slot_off, me, W, fields, splits, check, timeout_ns,
                                         2 * KW if VAR else 0, 2 if VAR else 0, KW)
    if go == 1:
        srcs = _bases(data, peers_kb, E, W, _A_IN_OFF, KW)
        sl = tl.arange(0, KW)
        dpre = tl.zeros([], tl.int64)
        for q in range(W):
            if VAR:
                outs = tl.load(splits + KW + sl, mask=sl < W, other=0)
                rows = vsum(tl.where(sl == q, outs, 0))
                prow = row_of(_pick(peers_kb, q, KW), E)
                theirs = tl.load((prow + (_A_SPLITS + sl) * 8).to(tl.pointer_type(tl.int64)), mask=sl < W, other=0,
                                 volatile=True)
                spre = vsum(tl.where(sl < me, theirs, 0))
            else:
                rows = cnt + tl.zeros([], tl.int64)
                spre = me.to(tl.int64) * cnt
            lo, hi = _chunk(rows * inner, BLOCK)
            _copy(data, _pick(srcs, q, KW) + spre * inner * ESZ, out_addr + dpre * inner * ESZ, lo, hi, CDT, ESZ,
                  BLOCK, INTERP)
            dpre += rows
        sync(kb, peers_kb, me, tl.program_id(0), E, _STEP_EXIT, arrived, timeout_ns, KW)
    _leave(kb, peers_kb, me, E, go, arrived, timeout_ns, KW)


@triton.jit
def broadcast_kernel(data, pads, splits, slot_off, me, W: tl.constexpr, in_off, out_addr, dt, root, N, check,
                     timeout_ns, CDT: tl.constexpr, ESZ: tl.constexpr, BLOCK: tl.constexpr, KW: tl.constexpr,
                     INTERP: tl.constexpr):
    """Every rank but ``root`` pulls the root's N elements (a heap tensor) into ``out_addr``; the root
    only waits, in the exit barrier, until they have."""
    fields = _pack(6, dt, 0, 0, root, 1, 1, N, in_off, 0, 0)
    kb, peers_kb, E, go, arrived = begin(pads, slot_off, me, W, fields, splits, check, timeout_ns, 0, 0, KW)
    if go == 1:
        if me != root:
            srcs = _bases(data, peers_kb, E, W, _A_IN_OFF, KW)
            lo, hi = _chunk(N, BLOCK)
            _copy(data, _pick(srcs, root, KW), out_addr, lo, hi, CDT, ESZ, BLOCK, INTERP)
        sync(kb, peers_kb, me, tl.program_id(0), E, _STEP_EXIT, arrived, timeout_ns, KW)
    _leave(kb, peers_kb, me, E, go, arrived, timeout_ns, KW)
