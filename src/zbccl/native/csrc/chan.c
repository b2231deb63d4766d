/* zbccl native op channel: the whole all_reduce in one call.
 *
 * This is the small-message fast path of zbccl/ops/allreduce.py. It runs the
 * very protocol of zbccl/ops/channel.py (same header layout, same flags, same
 * checks), so a rank on this path and a rank on the Python path interoperate:
 *
 *   post header (16 int64) -> ARRIVE=seq -> wait every peer's ARRIVE >= seq
 *   -> check all headers agree -> move bytes (oneshot or twoshot)
 *   -> [PHASE] -> DONE=seq -> wait every peer's DONE >= seq
 *
 * Python decides the algorithm and owns every policy; this file only moves
 * bytes and waits. Waits spin `spin` polls, then yield, then sleep on the
 * futex (the flag layout of core.c: value at +0, waiter count at +8), and
 * every `liveness_ns` they poll the peers' liveness sockets and read the
 * peers' header STATE: a dead or departed peer ends the wait at once with
 * its rank. Errors are returned as codes; detail (rank, field) and a copy of
 * all headers taken before the DONE handshake stay in the channel for Python
 * to format the message.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <limits.h>
#include <linux/futex.h>
#include <poll.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "reduce.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield" ::: "memory")
#else
#define cpu_relax() __asm__ __volatile__("" ::: "memory")
#endif

#define ZB_MAXW 256
#define HDR_FIELDS 16
/* header fields (zbccl/ops/channel.py Header) */
enum { H_SEQ, H_OP, H_DTYPE, H_REDOP, H_IN_NUMEL, H_OUT_NUMEL, H_IN_OFF, H_OUT_OFF, H_ALGO, H_ROOT, H_ROW,
       H_DIGEST, H_ERROR, H_AUX };
/* result codes, mirrored in zbccl/ops/fastpath.py */
enum { RC_OK = 0, RC_TIMEOUT = 1, RC_DEAD = 2, RC_GONE = 3, RC_MISMATCH = 4, RC_STEP = 5, RC_SPAN = 6,
       RC_PEER_ERROR = 7 };
#define STATE_FINALIZED 2
#define STATE_FAILED 3
#define ALGO_ONESHOT 1
#define OP_ALL_REDUCE 1

typedef struct {
    int64_t W, me, spin, liveness_ns, timeout_ns, nthreads;
    int64_t *arrive[ZB_MAXW], *phase[ZB_MAXW], *done[ZB_MAXW], *hdr[ZB_MAXW], *state[ZB_MAXW];
    char *base[ZB_MAXW];
    int64_t size[ZB_MAXW];
    int fd[ZB_MAXW];
    int64_t result[4];            /* code, rank, field, 0 */
    int64_t hdrcopy[ZB_MAXW][HDR_FIELDS];
    char *scratch;
    int64_t scratch_bytes;
    int gil_held;           /* 1 while the calling thread still holds the GIL */
    PyThreadState *saved;   /* its thread state once a long wait released the GIL */
} zb_chan;

/* A wait that outlasts the spin and yield phases lets other Python threads run. */
static void gil_release(zb_chan *c) {
    if (c->gil_held) {
        c->saved = PyEval_SaveThread();
        c->gil_held = 0;
    }
}

static inline uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static inline int64_t ld(int64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }

static void signal_flag(int64_t *p, int64_t v) {
    __atomic_store_n(p, v, __ATOMIC_SEQ_CST);
    int32_t *waiters = (int32_t *)((char *)p + 8);
    if (__atomic_load_n(waiters, __ATOMIC_SEQ_CST) > 0)
        syscall(SYS_futex, (uint32_t *)p, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

static void sleep_on(int64_t *p, int64_t target, int64_t ns) {
    int32_t *waiters = (int32_t *)((char *)p + 8);
    __atomic_fetch_add(waiters, 1, __ATOMIC_SEQ_CST);
    int64_t v = __atomic_load_n(p, __ATOMIC_SEQ_CST);
    if (v < target) {
        struct timespec ts = {(time_t)(ns / 1000000000LL), (long)(ns % 1000000000LL)};
        syscall(SYS_futex, (uint32_t *)p, FUTEX_WAIT, (uint32_t)(uint64_t)v, &ts, NULL, 0);
    }
    __atomic_fetch_sub(waiters, 1, __ATOMIC_SEQ_CST);
}

/* 0 if every peer we still wait for is alive, else RC_DEAD / RC_GONE with c->result[1] = rank.
 * Peers whose flag already reached the target are not examined: they may exit at will. */
static int check_peers(zb_chan *c, int64_t **flags, int64_t target) {
    struct pollfd pf[ZB_MAXW];
    int idx[ZB_MAXW], n = 0;
    for (int r = 0; r < c->W; r++) {
        if (r == c->me || ld(flags[r]) >= target) continue;
        int64_t st = ld(c->state[r]);
        if (st == STATE_FINALIZED || st == STATE_FAILED) {
            c->result[1] = r;
            return RC_GONE;
        }
        if (c->fd[r] >= 0) {
            pf[n].fd = c->fd[r];
            pf[n].events = POLLIN | POLLRDHUP;
            pf[n].revents = 0;
            idx[n++] = r;
        }
    }
    if (n && poll(pf, (nfds_t)n, 0) > 0)
        for (int i = 0; i < n; i++)
            if (pf[i].revents) {
                c->result[1] = idx[i];
                return RC_DEAD;
            }
    return 0;
}

/* Wait until flags[r] >= target for every peer r. */
static int wait_all(zb_chan *c, int64_t **flags, int64_t target) {
    int r = 0;
    for (int64_t s = 0; s <= c->spin; s++) {
        while (r < c->W && (r == c->me || ld(flags[r]) >= target)) r++;
        if (r == c->W) return RC_OK;
        cpu_relax();
    }
    uint64_t start = now_ns(), t = start, next_check = start + (uint64_t)c->liveness_ns;
    uint64_t deadline = start + (uint64_t)c->timeout_ns;
    int64_t sleep_ns = 20000;
    while (1) {
        while (r < c->W && (r == c->me || ld(flags[r]) >= target)) r++;
        if (r == c->W) return RC_OK;
        if (t >= next_check) {
            int rc = check_peers(c, flags, target);
            if (rc) return rc;
            next_check = t + (uint64_t)c->liveness_ns;
        }
        if (t >= deadline) {
            c->result[1] = r;
            return RC_TIMEOUT;
        }
        if (t - start < 50000) {
            sched_yield();
        } else {
            gil_release(c);
            sleep_on(flags[r], target, sleep_ns);
            sleep_ns = sleep_ns * 2 > 1000000 ? 1000000 : sleep_ns * 2;
        }
        t = now_ns();
    }
}

static int sync_on(zb_chan *c, int64_t **flags, int64_t seq) {
    signal_flag(flags[c->me], seq);
    return wait_all(c, flags, seq);
}

/* After ARRIVE: copy headers, check sequence numbers and agreement on `fields`. */
static int check_headers(zb_chan *c, int64_t seq, const int *fields, int nfields) {
    for (int r = 0; r < c->W; r++) memcpy(c->hdrcopy[r], c->hdr[r], sizeof(c->hdrcopy[r]));
    for (int r = 0; r < c->W; r++)
        if (c->hdrcopy[r][H_SEQ] != seq) { c->result[1] = r; return RC_STEP; }
    for (int r = 0; r < c->W; r++)
        if (c->hdrcopy[r][H_ERROR]) { c->result[1] = r; return RC_PEER_ERROR; }
    for (int f = 0; f < nfields; f++)
        for (int r = 1; r < c->W; r++)
            if (c->hdrcopy[r][fields[f]] != c->hdrcopy[0][fields[f]]) {
                c->result[1] = r;
                c->result[2] = fields[f];
                return RC_MISMATCH;
            }
    return RC_OK;
}

static int ensure_scratch(zb_chan *c, int64_t nbytes) {
    if (c->scratch_bytes >= nbytes) return 0;
    free(c->scratch);
    c->scratch = aligned_alloc(64, (size_t)((nbytes + 63) / 64 * 64));
    c->scratch_bytes = c->scratch ? nbytes : 0;
    return c->scratch ? 0 : -1;
}

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

static int twoshot(zb_chan *c, int64_t seq, const void **srcs, char *dst, int64_t count, int64_t itemsize, int dt,
                   int op, double divisor, int nt, int64_t chunk);

static int allreduce(zb_chan *c, int64_t seq, const int64_t *mine, char *dst, int64_t count, int64_t itemsize) {
    int64_t chunk = mine[H_AUX];
    int64_t nbytes = count * itemsize;
    memcpy(c->hdr[c->me] + 1, mine + 1, (HDR_FIELDS - 1) * sizeof(int64_t));
    __atomic_store_n(c->hdr[c->me], seq, __ATOMIC_RELAXED);
    int rc = sync_on(c, c->arrive, seq);
    if (rc) return rc;
    static const int fields[] = {H_OP, H_DTYPE, H_REDOP, H_IN_NUMEL, H_ALGO, H_AUX};
    rc = check_headers(c, seq, fields, 6);
    const void *srcs[ZB_MAXW];
    for (int r = 0; !rc && r < c->W; r++) {
        int64_t off = c->hdrcopy[r][H_IN_OFF];
        if (off < 0 || off + nbytes > c->size[r]) { c->result[1] = r; rc = RC_SPAN; }
        srcs[r] = c->base[r] + off;
    }
    if (rc) {
        c->result[0] = rc;
        int rc2 = sync_on(c, c->done, seq);
        return rc2 ? rc2 : rc;
    }
    int dt = (int)mine[H_DTYPE], op = (int)mine[H_REDOP];
    double divisor = (double)c->W;
    int nt = nbytes >= (1 << 20) ? (int)c->nthreads : 1;
    if (mine[H_ALGO] == ALGO_ONESHOT) {
        if (ensure_scratch(c, nbytes)) return RC_SPAN;
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
 * PHASE = seq<<24 | k+1; then it gathers the peers' slices of chunk k-1 (each
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
                zb_reduce_n(dst + a * itemsize, part, c->W, b - a, dt, op, divisor, nt);
            }
            signal_flag(c->phase[c->me], (seq << 24) | (k + 1));
        }
        if (k >= 1) {
            int rc = wait_all(c, c->phase, (seq << 24) | k);
            if (rc) return rc;
            for (int i = 1; i < c->W; i++) {
                int64_t q = (c->me + i) % c->W, a, b;
                slice_of((k - 1) * chunk, min64(count, k * chunk), c->W, q, itemsize, &a, &b);
                if (b > a) zb_copy(dst + a * itemsize, (const char *)srcs[q] + a * itemsize, (b - a) * itemsize, nt);
            }
        }
    }
    return sync_on(c, c->done, seq);
}

/* ------------------------------------------------------------ Python glue */

static int i64(PyObject *o, int64_t *out) {
    long long v = PyLong_AsLongLong(o);
    if (v == -1 && PyErr_Occurred()) return -1;
    *out = v;
    return 0;
}

/* chan_new(W, me, spin, liveness_ns, timeout_ns, nthreads, table_ptr) -> handle.
 * table: int64[W][8] = arrive, phase, done, header, state addresses, heap base, heap size, fd. */
static PyObject *py_chan_new(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    int64_t a[7];
    if (nargs != 7) return PyErr_Format(PyExc_TypeError, "chan_new() takes 7 arguments, got %zd", nargs);
    for (int i = 0; i < 7; i++)
        if (i64(args[i], &a[i])) return NULL;
    if (a[0] < 1 || a[0] > ZB_MAXW || a[1] < 0 || a[1] >= a[0])
        return PyErr_Format(PyExc_ValueError, "chan_new: world size must be in [1, %d]", ZB_MAXW);
    zb_chan *c = calloc(1, sizeof(zb_chan));
    if (!c) return PyErr_NoMemory();
    c->W = a[0], c->me = a[1], c->spin = a[2], c->liveness_ns = a[3], c->timeout_ns = a[4], c->nthreads = a[5];
    const int64_t *t = (const int64_t *)(uintptr_t)a[6];
    for (int r = 0; r < c->W; r++, t += 8) {
        c->arrive[r] = (int64_t *)(uintptr_t)t[0], c->phase[r] = (int64_t *)(uintptr_t)t[1];
        c->done[r] = (int64_t *)(uintptr_t)t[2], c->hdr[r] = (int64_t *)(uintptr_t)t[3];
        c->state[r] = (int64_t *)(uintptr_t)t[4], c->base[r] = (char *)(uintptr_t)t[5];
        c->size[r] = t[6], c->fd[r] = (int)t[7];
    }
    return PyLong_FromVoidPtr(c);
}

static PyObject *py_chan_free(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 1) return PyErr_Format(PyExc_TypeError, "chan_free() takes 1 argument");
    zb_chan *c = PyLong_AsVoidPtr(args[0]);
    if (c) { free(c->scratch); free(c); }
    Py_RETURN_NONE;
}

/* chan_all_reduce(handle, seq, dst, offset, count, itemsize, dtype, op, algo, chunk) -> rc
 * Posts the header {seq, ALL_REDUCE, dtype, op, count, count, offset, -1, algo, ..., AUX=chunk}. */
static PyObject *py_chan_all_reduce(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    int64_t a[10];
    if (nargs != 10) return PyErr_Format(PyExc_TypeError, "chan_all_reduce() takes 10 arguments, got %zd", nargs);
    for (int i = 0; i < 10; i++)
        if (i64(args[i], &a[i])) return NULL;
    zb_chan *c = (zb_chan *)(uintptr_t)a[0];
    if (!zb_reduce_valid((int)a[6], (int)a[7]))
        return PyErr_Format(PyExc_ValueError, "chan_all_reduce: unsupported dtype/op");
    int64_t mine[HDR_FIELDS] = {0};
    mine[H_OP] = OP_ALL_REDUCE, mine[H_DTYPE] = a[6], mine[H_REDOP] = a[7], mine[H_IN_NUMEL] = a[4];
    mine[H_OUT_NUMEL] = a[4], mine[H_IN_OFF] = a[3], mine[H_OUT_OFF] = -1, mine[H_ALGO] = a[8];
    mine[H_AUX] = a[9];
    int rc;
    c->result[0] = c->result[1] = c->result[2] = 0;
    if (a[4] * a[5] < (1 << 16)) {
        c->gil_held = 1;
        rc = allreduce(c, a[1], mine, (char *)(uintptr_t)a[2], a[4], a[5]);
        if (!c->gil_held) PyEval_RestoreThread(c->saved);
        c->gil_held = 0;
    } else {
        Py_BEGIN_ALLOW_THREADS
        rc = allreduce(c, a[1], mine, (char *)(uintptr_t)a[2], a[4], a[5]);
        Py_END_ALLOW_THREADS
    }
    c->result[0] = rc;
    return PyLong_FromLong(rc);
}

/* chan_result(handle) -> (code, rank, field); chan_headers(handle) -> address of int64[W][16] copies */
static PyObject *py_chan_result(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 1) return PyErr_Format(PyExc_TypeError, "chan_result() takes 1 argument");
    zb_chan *c = PyLong_AsVoidPtr(args[0]);
    return Py_BuildValue("(LLLL)", (long long)c->result[0], (long long)c->result[1], (long long)c->result[2],
                         (long long)(intptr_t)c->hdrcopy);
}

static PyMethodDef chan_methods[] = {
    {"chan_new", (PyCFunction)(void (*)(void))py_chan_new, METH_FASTCALL,
     "chan_new(W, me, spin, liveness_ns, timeout_ns, nthreads, table_ptr) -> handle of a native op channel."},
    {"chan_free", (PyCFunction)(void (*)(void))py_chan_free, METH_FASTCALL, "chan_free(handle)."},
    {"chan_all_reduce", (PyCFunction)(void (*)(void))py_chan_all_reduce, METH_FASTCALL,
     "chan_all_reduce(handle, seq, dst, offset, count, itemsize, dtype, op, algo, chunk) -> result code (0: ok). "
     "chunk: elements per pipelined twoshot chunk (0: one chunk)."},
    {"chan_result", (PyCFunction)(void (*)(void))py_chan_result, METH_FASTCALL,
     "chan_result(handle) -> (code, rank, field, headers_ptr) of the last op."},
    {NULL, NULL, 0, NULL},
};

int zb_add_chan_methods(PyObject *module) { return PyModule_AddFunctions(module, chan_methods); }
