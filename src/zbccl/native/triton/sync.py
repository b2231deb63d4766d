"""The kernels' handshake: publish arguments, signal, wait (bounded), agree, and the launch epoch.

Synchronisation protocol (one launch of any collective kernel, per block ``b``; geometry in
:mod:`.geometry`, all words int64 in the ranks' kernel slots):

1. **Epoch.** Every block reads its rank's ``K_EPOCH`` word ``e`` (launches completed) and works as launch
   ``E = e + 1``. The last block of the launch to finish (``K_DONE`` counter, an atomic add) resets
   ``K_DONE`` and stores ``E`` into ``K_EPOCH``; launches of one stream never overlap, so every block of
   the next launch reads ``E``. Nothing comes from the host: a graph replay stays in step.
2. **Publish.** Every block pushes this rank's argument row (same values from every block) into row
   ``[E % 2][me]`` of every group rank's slot, then signals step 0: for each group rank ``q`` it stores
   ``E * PHASE + 0`` into word ``[b][me]`` of ``q``'s signal block (atomic exchange, release, system
   scope: the peers are other processes; the release makes the row visible with the signal).
3. **Wait.** It spins (acquire, system scope) on its own words ``[b][0..W)`` until each is
   ``>= E * PHASE + step``, backing off between polls, for at most ``timeout_ns`` (GPU: the global
   timer, read by one thread and shared through the block's K_STAMP word so that every thread leaves
   the loop together; interpreter: the host clock). Block ``b`` waits only for block ``b`` of the peers: no block
   ever waits for another block of its own launch (under the interpreter the blocks of one launch run
   one after the other, and on a GPU they need not be co-resident). While waiting at entry it also
   peeks the late peers' rows: a peer whose block 0 signalled launch ``E`` and whose row says it runs
   fewer than ``b + 1`` blocks will never come (a mismatch, reported as one instead of a timeout).
4. **Agree.** It reads every peer's row (local memory) and compares the fields the op requires (``check`` bit mask)
   and, for the v-variants, the splits. Any difference: the block records it (status words: the lowest
   such rank, the field, both values), skips the work, and only does the exit barrier. Every rank
   sees the same rows, so every rank reports the mismatch.
5. **Work**, then the **exit barrier** (step ``STEP_EXIT``): a rank's memory is not reused (the next
   op, the caller's writes) until every peer's block ``b`` has finished reading it. Ops that write
   memory peers read (in-place one-shot, two-shot) add barriers at steps ``1, 2, ...`` in between.
6. **Timeout.** A wait that runs out records ``S_TIMEOUT`` and the bit of every rank still missing
   in the status words, and the block skips the rest of the launch (it still counts in ``K_DONE``):
   the kernel exits instead of hanging. After a timeout the communicator's kernel slot is out of step;
   ``DeviceOps`` refuses further ops.

Words only grow (``E * PHASE + step`` increases along a launch and across launches), so a word that a
faster peer has already advanced to a later step still satisfies a wait for an earlier one.
"""

from __future__ import annotations

import triton.language as tl

from . import geometry as g
from .prims import helper, now, pause, vmin, vmin2, vsum, vsum2

__all__ = ["row_of", "begin", "sync", "finish", "flag", "mismatch"]


_K_EPOCH = tl.constexpr(g.K_EPOCH)
_K_DONE = tl.constexpr(g.K_DONE)
_K_STATUS = tl.constexpr(g.K_STATUS)
_K_ARGS = tl.constexpr(g.K_ARGS)
_K_SIG = tl.constexpr(g.K_SIG)
_K_STAMP = tl.constexpr(g.K_STAMP)
_A_SPLITS = tl.constexpr(g.A_SPLITS)
_ROW_BYTES = tl.constexpr(g.ROW_BYTES)
_KW = tl.constexpr(g.KMAX_WORLD)
_A_GRID = tl.constexpr(g.A_GRID)
_PHASE = tl.constexpr(g.PHASE)
_ST_CODE = tl.constexpr(g.ST_CODE)
_ST_MISSING = tl.constexpr(g.ST_MISSING)
_ST_BAD = tl.constexpr(g.ST_BAD)
_ST_FIELD = tl.constexpr(g.ST_FIELD)
_ST_MINE = tl.constexpr(g.ST_MINE)
_ST_THEIRS = tl.constexpr(g.ST_THEIRS)
_ST_EPOCH = tl.constexpr(g.ST_EPOCH)
_ST_OP = tl.constexpr(g.ST_OP)
_S_TIMEOUT = tl.constexpr(g.S_TIMEOUT)
_S_MISMATCH = tl.constexpr(g.S_MISMATCH)
_S_PEER_ERROR = tl.constexpr(g.S_PEER_ERROR)
_KOP_ERROR = tl.constexpr(g.KOP["ERROR"])
_NFIELDS = tl.constexpr(16)

@helper
def _i64(addr):
    return addr.to(tl.pointer_type(tl.int64))


@helper
def row_of(kb, E, src):
    """Rank ``src``'s argument row for launch E in the kernel slot at ``kb`` (``src`` may be a vector).
    Two sets of rows, by E's parity: a peer one launch ahead never overwrites a row of a launch this rank
    still reads."""
    return kb + _K_ARGS + ((E % 2) * _KW + src) * _ROW_BYTES


@helper
def flag(kb, me, E, code, missing):
    """Record ``code`` (S_* bits) and the ``missing`` rank bits in this rank's status words."""
    st = kb + _K_STATUS
    tl.atomic_or(_i64(st + _ST_MISSING * 8), missing, sem="relaxed", scope="sys")
    tl.atomic_xchg(_i64(st + _ST_EPOCH * 8), E, sem="relaxed", scope="sys")
    op = tl.load(_i64(row_of(kb, E, me) + 8))  # this launch's own row: intact until the launch ends
    tl.atomic_xchg(_i64(st + _ST_OP * 8), op, sem="relaxed", scope="sys")
    tl.atomic_or(_i64(st + _ST_CODE * 8), code, sem="release", scope="sys")


@helper
def mismatch(kb, me, E, q, field, mine, theirs, code):
    """Record the first disagreeing rank ``q`` (the first block to get here wins), then ``code``."""
    st = kb + _K_STATUS
    first = tl.zeros([], tl.int64) + q + 1
    won = tl.atomic_cas(_i64(st + _ST_BAD * 8), first * 0, first, sem="acq_rel", scope="sys")
    if won == 0:
        zero = tl.zeros([], tl.int64)  # (under the interpreter a reduction's result is a host scalar)
        tl.store(_i64(st + _ST_FIELD * 8), field + zero)
        tl.store(_i64(st + _ST_MINE * 8), mine + zero)
        tl.store(_i64(st + _ST_THEIRS * 8), theirs + zero)
    flag(kb, me, E, code, 0)


@helper
def _stamp(word):
    """Thread 0's previous timer reading, the same in every thread of the block (a scalar atomic runs in one
    thread and its result is broadcast; a timer read in every thread differs across them, and a loop exit
    that differs across threads of a block would deadlock at its next barrier)."""
    return tl.atomic_xchg(_i64(word), now().to(tl.int64), sem="relaxed", scope="cta")


@helper
def _bits(lanes, cond):
    one = tl.full(lanes.shape, 1, tl.int64)
    return vsum(tl.where(cond, one << lanes.to(tl.int64), 0))


@helper
def _signal(peers_kb, me, b, value, mask, KW: tl.constexpr):
    """Store ``value`` into word [b][me] of every masked peer's signal block (release, system scope)."""
    ptrs = _i64(peers_kb + _K_SIG + (b * KW + me) * 8)
    tl.atomic_xchg(ptrs, tl.full([KW], 0, tl.int64) + value, mask=mask, sem="release", scope="sys")


@helper
def _wait(kb, peers_kb, b, E, target, mask, timeout_ns, PEEK: tl.constexpr, KW: tl.constexpr):
    """Spin until this rank's words [b][q] reach ``target`` for every masked q, or time out.

    Returns ``(late, gone)`` rank bit masks: ranks still missing at the timeout, and (PEEK) ranks whose
    row says they run launch E with no block ``b``.
    """
    lanes = tl.arange(0, KW)
    ptrs = _i64(kb + _K_SIG + (b * KW + lanes) * 8)
    vals = tl.atomic_add(ptrs, 0, mask=mask, sem="acquire", scope="sys")
    late = mask & (vals < target)
    gone = late & (lanes < 0)
    n = vsum(late.to(tl.int32))
    stamp = kb + _K_STAMP + b * 8
    _stamp(stamp)
    t0 = _stamp(stamp)
    elapsed = t0 - t0
    polls = 0
    while (n > 0) & (elapsed <= timeout_ns):
        pause(polls)
        polls += 1
        vals = tl.atomic_add(ptrs, 0, mask=mask, sem="acquire", scope="sys")
        late = mask & (vals < target) & ~gone
        if PEEK:
            # q's block 0 signalled launch E (acquire): the row q pushed here for E is complete.
            s0 = tl.atomic_add(_i64(kb + _K_SIG + lanes * 8), 0, mask=late, sem="acquire", scope="sys")
            rows = row_of(kb, E, lanes)
            pe = tl.load(_i64(rows), mask=late, other=0, volatile=True)
            pg = tl.load(_i64(rows + _A_GRID * 8), mask=late, other=0, volatile=True)
            gone = gone | (late & (s0 >= E * _PHASE) & (pe == E) & (pg <= b))
            late = late & ~gone
        n = vsum(late.to(tl.int32))
        elapsed = _stamp(stamp) - t0
    return _bits(lanes, late), _bits(lanes, gone)


@helper
def sync(kb, peers_kb, me, b, E, step, arrived, timeout_ns, KW: tl.constexpr):
    """One barrier round among the ``arrived`` ranks (bit mask) for block ``b``: 1 if all came, else 0
    (the timeout is recorded in the status words)."""
    tl.debug_barrier()  # every thread's writes of this block precede the release below
    lanes = tl.arange(0, KW)
    mask = ((arrived >> lanes.to(tl.int64)) & 1) != 0
    target = E * _PHASE + step
    _signal(peers_kb, me, b, target, mask, KW)
    late, gone = _wait(kb, peers_kb, b, E, target, mask, timeout_ns, False, KW)
    ok = 1
    if late != 0:
        flag(kb, me, E, _S_TIMEOUT, late)
        ok = 0
    tl.debug_barrier()  # what the acquire made visible is visible to every thread of the block
    return ok


@helper
def _publish(peers_kb, me, E, fields, splits_ptr, mask, NSPL: tl.constexpr, KW: tl.constexpr):
    """Push this rank's argument row for launch E (the fields with EPOCH = E, then NSPL int64 splits from
    ``splits_ptr``) into row [E % 2][me] of every masked rank's slot, this one's included: plain stores,
    made visible by the release of the signals that follow. The peers then read the rows in their own
    memory: no round trip to fetch the offsets and sizes before the data moves."""
    rows = row_of(peers_kb, E, me)
    fl = tl.arange(0, _NFIELDS)
    vals = tl.where(fl == 0, E, fields)
    tl.store(_i64(rows[:, None] + fl[None, :] * 8), vals[None, :] + tl.zeros([KW, _NFIELDS], tl.int64),
             mask=mask[:, None])
    if NSPL > 0:
        sl = tl.arange(0, NSPL)
        sp = tl.load(splits_ptr + sl)
        tl.store(_i64(rows[:, None] + (_A_SPLITS + sl[None, :]) * 8), sp[None, :] + tl.zeros([KW, NSPL], tl.int64),
                 mask=mask[:, None])


@helper
def _agree(kb, me, W: tl.constexpr, E, arrived, check, SPLITS: tl.constexpr, KW: tl.constexpr):
    """Compare every arrived peer's row with this rank's (the rows they pushed here, in one 2-d load of
    local memory); record the first difference (lowest rank, then field). 1 if all agree.

    ``check``: bit i set compares field i. SPLITS: 0 none; 1 the whole splits vector (all_gather_v,
    reduce_scatter_v: every rank passes every rank's size); 2 all_to_all_v: the row holds the rank's
    in_splits then (from A_SPLITS + KW) its out_splits, and q's in_splits[me] must equal my out_splits[q].
    """
    lanes = tl.arange(0, KW)
    fl = tl.arange(0, _NFIELDS)
    myrow = row_of(kb, E, me)
    mine = tl.load(_i64(myrow + fl * 8))
    valid = (((arrived >> lanes.to(tl.int64)) & 1) != 0) & (lanes != me) & (lanes < W)
    prow = row_of(kb, E, lanes)
    theirs = tl.load(_i64(prow[:, None] + fl[None, :] * 8), mask=valid[:, None], other=0, volatile=True)
    cmask = ((check >> fl.to(tl.int64)) & 1) != 0
    diff = valid[:, None] & cmask[None, :] & (theirs != mine[None, :])
    nokey = KW * 64
    key = vmin2(tl.where(diff, lanes[:, None] * 64 + fl[None, :], nokey))
    if SPLITS > 0:
        cols = valid[:, None] & (lanes[None, :] < W)
        st = tl.load(_i64(prow[:, None] + (_A_SPLITS + lanes[None, :]) * 8), mask=cols, other=0, volatile=True)
        if SPLITS == 1:
            sm = tl.load(_i64(myrow + (_A_SPLITS + lanes) * 8))
            sd = cols & (st != sm[None, :])
        else:
            want = tl.load(_i64(myrow + (_A_SPLITS + KW + lanes) * 8))  # my out_splits[q], by row q
            sd = cols & (lanes[None, :] == me) & (st != want[:, None])
        key = tl.minimum(key, vmin2(tl.where(sd, lanes[:, None] * 64 + 16 + lanes[None, :], nokey)))
    ok = 1
    if key < nokey:
        q = key // 64
        f = key % 64
        rowsel = lanes[:, None] == q
        field = f
        fm = vsum(tl.where(fl == f, mine, 0))
        ft = vsum2(tl.where(rowsel & (fl[None, :] == f), theirs, 0))
        if SPLITS > 0:
            if f >= 16:
                idx = f - 16
                ft = vsum2(tl.where(rowsel & (lanes[None, :] == idx), st, 0))
                if SPLITS == 1:
                    fm = vsum(tl.where(lanes == idx, sm, 0))
                    field = _A_SPLITS + idx
                else:
                    fm = vsum(tl.where(lanes == q, want, 0))
                    field = _A_SPLITS + KW + q
        code = _S_MISMATCH
        if vsum2(tl.where(rowsel & (fl[None, :] == 1), theirs, 0)) == _KOP_ERROR:
            code = _S_PEER_ERROR
        mismatch(kb, me, E, q, field, fm, ft, code)
        ok = 0
    return ok


@helper
def begin(pads, slot_off, me, W: tl.constexpr, fields, splits_ptr, check, timeout_ns,
          NSPL: tl.constexpr, SPLITS: tl.constexpr, KW: tl.constexpr):
    """Steps 1-4 of the protocol for this block. Returns ``(kb, peers_kb, E, go, arrived)``: this rank's
    kernel slot address, the peers' (a [KW] vector), the launch, 1 to do the work / 0 to skip it (a
    mismatch: still do the exit barrier among ``arrived``) / -1 (timed out: do nothing more), and the bit
    mask of the ranks that arrived."""
    b = tl.program_id(0)
    lanes = tl.arange(0, KW)
    mask = lanes < W
    peers_kb = tl.load(pads + lanes, mask=mask, other=0) + slot_off
    kb = tl.load(pads + me) + slot_off
    E = tl.load(_i64(kb + _K_EPOCH), volatile=True) + 1
    fl = tl.arange(0, _NFIELDS)
    _publish(peers_kb, me, E, fields, splits_ptr, mask, NSPL, KW)
    target = E * _PHASE
    tl.debug_barrier()
    _signal(peers_kb, me, b, target, mask, KW)
    late, gone = _wait(kb, peers_kb, b, E, target, mask, timeout_ns, True, KW)
    tl.debug_barrier()
    all_bits = _bits(lanes, mask)
    arrived = all_bits & ~late & ~gone
    go = 1
    if late != 0:
        flag(kb, me, E, _S_TIMEOUT, late)
        go = -1
    else:
        if gone != 0:
            # A peer runs this launch with fewer blocks: its arguments differ (the grid follows them).
            q = vmin(tl.where(((gone >> lanes.to(tl.int64)) & 1) != 0, lanes, KW))
            theirs = tl.load(_i64(row_of(kb, E, q) + _A_GRID * 8), volatile=True)
            mine = vsum(tl.where(fl == _A_GRID, fields, 0))
            mismatch(kb, me, E, q, _A_GRID, mine, theirs, _S_MISMATCH)
            go = 0
        ok = _agree(kb, me, W, E, arrived, check, SPLITS, KW)
        if ok == 0:
            go = 0
    return kb, peers_kb, E, go, arrived


@helper
def finish(kb, E):
    """Step 1's end: count this block done; the launch's last block publishes epoch E."""
    tl.debug_barrier()
    old = tl.atomic_add(_i64(kb + _K_DONE), 1, sem="acq_rel", scope="gpu")
    if old == tl.num_programs(0) - 1:
        tl.store(_i64(kb + _K_DONE), 0)
        tl.atomic_xchg(_i64(kb + _K_EPOCH), E, sem="release", scope="gpu")
