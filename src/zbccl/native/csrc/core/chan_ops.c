/* zbccl native collectives: each op in one call, over the handshake of chan.c.
 *
 * The protocol of every op (see the synchronisation notes at the top of each
 * zbccl/ops/ file) exists only here. The Python layer validates, decides the
 * algorithm (all but all_reduce's store kind: core policy, kind.c), stages tensors that are not in the heap before the call, fills
 * one zb_op (zb_abi.h) and turns the result code into an error. An error a
 * rank found locally travels in zb_op.error (its text already in the rank's
 * size-vector area): the op then only runs the handshake, so every rank fails
 * together. Operands are bounds-checked against each peer's heap size as
 * published now (heaps may grow during the job).
 */
#include "chan.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>


#define PREFETCH_MAX (64 << 10)

#include <time.h>

/* Phase tracing (chan_phases): add the time since the last mark to phase i. */
static inline int64_t mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}
#define MARK(c, i, t)                                     \
    do {                                                  \
        if ((c)->trace) {                                 \
            int64_t _now = mono_ns();                     \
            (c)->phase_ns[i] += _now - (t);               \
            (t) = _now;                                   \
        }                                                 \
    } while (0)
enum { PH_ARRIVE, PH_REDUCE, PH_PUSH, PH_DONE };

/* 1 if [off, off+nbytes) lies in rank r's heap, else records r and returns 0. The size is read
 * now (acquire): the owner publishes a grown size only after the new range is backed, and any
 * offset we got from it was handed out after that. */
static int in_heap(zb_chan *c, int r, int64_t off, int64_t nbytes) {
    if (off >= 0 && nbytes >= 0 && off + nbytes <= ld(c, c->size[r])) return 1;
    c->result[1] = r;
    return 0;
}

static int nthreads_for(zb_chan *c, int64_t nbytes) { return nbytes >= (1 << 20) ? (int)c->nthreads : 1; }

static int ensure_scratch(zb_chan *c, int64_t nbytes) {
    if (c->scratch_bytes >= nbytes) return 0;
    free(c->scratch);
    c->scratch = aligned_alloc(64, (size_t)((nbytes + 63) / 64 * 64));
    c->scratch_bytes = c->scratch ? nbytes : 0;
    return c->scratch ? 0 : -1;
}

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* Ask for a peer's lines all at once, so their cross-core misses overlap instead of following one
 * another (the hardware prefetcher needs a run of misses before it starts; a small slice is over by then). */
static void prefetch(const char *p, int64_t nbytes) {
    if (nbytes > PREFETCH_MAX) nbytes = PREFETCH_MAX;
    for (int64_t i = 0; i < nbytes; i += 64) __builtin_prefetch(p + i, 0, 3);
}

/* Post an error of `kind` with its text in this rank's header instead of failing alone: every rank
 * then sees it in the handshake and fails together (as ops/channel.py OpChannel.fail does). */
static void post_error(zb_chan *c, zb_op *o, int kind, const char *text) {
    size_t n = strlen(text);
    if (n > (VEC_CAP - 2) * 8) n = (VEC_CAP - 2) * 8;
    c->vec[c->me][0] = (int64_t)n;
    memcpy((char *)(c->vec[c->me] + 1), text, n);
    o->error = kind;
}

/* Publish this rank's per-rank sizes (elements) and, after ARRIVE, check that every rank posted the
 * same ones: exact counts, not a checksum. On a difference both vectors are kept for the message. */
static void post_sizes(zb_chan *c, const zb_op *o) {
    memcpy(c->vec[c->me], (const int64_t *)(uintptr_t)o->counts, (size_t)o->nvec * sizeof(int64_t));
}

static int check_sizes(zb_chan *c, int64_t seq) {
    size_t n = (size_t)c->W * sizeof(int64_t);
    for (int r = 1; r < c->W; r++)
        if (memcmp(c->vec[r], c->vec[0], n)) {
            memcpy(c->veccopy[0], c->vec[0], n);
            memcpy(c->veccopy[1], c->vec[r], n);
            c->result[1] = r;
            return fail_op(c, seq, RC_SIZES);
        }
    return RC_OK;
}

static int twoshot(zb_chan *c, int64_t seq, const void **srcs, char *dst, int64_t count, int64_t itemsize, int dt,
                   int op, double divisor, int nt, int64_t chunk, int stream, int64_t t);

/* ------------------------------------------------------------ oneshot: the last to arrive reduces for all
 *
 * Every rank posts its header and ARRIVE, then looks at the peers' ARRIVE. A rank that sees them all
 * claims the op in the group's election word (group rank 0's ELECT line, a CAS from below 2*seq to
 * 2*seq: exactly one rank wins). The store of ARRIVE and the loads of the peers' are sequentially
 * consistent, so the rank that arrived last always sees everyone: some rank claims. The claimant checks
 * every header, reduces all W tensors, in rank order, into its scratch, copies the result into every
 * rank's tensor (its own first), signals its DONE, and releases the word at 2*seq+1 with its verdict
 * (words W_RC, W_RANK, W_FIELD). It returns without waiting for anyone. Every other rank only waits
 * for the release, then signals its DONE. So the late rank of a step never waits for an early one
 * (which may sleep on a futex by then): with skewed ranks the op costs the late rank one reduction and
 * W copies. Reads N*W and writes N*W, all by one rank: for small messages.
 * Errors: the claimant posts the code; the others copy the headers for the message and every rank ends
 * with the DONE handshake (fail_op), as after begin_op. A rank that took begin_op instead (it posted an
 * error, or called another op or algorithm) finds the headers disagree and claims and releases the word
 * with that verdict, so a rank waiting here is never left behind (chan.c begin_op). A peer that left (ABORT) is checked by the
 * claimant before it writes into anyone. The word is zeroed with the comm slot (slots.reset_slot). */
static int all_arrived(zb_chan *c, int64_t seq) {
    for (int r = 0; r < c->W; r++)
        if (r != c->me && ld(c, c->arrive[r]) < seq) return 0;
    return 1;
}

static int oneshot(zb_chan *c, zb_op *o, const int *fields, int nfields, int64_t t) {
    int64_t seq = o->seq, count = o->in_numel, nbytes = count * o->itemsize;
    post_header(c, o);
    signal_flag(c, c->arrive[c->me], seq);
    if (all_arrived(c, seq) && elect_claim(c, seq)) {
        int rc = check_headers(c, seq, fields, nfields);
        for (int r = 0; !rc && r < c->W; r++)
            if (!in_heap(c, r, c->hdrcopy[r][H_IN_OFF], nbytes)) rc = RC_SPAN;
        if (!rc && peer_left(c)) rc = RC_ABORTED; /* before writing into any peer */
        if (rc) {
            elect_release(c, seq, rc);
            return rc == RC_ABORTED ? rc : fail_op(c, seq, rc);
        }
        MARK(c, PH_ARRIVE, t);
        const void *srcs[ZB_MAXW];
        for (int r = 0; r < c->W; r++) srcs[r] = c->base[r] + c->hdrcopy[r][H_IN_OFF];
        int nt = nthreads_for(c, nbytes);
        if (count) {
            c->tp->reduce(c->scratch, srcs, c->W, count, (int)o->dtype, (int)o->redop, (double)c->W, nt, 0);
            MARK(c, PH_REDUCE, t);
            for (int i = 0; i < c->W; i++) c->tp->copy((void *)srcs[(c->me + i) % c->W], c->scratch, nbytes, nt, 0);
            MARK(c, PH_PUSH, t);
        }
        signal_flag(c, c->done[c->me], seq);
        elect_release(c, seq, RC_OK);
        return RC_OK;
    }
    int64_t *word[ZB_MAXW];
    for (int r = 0; r < c->W; r++) word[r] = c->elect;
    int rc = wait_all(c, word, 2 * seq + 1);
    MARK(c, PH_DONE, t);
    if (rc == RC_TIMEOUT) { /* name the ranks that never arrived (if all did, the claimant is late) */
        int64_t late[ZB_MAXW / 64] = {0};
        int any = 0;
        for (int r = 0; r < c->W; r++)
            if (r != c->me && ld(c, c->arrive[r]) < seq)
                late[r / 64] |= 1ull << (r % 64), any = 1;
        if (any) memcpy(c->late_mask, late, sizeof(late));
    }
    if (rc) return rc;
    rc = (int)__atomic_load_n(&c->elect[W_RC], __ATOMIC_RELAXED);
    if (rc == RC_OK) {
        signal_flag(c, c->done[c->me], seq);
        return RC_OK;
    }
    c->result[1] = c->elect[W_RANK], c->result[2] = c->elect[W_FIELD];
    if (rc == RC_ABORTED) return rc;
    int mine = check_headers(c, seq, fields, nfields); /* the headers for the message (same verdict) */
    return fail_op(c, seq, mine ? mine : rc);
}

static int allreduce(zb_chan *c, zb_op *o) {
    int64_t count = o->in_numel, seq = o->seq, itemsize = o->itemsize;
    int64_t nbytes = count * itemsize;
    static const int fields[] = {H_OP, H_DTYPE, H_REDOP, H_IN_NUMEL, H_ALGO, H_AUX};
    if (o->algo == ALGO_ONESHOT && nbytes && ensure_scratch(c, nbytes)) {
        /* before ARRIVE, so the group fails together with the reason instead of hanging on DONE */
        char text[160];
        snprintf(text, sizeof(text), "all_reduce: cannot allocate %lld bytes of scratch memory for the oneshot "
                 "algorithm", (long long)nbytes);
        post_error(c, o, ERR_NOMEM, text);
        return run_op(c, o);
    }
    int64_t t = 0, start = c->kind_mode < 0 || c->trace ? mono_ns() : 0;
    if (c->trace) memset(c->phase_ns, 0, sizeof(c->phase_ns)), t = start;
    if (o->algo == ALGO_ONESHOT) {
        o->kind = 0;
        return oneshot(c, o, fields, 6, t);
    }
    o->kind = c->me == 0 ? kind_choose(c, nbytes, start) : 0; /* group rank 0 chooses for everyone */
    int rc = begin_op(c, o, fields, 6);
    if (rc) return rc;
    int stream = (int)c->hdrcopy[0][H_KIND];
    if (peer_left(c)) return RC_ABORTED; /* twoshot writes into peers: only while every one is in */
    MARK(c, PH_ARRIVE, t);
    const void *srcs[ZB_MAXW];
    for (int r = 0; r < c->W; r++) {
        if (!in_heap(c, r, c->hdrcopy[r][H_IN_OFF], nbytes)) return fail_op(c, seq, RC_SPAN);
        srcs[r] = c->base[r] + c->hdrcopy[r][H_IN_OFF];
    }
    if (!count) return sync_on(c, c->done, seq);
    char *dst = (char *)(uintptr_t)o->out_addr;
    int dt = (int)o->dtype, op = (int)o->redop;
    rc = twoshot(c, seq, srcs, dst, count, itemsize, dt, op, (double)c->W, nthreads_for(c, nbytes), o->aux, stream,
                 t);
    if (!rc && start && c->me == 0) kind_learn(c, nbytes, stream, start, mono_ns());
    return rc;
}

/* Slice r of [lo, hi): 64-byte aligned, so no two ranks write one cache line. */
static void slice_of(int64_t lo, int64_t hi, int64_t W, int64_t r, int64_t itemsize, int64_t *a, int64_t *b) {
    int64_t align = 64 / itemsize > 0 ? 64 / itemsize : 1;
    int64_t step = (hi - lo + W - 1) / W;
    step = (step + align - 1) / align * align;
    *a = min64(hi, lo + r * step);
    *b = min64(hi, lo + (r + 1) * step);
}

/* twoshot: reduce-scatter, then push. For each chunk (the tuner's chunk size), rank r reduces slice r
 * of the chunk from every rank's tensor, in rank order, into its own tensor, then writes that reduced
 * slice into every peer's tensor. Only rank r ever reads or writes slice r of any tensor during the op
 * (it reads every rank's slice r before it writes any of them), so no step waits on another rank: the
 * op is ARRIVE, the work, DONE. Rank r's own slice r is written with cached stores into lines no other
 * core touched since rank r wrote them the last time (they stay in its cache for the next op's read);
 * the pushes go into peers' lines with the store kind rank 0 chose (streaming skips the read for
 * ownership of a line this rank just read). DONE: every push into this rank's tensor has landed and
 * nobody reads it any more. */
static int twoshot(zb_chan *c, int64_t seq, const void **srcs, char *dst, int64_t count, int64_t itemsize, int dt,
                   int op, double divisor, int nt, int64_t chunk, int stream, int64_t t) {
    if (chunk <= 0) chunk = count;
    for (int64_t lo = 0; lo < count; lo += chunk) {
        int64_t a, b;
        slice_of(lo, min64(count, lo + chunk), c->W, c->me, itemsize, &a, &b);
        if (b <= a) continue;
        const void *part[ZB_MAXW];
        int64_t n = (b - a) * itemsize;
        for (int r = 0; r < c->W; r++) {
            part[r] = (const char *)srcs[r] + a * itemsize;
            if (r != c->me) prefetch(part[r], n);
        }
        char *mine = dst + a * itemsize;
        c->tp->reduce(mine, part, c->W, b - a, dt, op, divisor, nt, 0);
        MARK(c, PH_REDUCE, t);
        for (int i = 1; i < c->W; i++) {
            char *to = (char *)part[(c->me + i) % c->W]; /* the peer's slice: we read it, now we own it */
            if (stream) c->tp->copy(to, mine, n, nt, 1);
            else c->tp->copy(to, mine, n, nt, 0);
        }
        MARK(c, PH_PUSH, t);
    }
    int rc = sync_on(c, c->done, seq);
    MARK(c, PH_DONE, t);
    return rc;
}


/* ------------------------------------------------------------ all_gather (even and v) */

/* Exchanges whose inputs are not all in the heap and whose outputs are not all in the heap either:
 * each rank with a private input copies it into the heap block Python reserved (o->stage_off),
 * publishes the offset in the last entry of its size-vector area and signals PHASE base+1; once every
 * rank did, the headers' input offsets are replaced by the staged ones and the op pulls. */
static int stage_inputs(zb_chan *c, zb_op *o, int64_t nbytes) {
    if (c->hdrcopy[c->me][H_IN_OFF] < 0) {
        if (nbytes) c->tp->copy(c->base[c->me] + o->stage_off, (const char *)(uintptr_t)o->in_addr, nbytes,
                            nthreads_for(c, nbytes), 0);
        o->staged = nbytes;
    }
    c->vec[c->me][VEC_CAP - 1] = o->stage_off;
    signal_flag(c, c->phase[c->me], c->phase_base + 1);
    int rc = wait_all(c, c->phase, c->phase_base + 1);
    if (rc) return rc;
    for (int r = 0; r < c->W; r++)
        if (c->hdrcopy[r][H_IN_OFF] < 0) c->hdrcopy[r][H_IN_OFF] = __atomic_load_n(&c->vec[r][VEC_CAP - 1],
                                                                                  __ATOMIC_RELAXED);
    return RC_OK;
}

/* Whether an exchange pushes (every output in the heap, and the tuner chose push or some input is
 * private); otherwise it pulls, after staging the private inputs. */
static int exchange_mode(zb_chan *c, zb_op *o, int64_t in_bytes, int *push) {
    int all_in = 1, all_out = 1;
    for (int r = 0; r < c->W; r++) {
        all_in &= c->hdrcopy[r][H_IN_OFF] >= 0;
        all_out &= c->hdrcopy[r][H_OUT_OFF] >= 0;
    }
    *push = all_out && (!all_in || o->algo == ALGO_PUSH);
    if (*push && peer_left(c)) return RC_ABORTED; /* a push writes into peers: only while every one is in */
    return all_in || *push ? RC_OK : stage_inputs(c, o, in_bytes);
}

/* A block too large to stay in this core's caches is written with streaming stores: cached ones would
 * first read every destination line from memory (docs/benchmarks.md: all_gather at 16-64 MiB). */
#define BIG_COPY_BYTES (8 << 20)
static inline int streamed(int64_t nbytes) { return nbytes >= BIG_COPY_BYTES; }

/* counts[r]: elements from rank r. AUX = blocks > 1: a gather along an inner dimension; every input is
 * `blocks` rows of counts[r] / blocks elements, and row i of rank r lands at row i, column disp[r] of
 * the output (rows of total / blocks elements, disp[r] = sum of the row lengths before r). Otherwise
 * the output is the inputs end to end (the displacement of r is sum(counts[:r])). */
static int allgather(zb_chan *c, zb_op *o) {
    /* AUX (the dimension) before ROW (its rows): a disagreement names the dimension */
    static const int fields[] = {H_OP, H_DTYPE, H_AUX, H_ROW, H_OUT_NUMEL};
    int64_t seq = o->seq, isz = o->itemsize, blocks = o->aux > 1 ? o->aux : 1;
    const int64_t *counts = (const int64_t *)(uintptr_t)o->counts;
    char *in = (char *)(uintptr_t)o->in_addr, *out = (char *)(uintptr_t)o->out_addr;
    post_sizes(c, o);
    int rc = begin_op(c, o, fields, 5);
    if (!rc) rc = check_sizes(c, seq);
    if (rc) return rc;
    int64_t disp[ZB_MAXW + 1], total = 0;
    for (int r = 0; r < c->W; r++) {
        if (counts[r] % blocks) return fail_op(c, seq, RC_SPAN); /* Python never posts it: a row that does not fit */
        disp[r] = total, total += counts[r] / blocks;
    }
    int push;
    rc = exchange_mode(c, o, counts[c->me] * isz, &push);
    if (rc) return rc;
    int64_t out_row = total * isz; /* output row stride (bytes); total * blocks elements in all */
    int nt = nthreads_for(c, total * blocks * isz);
    int64_t mine = counts[c->me] / blocks * isz;
    for (int k = 1; k < c->W; k++) {
        int q = (int)((c->me + k) % c->W);
        if (push) {
            int64_t off = c->hdrcopy[q][H_OUT_OFF];
            if (!in_heap(c, q, off, total * blocks * isz)) return fail_op(c, seq, RC_SPAN);
            if (mine)
                c->tp->copy_rows(c->base[q] + off + disp[c->me] * isz, out_row, in, mine, blocks, mine, nt,
                             streamed(mine * blocks));
        } else {
            int64_t off = c->hdrcopy[q][H_IN_OFF], theirs = counts[q] / blocks * isz;
            if (!in_heap(c, q, off, counts[q] * isz)) return fail_op(c, seq, RC_SPAN);
            if (theirs)
                c->tp->copy_rows(out + disp[q] * isz, out_row, c->base[q] + off, theirs, blocks, theirs, nt,
                             streamed(theirs * blocks));
        }
    }
    char *mine_dst = out + disp[c->me] * isz;
    if (mine_dst != in && mine) c->tp->copy_rows(mine_dst, out_row, in, mine, blocks, mine, nt, streamed(mine * blocks));
    return sync_on(c, c->done, seq);
}

/* ------------------------------------------------------------ all_to_all */

/* Every rank's size vector is [in counts (W) | out counts (W)], in elements. */
static int alltoall(zb_chan *c, zb_op *o) {
    static const int fields[] = {H_OP, H_DTYPE, H_ROW};
    int64_t seq = o->seq, isz = o->itemsize;
    char *in = (char *)(uintptr_t)o->in_addr, *out = (char *)(uintptr_t)o->out_addr;
    post_sizes(c, o);
    int rc = begin_op(c, o, fields, 3);
    if (rc) return rc;
    int64_t W = c->W, me = c->me;
    /* every rank's [in | out] splits, read in place: no rank posts its next op before our DONE */
    const int64_t *v[ZB_MAXW];
    for (int r = 0; r < W; r++) v[r] = c->vec[r];
    for (int q = 0; q < W; q++)
        for (int r = 0; r < W; r++)
            if (v[q][r] != v[r][W + q]) {
                c->result[1] = q, c->result[2] = r;
                memcpy(c->veccopy[0], v[q], (size_t)(2 * W) * sizeof(int64_t));
                memcpy(c->veccopy[1], v[r], (size_t)(2 * W) * sizeof(int64_t));
                return fail_op(c, seq, RC_SPLITS);
            }
    int push;
    rc = exchange_mode(c, o, o->in_numel * isz, &push);
    if (rc) return rc;
    for (int k = 0; k < W && !rc; k++) {
        int q = (int)((me + k) % W);
        int64_t src_rank = push ? me : q, dst_rank = push ? q : me;
        const int64_t *sv = v[src_rank], *dv = v[dst_rank];
        int64_t in_disp = 0, out_disp = 0, n = sv[dst_rank] * isz;
        for (int j = 0; j < dst_rank; j++) in_disp += sv[j];
        for (int j = 0; j < src_rank; j++) out_disp += dv[W + j];
        int64_t in_total = 0, out_total = 0;
        for (int j = 0; j < W; j++) in_total += sv[j], out_total += dv[W + j];
        char *src, *dst;
        if (push) {
            int64_t off = c->hdrcopy[q][H_OUT_OFF];
            if (q != me && !in_heap(c, q, off, out_total * isz)) { rc = RC_SPAN; break; }
            src = in + in_disp * isz;
            dst = (q == me ? out : c->base[q] + off) + out_disp * isz;
        } else {
            int64_t off = c->hdrcopy[q][H_IN_OFF];
            if (q != me && !in_heap(c, q, off, in_total * isz)) { rc = RC_SPAN; break; }
            src = (q == me ? in : c->base[q] + off) + in_disp * isz;
            dst = out + out_disp * isz;
        }
        if (n) c->tp->copy(dst, src, n, nthreads_for(c, n), 0);
    }
    return rc ? fail_op(c, seq, rc) : sync_on(c, c->done, seq);
}

/* ------------------------------------------------------------ reduce_scatter */

/* counts[r]: elements of rank r's slice. AUX = blocks > 1: a reduce-scatter along an inner dimension; every
 * input is `blocks` rows of sum(counts) / blocks elements, and rank r's slice is columns lo_r .. lo_r +
 * counts[r] / blocks of each row (lo_r = the row lengths before r), its output `blocks` rows of those. */
static int reducescatter(zb_chan *c, zb_op *o) {
    /* AUX (the dimension) before ROW (its rows): a disagreement names the dimension */
    static const int fields[] = {H_OP, H_DTYPE, H_REDOP, H_IN_NUMEL, H_AUX, H_ROW, H_ALGO};
    int64_t seq = o->seq, isz = o->itemsize, blocks = o->aux > 1 ? o->aux : 1;
    const int64_t *counts = (const int64_t *)(uintptr_t)o->counts;
    char *out = (char *)(uintptr_t)o->out_addr;
    post_sizes(c, o);
    int rc = begin_op(c, o, fields, 7);
    if (!rc) rc = check_sizes(c, seq);
    if (rc) return rc;
    int64_t lo = 0, total = 0;
    for (int r = 0; r < c->W; r++) {
        if (counts[r] % blocks) return fail_op(c, seq, RC_SPAN); /* Python never posts it */
        if (r < c->me) lo += counts[r] / blocks;
        total += counts[r] / blocks;
    }
    const char *base[ZB_MAXW];
    for (int r = 0; r < c->W; r++) {
        int64_t off = c->hdrcopy[r][H_IN_OFF];
        if (!in_heap(c, r, off, o->in_numel * isz)) return fail_op(c, seq, RC_SPAN);
        base[r] = c->base[r] + off + lo * isz;
    }
    int64_t n = counts[c->me] / blocks;
    int nt = nthreads_for(c, n * isz);
    const void *srcs[ZB_MAXW];
    for (int64_t b = 0; n && b < blocks; b++) {
        for (int r = 0; r < c->W; r++) srcs[r] = base[r] + b * total * isz;
        c->tp->reduce(out + b * n * isz, srcs, c->W, n, (int)o->dtype, (int)o->redop, (double)c->W, nt, 0);
    }
    return sync_on(c, c->done, seq);
}

/* ------------------------------------------------------------ broadcast */

static int bcast(zb_chan *c, zb_op *o) {
    static const int fields[] = {H_OP, H_DTYPE, H_IN_NUMEL, H_ROOT, H_ALGO};
    int64_t seq = o->seq;
    char *dst = (char *)(uintptr_t)o->out_addr;
    int rc = begin_op(c, o, fields, 5);
    if (rc) return rc;
    int root = (int)o->root;
    int64_t nbytes = o->in_numel * o->itemsize;
    if (root != c->me && nbytes) {
        int64_t off = c->hdrcopy[root][H_IN_OFF];
        if (!in_heap(c, root, off, nbytes)) return fail_op(c, seq, RC_SPAN);
        c->tp->copy(dst, c->base[root] + off, nbytes, nthreads_for(c, nbytes), 0);
    }
    return sync_on(c, c->done, seq);
}

/* ------------------------------------------------------------ barrier */

/* The communicator's barrier (and EP's tagged barrier): one handshake round, no bytes.
 *
 * A rank posts its header (OP_BARRIER; DIGEST the caller's tag, 0 for a plain barrier; AUX the protocol,
 * WHERE_*, its ABORT lines name if it leaves half-way, 0: WHERE_BARRIER) and ARRIVE, waits for every
 * ARRIVE, then checks every peer's header: another op (RC_MISMATCH on OP), another tag (on DIGEST) or a
 * posted error fails the op on every rank (the DONE handshake of fail_op). There is no DONE round on
 * success, so a peer that passed may already be posting its next header while we read: headers are read
 * as a seqlock (post_header: SEQ 0 while the fields change), and a peer whose SEQ moved past this op
 * passed it, which it does only once every header agreed, ours included (agreement is symmetric, and a
 * rank that found a disagreement waits in fail_op for everyone's DONE, so its header stays put until
 * every rank read it). After the ARRIVE round every peer's ABORT lines are read once: a peer that arrived
 * and then left is reported here. DONE = seq is signalled on the way out, without waiting, so that
 * leave_op and the timeout's description see this rank finished. */
static int barrier_headers(zb_chan *c, const zb_op *o) {
    int64_t seq = o->seq;
    int step = -1, error = -1, odd = -1, field = -1;
    memcpy(c->hdrcopy[c->me], c->hdr[c->me], sizeof(c->hdrcopy[0]));
    for (int r = 0; r < c->W; r++) {
        if (r == c->me) continue;
        int64_t s1 = __atomic_load_n(c->hdr[r], __ATOMIC_ACQUIRE);
        if (s1 == seq) {
            memcpy(c->hdrcopy[r], c->hdr[r], sizeof(c->hdrcopy[r]));
            __atomic_thread_fence(__ATOMIC_ACQUIRE);
            if (__atomic_load_n(c->hdr[r], __ATOMIC_RELAXED) == seq) { /* a whole copy of its header at seq */
                if (c->hdrcopy[r][H_ERROR] && error < 0) error = r;
                int f = c->hdrcopy[r][H_OP] != OP_BARRIER ? H_OP : c->hdrcopy[r][H_DIGEST] != o->digest ? H_DIGEST : -1;
                if (f >= 0 && odd < 0) odd = r, field = f;
                continue;
            }
        } else if (s1 != 0 && s1 < seq && step < 0) { /* cannot happen once its ARRIVE reached seq */
            step = r;
        }
        memcpy(c->hdrcopy[r], c->hdrcopy[c->me], sizeof(c->hdrcopy[r])); /* it passed: it posted what we did */
    }
    /* every row is copied (a disagreement keeps every rank's header in place: nobody passes), in
     * check_headers' order of verdicts */
    if (step >= 0) {
        c->result[1] = step;
        return RC_STEP;
    }
    if (error >= 0) {
        c->result[1] = error;
        c->result[2] = c->hdrcopy[error][H_ERROR];
        memcpy(c->veccopy[0], c->vec[error], sizeof(c->veccopy[0])); /* its error text */
        return c->hdrcopy[error][H_ERROR] == ERR_NOMEM ? RC_NOMEM : RC_PEER_ERROR;
    }
    if (odd >= 0) {
        c->result[1] = odd;
        c->result[2] = field;
        return RC_MISMATCH;
    }
    return RC_OK;
}

static int barrier(zb_chan *c, zb_op *o) {
    int64_t seq = o->seq;
    post_header(c, o);
    int rc = sync_on(c, c->arrive, seq);
    if (rc) return rc;
    /* a peer that arrived and then left (Ctrl-C in this barrier, say) is named here, as the DONE round of
     * a collective would, not only in the next op */
    if (peer_aborted(c)) return RC_ABORTED;
    rc = barrier_headers(c, o);
    if (rc) {
        /* a peer running the oneshot all_reduce may wait on the election word instead of our DONE */
        if (elect_claim(c, seq)) elect_release(c, seq, rc);
        return fail_op(c, seq, rc);
    }
    signal_flag(c, c->done[c->me], seq);
    return RC_OK;
}

/* ------------------------------------------------------------ one entry for every op */

/* An op whose arguments failed on this rank (o->error set, the text already in this rank's size-vector
 * area): only the handshake, which reports the error on every rank. */
static int failed(zb_chan *c, zb_op *o) {
    int rc = begin_op(c, o, NULL, 0);
    return rc ? rc : fail_op(c, o->seq, RC_PEER_ERROR); /* unreachable: our own header carries the error */
}

int run_op(zb_chan *c, zb_op *o) {
    if (o->error) return failed(c, o);
    switch (o->op) {
    case OP_ALL_REDUCE: return allreduce(c, o);
    case OP_ALL_GATHER: return allgather(c, o);
    case OP_ALL_TO_ALL: return alltoall(c, o);
    case OP_REDUCE_SCATTER: return reducescatter(c, o);
    case OP_BARRIER: return barrier(c, o);
    default: return bcast(c, o);
    }
}

/* ------------------------------------------------------------ the core's entry */

int zb_op_check(const zb_chan *c, const zb_op *o) {
    if (o->op < OP_ALL_REDUCE || o->op > OP_BARRIER || o->nvec < 0 || o->nvec > VEC_CAP || o->timeout_ns <= 0)
        return 1;
    if (!o->error && (o->op == OP_ALL_REDUCE || o->op == OP_REDUCE_SCATTER) &&
        !c->tp->reduce_valid((int)o->dtype, (int)o->redop))
        return 2;
    return 0;
}

/* Small ops keep the caller's thread (its GIL) while they spin; a long wait blocks it (chan.c wait_all), and
 * large ones block it at once. The caller sets c->hooks before and undoes a block after. */
int zb_chan_run(zb_chan *c, zb_op *o) {
    c->blocked = 0;
    if (zb_op_check(c, o)) return -1;
    int64_t nbytes = (o->in_numel > o->out_numel ? o->in_numel : o->out_numel) * o->itemsize;
    c->timeout_ns = o->timeout_ns;
    c->where = o->op == OP_BARRIER ? (o->aux > 0 ? o->aux : WHERE_BARRIER) : WHERE_COLLECTIVE;
    c->result[0] = c->result[1] = c->result[2] = c->result[3] = 0;
    if (nbytes >= (1 << 16)) chan_block(c);
    int rc = run_op(c, o);
    if (rc == RC_INTERRUPTED || rc == RC_TIMEOUT || rc == RC_ABORTED || rc == RC_DEAD || rc == RC_GONE) {
        /* This rank leaves the op half-way and its sequence number has advanced: tell the peers now
         * (they read ABORT at each liveness check) instead of letting them wait out the timeout, and
         * return only once no peer can still write into this rank's memory (chan.c leave_op). */
        chan_block(c);
        leave_op(c, o->seq, rc == RC_INTERRUPTED ? ABORT_INTERRUPT : rc == RC_TIMEOUT ? ABORT_TIMEOUT : ABORT_PEER);
    }
    c->result[0] = rc;
    return rc;
}
