/* zbccl native collectives: each op in one call, over the handshake of chan.c.
 *
 * Same protocol, header fields and checks as zbccl/ops/ (see the
 * synchronisation notes at the top of each of those files); the Python layer
 * decides the algorithm, stages tensors that are not in the heap, and turns
 * result codes into errors. RC_FALLBACK means "placement needs staging":
 * the op stopped right after the header check and Python continues it.
 */
#include "chan.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "reduce.h"

/* 1 if [off, off+nbytes) lies in rank r's heap, else records r and returns 0. The size is read
 * now (acquire): the owner publishes a grown size only after the new range is backed, and any
 * offset we got from it was handed out after that. */
static int in_heap(zb_chan *c, int r, int64_t off, int64_t nbytes) {
    if (off >= 0 && nbytes >= 0 && off + nbytes <= __atomic_load_n(c->size[r], __ATOMIC_ACQUIRE)) return 1;
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

/* Post an error of `kind` with its text in this rank's header instead of failing alone: every rank
 * then sees it in the handshake and fails together (the Python path's fail_together). */
static void post_error(zb_chan *c, int64_t *mine, int kind, const char *text) {
    size_t n = strlen(text);
    if (n > (VEC_CAP - 2) * 8) n = (VEC_CAP - 2) * 8;
    c->vec[c->me][0] = (int64_t)n;
    memcpy((char *)(c->vec[c->me] + 1), text, n);
    mine[H_ERROR] = kind;
}

/* Publish this rank's per-rank sizes (elements) and, after ARRIVE, check that every rank posted the
 * same ones: exact counts, not a checksum. On a difference both vectors are kept for the message. */
static void post_sizes(zb_chan *c, const int64_t *counts) {
    memcpy(c->vec[c->me], counts, (size_t)c->W * sizeof(int64_t));
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
                   int op, double divisor, int nt, int64_t chunk);

static int allreduce(zb_chan *c, int64_t seq, int64_t *mine, char *dst, int64_t count, int64_t itemsize) {
    int64_t chunk = mine[H_AUX];
    int64_t nbytes = count * itemsize;
    static const int fields[] = {H_OP, H_DTYPE, H_REDOP, H_IN_NUMEL, H_ALGO, H_AUX};
    if (mine[H_ALGO] == ALGO_ONESHOT && ensure_scratch(c, nbytes)) {
        /* before ARRIVE, so the group fails together with the reason instead of hanging on DONE */
        char text[160];
        snprintf(text, sizeof(text), "all_reduce: cannot allocate %lld bytes of scratch memory for the oneshot "
                 "algorithm", (long long)nbytes);
        post_error(c, mine, ERR_NOMEM, text);
    }
    int rc = begin_op(c, seq, mine, fields, 6);
    if (rc) return rc;
    const void *srcs[ZB_MAXW];
    for (int r = 0; r < c->W; r++) {
        if (!in_heap(c, r, c->hdrcopy[r][H_IN_OFF], nbytes)) return fail_op(c, seq, RC_SPAN);
        srcs[r] = c->base[r] + c->hdrcopy[r][H_IN_OFF];
    }
    int dt = (int)mine[H_DTYPE], op = (int)mine[H_REDOP];
    double divisor = (double)c->W;
    int nt = nthreads_for(c, nbytes);
    if (mine[H_ALGO] == ALGO_ONESHOT) {
        zb_reduce_n(c->scratch, srcs, c->W, count, dt, op, divisor, nt);
        rc = sync_on(c, c->done, seq);
        if (rc) return rc;
        zb_copy(dst, c->scratch, nbytes, nt);
        return RC_OK;
    }
    return twoshot(c, seq, srcs, dst, count, itemsize, dt, op, divisor, nt, chunk);
}

/* Slice r of [lo, hi): 64-byte aligned, as zbccl/ops/plan.py slices(). */
static void slice_of(int64_t lo, int64_t hi, int64_t W, int64_t r, int64_t itemsize, int64_t *a, int64_t *b) {
    int64_t align = 64 / itemsize > 0 ? 64 / itemsize : 1;
    int64_t step = (hi - lo + W - 1) / W;
    step = (step + align - 1) / align * align;
    *a = min64(hi, lo + r * step);
    *b = min64(hi, lo + (r + 1) * step);
}

/* twoshot, pipelined over chunks of `chunk` elements. For chunk k, rank r reduces
 * slice r of the chunk from every input into its own tensor and signals
 * PHASE = phase_base + k+1 (channel.py: the base every rank agreed on in the handshake); then it gathers the peers' slices of chunk k-1 (each
 * peer signalled it, so those slices are final and nobody reads this rank's
 * copy of them any more). Gathering one chunk behind keeps the peer's freshly
 * reduced lines in cache and overlaps the two phases. */
static int twoshot(zb_chan *c, int64_t seq, const void **srcs, char *dst, int64_t count, int64_t itemsize, int dt,
                   int op, double divisor, int nt, int64_t chunk) {
    if (chunk <= 0) chunk = count;
    int64_t nchunks = (count + chunk - 1) / chunk;
    for (int64_t k = 0; k <= nchunks; k++) {
        if (k < nchunks) {
            int64_t a, b;
            slice_of(k * chunk, min64(count, (k + 1) * chunk), c->W, c->me, itemsize, &a, &b);
            if (b > a) {
                const void *part[ZB_MAXW];
                for (int r = 0; r < c->W; r++) part[r] = (const char *)srcs[r] + a * itemsize;
                int64_t n = (b - a) * itemsize;
                if (n >= c->stream_bytes && ensure_scratch(c, n) == 0) {
                    /* the peer read these lines in the previous op's gather: reduce in cache, stream out */
                    zb_reduce_n(c->scratch, part, c->W, b - a, dt, op, divisor, nt);
                    zb_copy_stream(dst + a * itemsize, c->scratch, n, nt);
                } else {
                    zb_reduce_n(dst + a * itemsize, part, c->W, b - a, dt, op, divisor, nt);
                }
            }
            signal_flag(c->phase[c->me], c->phase_base + k + 1);
        }
        if (k >= 1) {
            int rc = wait_all(c, c->phase, c->phase_base + k);
            if (rc) return rc;
            for (int i = 1; i < c->W; i++) {
                int64_t q = (c->me + i) % c->W, a, b;
                slice_of((k - 1) * chunk, min64(count, k * chunk), c->W, q, itemsize, &a, &b);
                int64_t n = (b - a) * itemsize;
                if (n >= c->stream_bytes) /* lines peer q just read: stream, no read-for-ownership */
                    zb_copy_stream(dst + a * itemsize, (const char *)srcs[q] + a * itemsize, n, nt);
                else if (n > 0)
                    zb_copy(dst + a * itemsize, (const char *)srcs[q] + a * itemsize, n, nt);
            }
        }
    }
    return sync_on(c, c->done, seq);
}


/* ------------------------------------------------------------ all_gather (even and v) */

/* counts[r]: elements from rank r; output displacement of r = sum(counts[:r]). */
static int allgather(zb_chan *c, int64_t seq, const int64_t *mine, char *in, char *out, const int64_t *counts,
                     int64_t isz) {
    static const int fields[] = {H_OP, H_DTYPE, H_ROW, H_OUT_NUMEL};
    post_sizes(c, counts);
    int rc = begin_op(c, seq, mine, fields, 4);
    if (!rc) rc = check_sizes(c, seq);
    if (rc) return rc;
    int all_in = 1, all_out = 1;
    for (int r = 0; r < c->W; r++) {
        all_in &= c->hdrcopy[r][H_IN_OFF] >= 0;
        all_out &= c->hdrcopy[r][H_OUT_OFF] >= 0;
    }
    int push = all_out && (!all_in || mine[H_ALGO] == ALGO_PUSH);
    if (!all_in && !push) return RC_FALLBACK;
    int64_t disp[ZB_MAXW + 1], total = 0;
    for (int r = 0; r < c->W; r++) disp[r] = total, total += counts[r];
    int nt = nthreads_for(c, total * isz);
    for (int k = 1; k < c->W; k++) {
        int q = (int)((c->me + k) % c->W);
        if (push) {
            int64_t off = c->hdrcopy[q][H_OUT_OFF];
            if (!in_heap(c, q, off, total * isz)) return fail_op(c, seq, RC_SPAN);
            zb_copy(c->base[q] + off + disp[c->me] * isz, in, counts[c->me] * isz, nt);
        } else {
            int64_t off = c->hdrcopy[q][H_IN_OFF];
            if (!in_heap(c, q, off, counts[q] * isz)) return fail_op(c, seq, RC_SPAN);
            zb_copy(out + disp[q] * isz, c->base[q] + off, counts[q] * isz, nt);
        }
    }
    char *mine_dst = out + disp[c->me] * isz;
    if (mine_dst != in) zb_copy(mine_dst, in, counts[c->me] * isz, nt);
    return sync_on(c, c->done, seq);
}

/* ------------------------------------------------------------ all_to_all */

/* Every rank's size vector is [in counts (W) | out counts (W)], in elements. */
static int alltoall(zb_chan *c, int64_t seq, const int64_t *mine, char *in, char *out, int64_t isz) {
    static const int fields[] = {H_OP, H_DTYPE, H_ROW};
    int rc = begin_op(c, seq, mine, fields, 3);
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
    int all_in = 1, all_out = 1;
    for (int r = 0; r < W; r++) {
        all_in &= c->hdrcopy[r][H_IN_OFF] >= 0;
        all_out &= c->hdrcopy[r][H_OUT_OFF] >= 0;
    }
    int push = all_out && (!all_in || mine[H_ALGO] == ALGO_PUSH);
    if (!all_in && !push) return RC_FALLBACK;
    rc = RC_OK;
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
        if (n) zb_copy(dst, src, n, nthreads_for(c, n));
    }
    return rc ? fail_op(c, seq, rc) : sync_on(c, c->done, seq);
}

/* ------------------------------------------------------------ reduce_scatter */

static int reducescatter(zb_chan *c, int64_t seq, const int64_t *mine, char *out, const int64_t *counts,
                         int64_t isz) {
    static const int fields[] = {H_OP, H_DTYPE, H_REDOP, H_IN_NUMEL, H_ROW, H_ALGO};
    post_sizes(c, counts);
    int rc = begin_op(c, seq, mine, fields, 6);
    if (!rc) rc = check_sizes(c, seq);
    if (rc) return rc;
    int64_t lo = 0;
    for (int r = 0; r < c->me; r++) lo += counts[r];
    const void *srcs[ZB_MAXW];
    for (int r = 0; r < c->W; r++) {
        int64_t off = c->hdrcopy[r][H_IN_OFF];
        if (!in_heap(c, r, off, mine[H_IN_NUMEL] * isz)) return fail_op(c, seq, RC_SPAN);
        srcs[r] = c->base[r] + off + lo * isz;
    }
    int64_t n = counts[c->me];
    if (n) zb_reduce_n(out, srcs, c->W, n, (int)mine[H_DTYPE], (int)mine[H_REDOP], (double)c->W,
                       nthreads_for(c, n * isz));
    return sync_on(c, c->done, seq);
}

/* ------------------------------------------------------------ broadcast */

static int bcast(zb_chan *c, int64_t seq, const int64_t *mine, char *dst, int64_t isz) {
    static const int fields[] = {H_OP, H_DTYPE, H_IN_NUMEL, H_ROOT, H_ALGO};
    int rc = begin_op(c, seq, mine, fields, 5);
    if (rc) return rc;
    int root = (int)mine[H_ROOT];
    int64_t nbytes = mine[H_IN_NUMEL] * isz;
    if (root != c->me && nbytes) {
        int64_t off = c->hdrcopy[root][H_IN_OFF];
        if (!in_heap(c, root, off, nbytes)) return fail_op(c, seq, RC_SPAN);
        zb_copy(dst, c->base[root] + off, nbytes, nthreads_for(c, nbytes));
    }
    return sync_on(c, c->done, seq);
}

/* ------------------------------------------------------------ Python glue */

enum { K_ALL_REDUCE, K_ALL_GATHER, K_ALL_TO_ALL, K_REDUCE_SCATTER, K_BROADCAST };

typedef struct {
    int kind;
    int64_t seq, isz;
    int64_t mine[HDR_FIELDS];
    char *in, *out;
    const int64_t *counts;
} op_call;

static int dispatch(zb_chan *c, op_call *o) {
    switch (o->kind) {
    case K_ALL_REDUCE: return allreduce(c, o->seq, o->mine, o->out, o->mine[H_IN_NUMEL], o->isz);
    case K_ALL_GATHER: return allgather(c, o->seq, o->mine, o->in, o->out, o->counts, o->isz);
    case K_ALL_TO_ALL: return alltoall(c, o->seq, o->mine, o->in, o->out, o->isz);
    case K_REDUCE_SCATTER: return reducescatter(c, o->seq, o->mine, o->out, o->counts, o->isz);
    default: return bcast(c, o->seq, o->mine, o->out, o->isz);
    }
}

/* Small ops keep the GIL while they spin (a long wait releases it); large ones drop it at once. */
static PyObject *run(zb_chan *c, op_call *o, int64_t nbytes) {
    c->result[0] = c->result[1] = c->result[2] = 0;
    c->gil_held = 1;
    if (nbytes >= (1 << 16)) gil_release(c);
    int rc = dispatch(c, o);
    if (!c->gil_held) PyEval_RestoreThread(c->saved);
    c->gil_held = 0;
    c->result[0] = rc;
    if (rc == RC_INTERRUPTED) {
        /* This rank leaves the op half-way and its sequence number has advanced: tell the peers now
         * (they read ABORT at each liveness check) instead of letting them wait out the timeout. */
        c->abort[c->me][2] = ABORT_INTERRUPT;
        signal_flag(c->abort[c->me], o->seq);
        return NULL; /* the signal handler's exception (KeyboardInterrupt) is set */
    }
    return PyLong_FromLong(rc);
}

static int parse(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, int64_t *a, const char *fn) {
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments, got %zd", fn, want, nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nargs; i++)
        if (zb_i64(args[i], &a[i])) return -1;
    return 0;
}

/* chan_all_reduce(handle, seq, dst, offset, count, itemsize, dtype, op, algo, chunk) -> rc */
static PyObject *py_all_reduce(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    int64_t a[10];
    if (parse(args, nargs, 10, a, "chan_all_reduce")) return NULL;
    if (!zb_reduce_valid((int)a[6], (int)a[7])) return PyErr_Format(PyExc_ValueError, "chan_all_reduce: bad dtype/op");
    op_call o = {K_ALL_REDUCE, a[1], a[5], {0}, NULL, (char *)(uintptr_t)a[2], NULL};
    int64_t *m = o.mine;
    m[H_OP] = OP_ALL_REDUCE, m[H_DTYPE] = a[6], m[H_REDOP] = a[7], m[H_IN_NUMEL] = m[H_OUT_NUMEL] = a[4];
    m[H_IN_OFF] = a[3], m[H_OUT_OFF] = -1, m[H_ALGO] = a[8], m[H_AUX] = a[9];
    return run((zb_chan *)(uintptr_t)a[0], &o, a[4] * a[5]);
}

/* chan_all_gather(handle, seq, in, in_off, out, out_off, counts_ptr, in_numel, out_numel, row, digest,
 *                 itemsize, dtype, algo) -> rc */
static PyObject *py_all_gather(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    int64_t a[14];
    if (parse(args, nargs, 14, a, "chan_all_gather")) return NULL;
    op_call o = {K_ALL_GATHER, a[1], a[11], {0}, (char *)(uintptr_t)a[2], (char *)(uintptr_t)a[4],
                 (const int64_t *)(uintptr_t)a[6]};
    int64_t *m = o.mine;
    m[H_OP] = OP_ALL_GATHER, m[H_DTYPE] = a[12], m[H_IN_NUMEL] = a[7], m[H_OUT_NUMEL] = a[8];
    m[H_IN_OFF] = a[3], m[H_OUT_OFF] = a[5], m[H_ALGO] = a[13], m[H_ROW] = a[9], m[H_DIGEST] = a[10];
    return run((zb_chan *)(uintptr_t)a[0], &o, a[8] * a[11]);
}

/* chan_all_to_all(handle, seq, in, in_off, out, out_off, in_numel, out_numel, row, digest, itemsize, dtype,
 *                 algo) -> rc; this rank's size vector must already be in its vector area. */
static PyObject *py_all_to_all(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    int64_t a[13];
    if (parse(args, nargs, 13, a, "chan_all_to_all")) return NULL;
    op_call o = {K_ALL_TO_ALL, a[1], a[10], {0}, (char *)(uintptr_t)a[2], (char *)(uintptr_t)a[4], NULL};
    int64_t *m = o.mine;
    m[H_OP] = OP_ALL_TO_ALL, m[H_DTYPE] = a[11], m[H_IN_NUMEL] = a[6], m[H_OUT_NUMEL] = a[7];
    m[H_IN_OFF] = a[3], m[H_OUT_OFF] = a[5], m[H_ALGO] = a[12], m[H_ROW] = a[8], m[H_DIGEST] = a[9];
    return run((zb_chan *)(uintptr_t)a[0], &o, (a[6] > a[7] ? a[6] : a[7]) * a[10]);
}

/* chan_reduce_scatter(handle, seq, in_off, out, counts_ptr, in_numel, out_numel, row, digest, itemsize, dtype,
 *                     op, algo) -> rc */
static PyObject *py_reduce_scatter(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    int64_t a[13];
    if (parse(args, nargs, 13, a, "chan_reduce_scatter")) return NULL;
    if (!zb_reduce_valid((int)a[10], (int)a[11]))
        return PyErr_Format(PyExc_ValueError, "chan_reduce_scatter: bad dtype/op");
    op_call o = {K_REDUCE_SCATTER, a[1], a[9], {0}, NULL, (char *)(uintptr_t)a[3], (const int64_t *)(uintptr_t)a[4]};
    int64_t *m = o.mine;
    m[H_OP] = OP_REDUCE_SCATTER, m[H_DTYPE] = a[10], m[H_REDOP] = a[11], m[H_IN_NUMEL] = a[5];
    m[H_OUT_NUMEL] = a[6], m[H_IN_OFF] = a[2], m[H_OUT_OFF] = -1, m[H_ALGO] = a[12], m[H_ROW] = a[7];
    m[H_DIGEST] = a[8];
    return run((zb_chan *)(uintptr_t)a[0], &o, a[5] * a[9]);
}

/* chan_broadcast(handle, seq, dst, offset, count, itemsize, dtype, root, algo) -> rc
 * offset: this rank's heap offset of the tensor (root), or -1. */
static PyObject *py_broadcast(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    int64_t a[9];
    if (parse(args, nargs, 9, a, "chan_broadcast")) return NULL;
    op_call o = {K_BROADCAST, a[1], a[5], {0}, NULL, (char *)(uintptr_t)a[2], NULL};
    int64_t *m = o.mine;
    m[H_OP] = OP_BROADCAST, m[H_DTYPE] = a[6], m[H_IN_NUMEL] = m[H_OUT_NUMEL] = a[4], m[H_IN_OFF] = a[3];
    m[H_OUT_OFF] = -1, m[H_ROOT] = a[7], m[H_ALGO] = a[8];
    return run((zb_chan *)(uintptr_t)a[0], &o, a[4] * a[5]);
}

#define FC(name, fn, doc) {name, (PyCFunction)(void (*)(void))fn, METH_FASTCALL, doc}
static PyMethodDef op_methods[] = {
    FC("chan_all_reduce", py_all_reduce,
       "chan_all_reduce(handle, seq, dst, offset, count, itemsize, dtype, op, algo, chunk) -> rc"),
    FC("chan_all_gather", py_all_gather,
       "chan_all_gather(handle, seq, in, in_off, out, out_off, counts_ptr, in_numel, out_numel, row, digest, "
       "itemsize, dtype, algo) -> rc"),
    FC("chan_all_to_all", py_all_to_all,
       "chan_all_to_all(handle, seq, in, in_off, out, out_off, in_numel, out_numel, row, digest, itemsize, "
       "dtype, algo) -> rc"),
    FC("chan_reduce_scatter", py_reduce_scatter,
       "chan_reduce_scatter(handle, seq, in_off, out, counts_ptr, in_numel, out_numel, row, digest, itemsize, "
       "dtype, op, algo) -> rc"),
    FC("chan_broadcast", py_broadcast,
       "chan_broadcast(handle, seq, dst, offset, count, itemsize, dtype, root, algo) -> rc"),
    {NULL, NULL, 0, NULL},
};

int zb_add_chan_ops(PyObject *module) { return PyModule_AddFunctions(module, op_methods); }
