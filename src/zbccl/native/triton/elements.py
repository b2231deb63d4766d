"""Moving and reducing data in the kernels: typed, aligned pointers, tiles and spans.

Every data pointer is built from ``anchor`` (a 16-byte aligned pointer argument) plus an offset whose
alignment is declared when a runtime check finds the addresses 16-byte aligned: the compiler then
moves 16 bytes per access, which it never does for a pointer made from a loaded integer. Whole tiles go
unmasked, the tail masked; copies move 8-byte words whatever the dtype.
"""

from __future__ import annotations

import triton.language as tl

from .prims import bound, helper, vsum

__all__ = ["cast_ptr", "ptr_at", "pick", "aligned", "load_acc", "store_acc", "combine", "average", "reduce_tile",
           "reduce_span", "copy_span", "copy_range", "reduce_range"]


@helper
def cast_ptr(anchor, DT: tl.constexpr, INTERP: tl.constexpr):
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
def ptr_at(anchor, addr, DT: tl.constexpr, ESZ: tl.constexpr, INTERP: tl.constexpr, VEC: tl.constexpr):
    """A pointer of dtype DT (ESZ bytes) to byte address ``addr`` (VEC: 16-byte aligned)."""
    d = (addr - anchor.to(tl.int64)) // ESZ
    if VEC:
        d = tl.multiple_of(d, 16 // ESZ)
    return cast_ptr(anchor, DT, INTERP) + d


@helper
def aligned(srcs, addr, W: tl.constexpr, KW: tl.constexpr):
    """Whether ``addr`` and the W addresses in ``srcs`` are all 16-byte aligned."""
    lanes = tl.arange(0, KW)
    odd = vsum((((srcs & 15) != 0) & (lanes < W)).to(tl.int32))
    return (odd == 0) & ((addr & 15) == 0)


@helper
def load_acc(p, mask, DT: tl.constexpr, INTERP: tl.constexpr, MASKED: tl.constexpr):
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
def store_acc(p, acc, mask, DT: tl.constexpr, INTERP: tl.constexpr, MASKED: tl.constexpr):
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
def combine(acc, x, RED: tl.constexpr, DT: tl.constexpr):
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
def average(acc, W: tl.constexpr, DT: tl.constexpr):
    if DT == 3:  # float64 division rounds to nearest already (div.rn.f64)
        r = acc / tl.full(acc.shape, W, acc.dtype)
    else:  # float32: ask for the correctly rounded division, not the fast one
        r = tl.math.div_rn(acc, tl.full(acc.shape, W, acc.dtype))
    return r


@helper
def pick(vec, q, KW: tl.constexpr):
    return vsum(tl.where(tl.arange(0, KW) == q, vec, 0))


@helper
def reduce_tile(anchor, srcs, offs, m, W: tl.constexpr, DT: tl.constexpr, RED: tl.constexpr, ESZ: tl.constexpr,
                 INTERP: tl.constexpr, VEC: tl.constexpr, MASKED: tl.constexpr, KW: tl.constexpr):
    """The rank-order reduction of ``offs`` (elements from each rank's address in ``srcs``), in the
    accumulation type (all W loads issued before any is consumed: the rank loop is unrolled)."""
    acc = load_acc(ptr_at(anchor, pick(srcs, 0, KW), DT, ESZ, INTERP, VEC) + offs, m, DT, INTERP, MASKED)
    for q in tl.static_range(1, W):
        x = load_acc(ptr_at(anchor, pick(srcs, q, KW), DT, ESZ, INTERP, VEC) + offs, m, DT, INTERP, MASKED)
        acc = combine(acc, x, RED, DT)
    if RED == 4:
        acc = average(acc, W, DT)
    return acc


@helper
def reduce_span(anchor, srcs, out_addr, lo, hi, W: tl.constexpr, DT: tl.constexpr, RED: tl.constexpr,
                 ESZ: tl.constexpr, BLOCK: tl.constexpr, INTERP: tl.constexpr, VEC: tl.constexpr, KW: tl.constexpr):
    """Elements ``[lo, hi)`` of the output at ``out_addr`` = their reduction over the ranks' ``srcs``: whole
    tiles unmasked (16-byte accesses when VEC), then the tail masked."""
    out = ptr_at(anchor, out_addr, DT, ESZ, INTERP, VEC)
    full = lo + (hi - lo) // BLOCK * BLOCK
    for start in range(bound(lo), bound(full), BLOCK):
        offs = tl.multiple_of(start, 16) + tl.arange(0, BLOCK)
        acc = reduce_tile(anchor, srcs, offs, offs < hi, W, DT, RED, ESZ, INTERP, VEC, False, KW)
        store_acc(out + offs, acc, offs < hi, DT, INTERP, False)
    if full < hi:
        offs = full + tl.arange(0, BLOCK)
        m = offs < hi
        acc = reduce_tile(anchor, srcs, offs, m, W, DT, RED, ESZ, INTERP, VEC, True, KW)
        store_acc(out + offs, acc, m, DT, INTERP, True)


@helper
def copy_span(anchor, src_addr, dst_addr, lo, hi, CDT: tl.constexpr, ESZ: tl.constexpr, BLOCK: tl.constexpr,
               INTERP: tl.constexpr, VEC: tl.constexpr):
    """Copy elements ``[lo, hi)`` from ``src_addr`` to ``dst_addr`` (CDT: the dtype code moved)."""
    src = ptr_at(anchor, src_addr, CDT, ESZ, INTERP, VEC)
    dst = ptr_at(anchor, dst_addr, CDT, ESZ, INTERP, VEC)
    full = lo + (hi - lo) // BLOCK * BLOCK
    for start in range(bound(lo), bound(full), BLOCK):
        offs = tl.multiple_of(start, 16) + tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.load(src + offs))
    if full < hi:
        offs = full + tl.arange(0, BLOCK)
        m = offs < hi
        tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)


@helper
def copy_range(anchor, src_addr, dst_addr, lo, hi, CDT: tl.constexpr, ESZ: tl.constexpr, BLOCK: tl.constexpr,
          INTERP: tl.constexpr):
    """Copy elements ``[lo, hi)`` (ESZ bytes each) from ``src_addr`` to ``dst_addr``: as 8-byte words with
    16-byte accesses when both byte ranges start 16-byte aligned (whatever the dtype), then the last bytes."""
    sb = src_addr + lo * ESZ
    db = dst_addr + lo * ESZ
    nb = (hi - lo) * ESZ
    if ((sb | db) & 15) == 0:
        nw = nb // 8
        copy_span(anchor, sb, db, 0, nw, 8, 8, BLOCK * ESZ // 8, INTERP, True)
        copy_span(anchor, sb + nw * 8, db + nw * 8, 0, nb - nw * 8, 5, 1, 16, INTERP, False)
    else:
        copy_span(anchor, src_addr, dst_addr, lo, hi, CDT, ESZ, BLOCK, INTERP, False)


@helper
def reduce_range(anchor, srcs, out_addr, lo, hi, W: tl.constexpr, DT: tl.constexpr, RED: tl.constexpr,
            ESZ: tl.constexpr, BLOCK: tl.constexpr, INTERP: tl.constexpr, KW: tl.constexpr):
    """:func:`_reduce_span` of ``[lo, hi)``, with 16-byte accesses when every address allows."""
    shift = lo * ESZ
    if aligned(srcs + shift, out_addr + shift, W, KW):
        reduce_span(anchor, srcs + shift, out_addr + shift, 0, hi - lo, W, DT, RED, ESZ, BLOCK, INTERP, True, KW)
    else:
        reduce_span(anchor, srcs + shift, out_addr + shift, 0, hi - lo, W, DT, RED, ESZ, BLOCK, INTERP, False, KW)
