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
from .elements import aligned, copy_range, pick, ptr_at, reduce_range, reduce_tile, store_acc
from .prims import bound, helper, vsum
from .sync import begin, finish, mismatch, row_of, sync

__all__ = ["barrier_kernel", "all_reduce_kernel", "all_gather_kernel", "reduce_scatter_kernel",
           "all_to_all_kernel", "broadcast_kernel"]

_STEP_EXIT = tl.constexpr(g.STEP_EXIT)
_KOP_ERROR = tl.constexpr(g.KOP["ERROR"])
_A_IN_OFF = tl.constexpr(g.A_FIELDS.index("IN_OFF"))
_A_OUT_OFF = tl.constexpr(g.A_FIELDS.index("OUT_OFF"))
_A_SPLITS = tl.constexpr(g.A_SPLITS)
_A_NUMEL = tl.constexpr(g.A_FIELDS.index("NUMEL"))
_A_ROOT = tl.constexpr(g.A_FIELDS.index("ROOT"))
_F_ROWS_IN = tl.constexpr(g.F_ROWS_IN)
_F_ROWS_OUT = tl.constexpr(g.F_ROWS_OUT)
_S_MISMATCH = tl.constexpr(g.S_MISMATCH)


def _kernel(fn):
    """``triton.jit`` with no value specialisation of the integer arguments. On a GPU, triton otherwise
    compiles a variant per pattern of "equals 1" (made a constexpr: a plain int inside the kernel) and
    "divisible by 16" among them: rank 1's ``me``, a count of 1, an odd offset. Every rank would compile
    its own variants (more compile time, and code that builds on one rank only: a tensor method on a
    constexpr). The pointer tables keep their alignment hints; the kernels align their bulk accesses
    themselves (``elements.aligned``)."""
    ints = [name for name in fn.__code__.co_varnames[:fn.__code__.co_argcount]
            if name not in ("data", "pads", "splits") and "constexpr" not in str(fn.__annotations__.get(name, ""))]
    return triton.jit(do_not_specialize=ints)(fn)


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
def _bases(data, kb, E, W: tl.constexpr, FIELD: tl.constexpr, KW: tl.constexpr):
    """[KW] vector: each rank's data base plus the offset it pushed into its row here (field FIELD)."""
    lanes = tl.arange(0, KW)
    mask = lanes < W
    off = tl.load((row_of(kb, E, lanes) + FIELD * 8).to(tl.pointer_type(tl.int64)), mask=mask, other=0,
                  volatile=True)
    return tl.load(data + lanes, mask=mask, other=0) + off


@helper
def _chunk(n, BLOCK: tl.constexpr):
    """Block b's share ``[lo, hi)`` of ``n`` items: G equal BLOCK-aligned chunks. Blocks past the end get an
    empty range (``hi == lo``: never ``hi < lo``, whose spans would run backwards over the others' items);
    ``lo`` stays a multiple of BLOCK, which the compiler sees."""
    G = tl.num_programs(0)
    b = tl.program_id(0)
    per = ((n + G - 1) // G + BLOCK - 1) // BLOCK * BLOCK
    lo = b.to(tl.int64) * per
    hi = tl.maximum(tl.minimum(lo + per, n), lo)
    return lo, hi


@helper
def _leave(kb, peers_kb, me, E, go, arrived, timeout_ns, KW: tl.constexpr):
    """A block that skipped the work (mismatch) still does the exit barrier among the ranks that came."""
    if go == 0:
        sync(kb, peers_kb, me, tl.program_id(0), E, _STEP_EXIT, arrived, timeout_ns, KW)
    finish(kb, E)


# ------------------------------------------------------------------ kernels
@_kernel
def barrier_kernel(pads, splits, slot_off, me, W: tl.constexpr, op, check, timeout_ns, KW: tl.constexpr):
    """Entry handshake only (one block). ``op`` is BARRIER, or ERROR for a rank whose call failed
    validation: it then waits for the peers' exit barrier too, as the ops they run do."""
    fields = _pack(op, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0)
    kb, peers_kb, E, go, arrived = begin(pads, slot_off, me, W, fields, splits, check, timeout_ns, 0, 0, KW)
    if (go == 1) & (op == _KOP_ERROR):
        sync(kb, peers_kb, me, tl.program_id(0), E, _STEP_EXIT, arrived, timeout_ns, KW)
    _leave(kb, peers_kb, me, E, go, arrived, timeout_ns, KW)


@_kernel
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
        srcs = _bases(data, kb, E, W, _A_IN_OFF, KW)
        if TWO_SHOT:
            S = ((N + W - 1) // W + 15) // 16 * 16  # slices of 16 elements: 16-byte aligned when the tensors are
            s_lo = tl.minimum((me + tl.zeros([], tl.int64)) * S, N)
            s_hi = tl.minimum(s_lo + S, N)
            lo, hi = _chunk(s_hi - s_lo, BLOCK)
            reduce_range(data, srcs, out_addr, s_lo + lo, s_lo + hi, W, DT, RED, ESZ, BLOCK, INTERP, KW)
            alive = sync(kb, peers_kb, me, b, E, 1, arrived, timeout_ns, KW)
            if alive == 1:
                dsts = _bases(data, kb, E, W, _A_OUT_OFF, KW)
                for q in range(W):
                    if q != me:
                        q_lo = tl.minimum(q * S, N)
                        q_hi = tl.minimum(q_lo + S, N)
                        lo, hi = _chunk(q_hi - q_lo, BLOCK)
                        copy_range(data, pick(dsts, q, KW), out_addr, q_lo + lo, q_lo + hi, DT, ESZ, BLOCK, INTERP)
                sync(kb, peers_kb, me, b, E, _STEP_EXIT, arrived, timeout_ns, KW)
        elif INPLACE:
            # Each tile is stored only after every peer has read it (a barrier per tile); the block's last
            # tile's barrier is its exit barrier (STEP_EXIT), so that in- and out-of-place calls pair.
            lo, hi = _chunk(N, BLOCK)
            vec = aligned(srcs, out_addr, W, KW)
            alive = 1
            step = 1
            for start in range(bound(lo), bound(hi), BLOCK):
                if alive == 1:
                    offs = start + tl.arange(0, BLOCK)
                    m = offs < hi
                    whole = start + BLOCK <= hi
                    if vec & whole:
                        acc = reduce_tile(data, srcs, offs, m, W, DT, RED, ESZ, INTERP, True, False, KW)
                    else:
                        acc = reduce_tile(data, srcs, offs, m, W, DT, RED, ESZ, INTERP, False, True, KW)
                    if start + BLOCK >= hi:
                        step = _STEP_EXIT
                    alive = sync(kb, peers_kb, me, b, E, step, arrived, timeout_ns, KW)
                    step += 1
                    if alive == 1:
                        if vec & whole:
                            store_acc(ptr_at(data, out_addr, DT, ESZ, INTERP, True) + offs, acc, m, DT, INTERP, False)
                        else:
                            store_acc(ptr_at(data, out_addr, DT, ESZ, INTERP, False) + offs, acc, m, DT, INTERP, True)
            if lo >= hi:
                sync(kb, peers_kb, me, b, E, _STEP_EXIT, arrived, timeout_ns, KW)
        else:
            lo, hi = _chunk(N, BLOCK)
            reduce_range(data, srcs, out_addr, lo, hi, W, DT, RED, ESZ, BLOCK, INTERP, KW)
            sync(kb, peers_kb, me, b, E, _STEP_EXIT, arrived, timeout_ns, KW)
    _leave(kb, peers_kb, me, E, go, arrived, timeout_ns, KW)


@_kernel
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
        srcs = _bases(data, kb, E, W, _A_IN_OFF, KW)
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
                    src = ptr_at(data, pick(srcs, q, KW), CDT, ESZ, INTERP, False)
                    out = ptr_at(data, out_addr, CDT, ESZ, INTERP, False)
                    for start in range(bound(lo), bound(hi), BLOCK):
                        i = start + tl.arange(0, BLOCK)
                        m = i < hi
                        o = i // L
                        tl.store(out + o * row + pre * inner + (i - o * L), tl.load(src + i, mask=m), mask=m)
                else:
                    copy_range(data, pick(srcs, q, KW), out_addr + pre * inner * ESZ, lo, hi, CDT, ESZ, BLOCK, INTERP)
            pre += sz
        sync(kb, peers_kb, me, tl.program_id(0), E, _STEP_EXIT, arrived, timeout_ns, KW)
    _leave(kb, peers_kb, me, E, go, arrived, timeout_ns, KW)


@_kernel
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
            pre = (me + tl.zeros([], tl.int64)) * cnt
            sz = cnt + tl.zeros([], tl.int64)
        L = sz * inner
        # Every rank's part starts ``pre * inner`` elements into its input.
        srcs = _bases(data, kb, E, W, _A_IN_OFF, KW) + pre * inner * ESZ
        lo, hi = _chunk(outer * L, BLOCK)
        if ROWS:  # strided parts: element by element
            out = ptr_at(data, out_addr, DT, ESZ, INTERP, False)
            row = total * inner
            for start in range(bound(lo), bound(hi), BLOCK):
                i = start + tl.arange(0, BLOCK)
                m = i < hi
                o = i // L
                acc = reduce_tile(data, srcs, o * row + (i - o * L), m, W, DT, RED, ESZ, INTERP, False, True, KW)
                store_acc(out + i, acc, m, DT, INTERP, True)
        else:
            reduce_range(data, srcs, out_addr, lo, hi, W, DT, RED, ESZ, BLOCK, INTERP, KW)
        sync(kb, peers_kb, me, tl.program_id(0), E, _STEP_EXIT, arrived, timeout_ns, KW)
    _leave(kb, peers_kb, me, E, go, arrived, timeout_ns, KW)


@_kernel
def all_to_all_kernel(data, pads, splits, slot_off, me, W: tl.constexpr, in_off, out_addr, dt, inner, cnt, numel,
                      out_rows, idx_off, idx_len, check, timeout_ns, CDT: tl.constexpr, ESZ: tl.constexpr, VAR: tl.constexpr,
                      GATHER: tl.constexpr, BLOCK: tl.constexpr, KW: tl.constexpr, INTERP: tl.constexpr):
    """All-to-all of rows of ``inner`` elements: this rank pulls, from each rank q, the rows q addressed to
    it (``cnt``, or q's in_splits[me] at row q.in_splits[0] + ... + q.in_splits[me-1] of q's input) into its
    output at row ``out_splits[0] + ... + out_splits[q-1]``. VAR: ``splits`` holds this rank's in_splits,
    then (from KW) its out_splits; every rank checks q's in_splits[me] against its out_splits[q]. Device
    splits are never seen by the host, so VAR bounds each pull by the rows there are: this rank's output
    (``out_rows``) and q's input (its NUMEL / inner); what the splits ask past them is recorded (F_ROWS_OUT,
    F_ROWS_IN) and neither read nor written. GATHER (with VAR): q's rows for this rank are not contiguous; q's
    int64 row list (in its heap at ``idx_off``, ``idx_len`` entries, published as OUT_OFF and ROOT; its
    destinations' lists one after the other, as the in_splits cut them) names them, and each row is pulled from
    where it is (entries past the list, or rows past q's input, are recorded as F_ROWS_IN and skipped): no
    sender packs its rows first."""
    fields = _pack(5, dt, 0, 0, idx_len, 1, inner, numel, in_off, idx_off, VAR + 2 * GATHER)
    kb, peers_kb, E, go, arrived = begin(pads, slot_off, me, W, fields, splits, check, timeout_ns,
                                         2 * KW if VAR else 0, 2 if VAR else 0, KW)
    if go == 1:
        srcs = _bases(data, kb, E, W, _A_IN_OFF, KW)
        sl = tl.arange(0, KW)
        dpre = tl.zeros([], tl.int64)
        if VAR and not GATHER:  # this rank's own in_splits against its input: the peers bound their pulls
            mine = vsum(tl.load(splits + sl, mask=sl < W, other=0))
            my_rows = numel // tl.maximum(inner, 1)
            if mine > my_rows:
                mismatch(kb, me, E, me, _F_ROWS_IN, mine, my_rows, _S_MISMATCH)
        for q in range(W):
            if VAR:
                outs = tl.load(splits + KW + sl, mask=sl < W, other=0)
                rows = vsum(tl.where(sl == q, outs, 0))
                prow = row_of(kb, E, q)
                theirs = tl.load((prow + (_A_SPLITS + sl) * 8).to(tl.pointer_type(tl.int64)), mask=sl < W, other=0,
                                 volatile=True)
                spre = vsum(tl.where(sl < me, theirs, 0))
                q_rows = tl.load((prow + _A_NUMEL * 8).to(tl.pointer_type(tl.int64)), volatile=True) // tl.maximum(
                    inner, 1)
                room_out = tl.maximum(out_rows - dpre, 0)
                if GATHER:  # the list's entries from spre on (each listed row is checked where it is pulled)
                    room_in = tl.maximum(tl.load((prow + _A_ROOT * 8).to(tl.pointer_type(tl.int64)), volatile=True)
                                         - spre, 0)
                else:
                    room_in = tl.maximum(q_rows - spre, 0)
                n = tl.maximum(tl.minimum(rows, tl.minimum(room_out, room_in)), 0)
                if n != rows:
                    if rows > room_out:
                        mismatch(kb, me, E, me, _F_ROWS_OUT, dpre + rows, out_rows, _S_MISMATCH)
                    else:
                        mismatch(kb, me, E, q, _F_ROWS_IN, spre + rows, q_rows, _S_MISMATCH)
            else:
                rows = cnt + tl.zeros([], tl.int64)
                spre = (me + tl.zeros([], tl.int64)) * cnt
                n = rows
                q_rows = numel // tl.maximum(inner, 1)  # (every rank's, checked equal; GATHER goes with VAR)
            if GATHER:  # row by row, each from where q's list says; block b takes every G-th row
                lst = (pick(_bases(data, kb, E, W, _A_OUT_OFF, KW), q, KW) + spre * 8).to(tl.pointer_type(tl.int64))
                rb = inner * ESZ
                for i in range(bound(tl.program_id(0)), bound(n), bound(tl.num_programs(0))):
                    tok = tl.load(lst + i, volatile=True)
                    if (tok >= 0) & (tok < q_rows):
                        copy_range(data, pick(srcs, q, KW) + tok * rb, out_addr + (dpre + i) * rb, 0, inner, CDT, ESZ,
                                   BLOCK, INTERP)
                    else:
                        mismatch(kb, me, E, q, _F_ROWS_IN, tok, q_rows, _S_MISMATCH)
            else:
                lo, hi = _chunk(n * inner, BLOCK)
                copy_range(data, pick(srcs, q, KW) + spre * inner * ESZ, out_addr + dpre * inner * ESZ, lo, hi, CDT,
                           ESZ, BLOCK, INTERP)
            dpre += rows
        sync(kb, peers_kb, me, tl.program_id(0), E, _STEP_EXIT, arrived, timeout_ns, KW)
    _leave(kb, peers_kb, me, E, go, arrived, timeout_ns, KW)


@_kernel
def broadcast_kernel(data, pads, splits, slot_off, me, W: tl.constexpr, in_off, out_addr, dt, root, N, check,
                     timeout_ns, CDT: tl.constexpr, ESZ: tl.constexpr, BLOCK: tl.constexpr, KW: tl.constexpr,
                     INTERP: tl.constexpr):
    """Every rank but ``root`` pulls the root's N elements (a heap tensor) into ``out_addr``; the root
    only waits, in the exit barrier, until they have."""
    fields = _pack(6, dt, 0, 0, root, 1, 1, N, in_off, 0, 0)
    kb, peers_kb, E, go, arrived = begin(pads, slot_off, me, W, fields, splits, check, timeout_ns, 0, 0, KW)
    if go == 1:
        if me != root:
            srcs = _bases(data, kb, E, W, _A_IN_OFF, KW)
            lo, hi = _chunk(N, BLOCK)
            copy_range(data, pick(srcs, root, KW), out_addr, lo, hi, CDT, ESZ, BLOCK, INTERP)
        sync(kb, peers_kb, me, tl.program_id(0), E, _STEP_EXIT, arrived, timeout_ns, KW)
    _leave(kb, peers_kb, me, E, go, arrived, timeout_ns, KW)
