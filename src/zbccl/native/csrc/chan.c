/* zbccl native op channel: waits and the handshake shared by the native ops (chan_ops.c).
 *
 * The native ops are the only protocol of zbccl/ops/ at world size >= 2: each
 * runs a whole collective in one call (chan_run, one zb_op argument struct
 * whose layout and every constant come from zbccl/native/abi.py):
 *
 *   post header (16 int64) -> ARRIVE=seq -> wait every peer's ARRIVE >= seq
 *   -> check all headers agree -> move bytes (oneshot or twoshot)
 *   -> [PHASE] -> DONE=seq -> wait every peer's DONE >= seq
 *
 * Python validates, decides the algorithm, stages operands that are not in
 * the heap and owns every policy; this file only moves bytes and waits. Waits spin `spin` polls, then yield between polls for
 * `poll_ns` (at least 50 us; the GIL kept), then release the GIL and sleep on the futex (the flag layout of core.c: value at +0, waiter count at +8), and
 * every `liveness_ns` they apply the one liveness rule (zbccl/runtime/liveness.py;
 * check_peers below is its C twin): this rank finalized; any peer's ABORT line
 * set (its own, the world slot's, or this channel's: it left an op half-way, in
 * any protocol); a late peer failed, finalized or dead (pidfd). Each ends the
 * wait at once with the rank. An op
 * interrupted here marks this rank's own ABORT line before returning, so its
 * peers learn it within a liveness interval instead of the timeout. Errors are returned as codes; detail (rank, field) and a copy of
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

#include "arch.h"

#include "chan.h"

/* A wait that outlasts the spin and yield phases lets other Python threads run. */
void gil_release(zb_chan *c) {
    if (c->gil_held) {
        c->saved = PyEval_SaveThread();
        c->gil_held = 0;
    }
}

/* Let Python handle a pending signal (Ctrl-C) during a long wait; 1 if it raised. */
static int check_signals(zb_chan *c) {
    if (c->gil_held) return PyErr_CheckSignals() < 0;
    PyEval_RestoreThread(c->saved);
    int raised = PyErr_CheckSignals() < 0;
    c->saved = PyEval_SaveThread();
    return raised;
}

static inline uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static inline int64_t ld(int64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }

void signal_flag(int64_t *p, int64_t v) {
    __atomic_store_n(p, v, __ATOMIC_SEQ_CST);
    int32_t *waiters = (int32_t *)(p + W_WAITERS);
    if (__atomic_load_n(waiters, __ATOMIC_SEQ_CST) > 0)
        syscall(SYS_futex, (uint32_t *)p, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

static void sleep_on(int64_t *p, int64_t target, int64_t ns) {
    int32_t *waiters = (int32_t *)(p + W_WAITERS);
    __atomic_fetch_add(waiters, 1, __ATOMIC_SEQ_CST);
    int64_t v = __atomic_load_n(p, __ATOMIC_SEQ_CST);
    if (v < target) {
        struct timespec ts = {(time_t)(ns / 1000000000LL), (long)(ns % 1000000000LL)};
        syscall(SYS_futex, (uint32_t *)p, FUTEX_WAIT, (uint32_t)(uint64_t)v, &ts, NULL, 0);
    }
    __atomic_fetch_sub(waiters, 1, __ATOMIC_SEQ_CST);
}

/* The ABORT reason of rank r (its own line first, then this channel's), 0 if it left no op half-way. */
static int64_t abort_why(zb_chan *c, int r) {
    if (ld(c->rabort[r])) return c->rabort[r][W_WHY] ? c->rabort[r][W_WHY] : ABORT_EXCEPTION;
    if (ld(c->abort[r])) return c->abort[r][W_WHY] ? c->abort[r][W_WHY] : ABORT_EXCEPTION;
    return 0;
}

/* The liveness rule of zbccl/runtime/liveness.py `check`, in the same order:
 * 1. this rank finalized (another thread): RC_GONE with result[1] = our own rank;
 * 2. any peer (not only the late ones) left an op half-way by its own cause: RC_ABORTED with its rank;
 * 3. a peer we still wait for failed or finalized (RC_GONE) or died (RC_DEAD);
 * 4. any peer left an op because a peer did (ABORT_PEER): RC_ABORTED with its rank.
 * Peers whose flag already reached the target are not checked for death: they may exit at will. */
static int check_peers(zb_chan *c, int64_t **flags, int64_t target) {
    struct pollfd pf[ZB_MAXW];
    int idx[ZB_MAXW], n = 0, left = -1;
    /* finalize() on this rank (another thread) marks our own STATE first, then waits for us to leave. */
    if (ld(c->state[c->me]) == STATE_FINALIZED) {
        c->result[1] = c->me;
        return RC_GONE;
    }
    for (int r = 0; r < c->W; r++) {
        if (r == c->me) continue;
        int64_t why = abort_why(c, r);
        if (why && (left < 0 || why != ABORT_PEER)) left = r;
        if (why && why != ABORT_PEER) break;
    }
    if (left >= 0 && abort_why(c, left) != ABORT_PEER) {
        c->result[1] = left;
        return RC_ABORTED;
    }
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
    if (left >= 0) {
        c->result[1] = left;
        return RC_ABORTED;
    }
    return 0;
}

/* 1 (and result[1] = the rank) if a peer left an op half-way: ranks write into peers' tensors only
 * after this check, made after their own ARRIVE with a full fence between (see leave_op). */
int peer_left(zb_chan *c) {
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    for (int r = 0; r < c->W; r++)
        if (r != c->me && ld(c->abort[r])) {
            c->result[1] = r;
            return 1;
        }
    return 0;
}

/* Whether peer r may still work on op `seq`: it arrived, has not signalled DONE, has not left (ABORT),
 * is not finalized or failed, and is alive. */
static int peer_in_op(zb_chan *c, int r, int64_t seq) {
    if (ld(c->arrive[r]) < seq || ld(c->done[r]) >= seq || ld(c->abort[r])) return 0;
    int64_t st = ld(c->state[r]);
    if (st == STATE_FINALIZED || st == STATE_FAILED) return 0;
    if (c->fd[r] >= 0) {
        struct pollfd pf = {c->fd[r], POLLIN | POLLRDHUP, 0};
        if (poll(&pf, 1, 0) > 0 && pf.revents) return 0;
    }
    return 1;
}

/* This rank leaves op `seq` half-way (timeout, interrupt, a lost peer): it marks its ABORT line, then
 * waits until no peer can still write into its memory (twoshot all_reduce and the push exchanges write
 * into peers' tensors). Against a peer arriving at the same moment the two orders are fenced as in
 * Dekker's algorithm: we store ABORT, then load the peer's ARRIVE; the peer stores ARRIVE, then loads
 * our ABORT (peer_left) before it writes into us. So either it sees our ABORT and writes nothing, or we
 * see its ARRIVE and wait until it finished (DONE), left too (ABORT), was finalized or died, for at most
 * LEAVE_WAIT_NS; a peer still in the op after that is reported in result[3] (its rank + 1). */
#define LEAVE_WAIT_NS 10000000000LL
static void mark_abort(int64_t *line, int64_t seq, int why) {
    if (ld(line)) return; /* the first reason stays */
    line[W_WHY] = why, line[W_WHERE] = WHERE_COLLECTIVE;
    signal_flag(line, seq > 0 ? seq : 1); /* seq_cst: the words are visible with it */
}

void leave_op(zb_chan *c, int64_t seq, int why) {
    mark_abort(c->abort[c->me], seq, why);
    mark_abort(c->rabort[c->me], seq, why); /* this rank's own line: every wait of every peer reads it */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    uint64_t deadline = now_ns() + (uint64_t)(c->timeout_ns < LEAVE_WAIT_NS ? c->timeout_ns : LEAVE_WAIT_NS);
    for (int r = 0; r < c->W; r++) {
        int64_t sleep_ns = 20000;
        while (r != c->me && peer_in_op(c, r, seq)) {
            if (now_ns() > deadline) {
                c->result[3] = r + 1;
                break;
            }
            sleep_on(c->done[r], seq, sleep_ns);
            sleep_ns = sleep_ns * 2 > 1000000 ? 1000000 : sleep_ns * 2;
        }
    }
}

/* Wait until flags[r] >= target for every peer r. */
int wait_all(zb_chan *c, int64_t **flags, int64_t target) {
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
            if (check_signals(c)) return RC_INTERRUPTED;
            next_check = t + (uint64_t)c->liveness_ns;
        }
        if (t >= deadline) {
            c->result[1] = r;
            memset(c->late_mask, 0, sizeof(c->late_mask));
            for (int q = 0; q < c->W; q++)
                if (q != c->me && ld(flags[q]) < target) c->late_mask[q / 64] |= 1ull << (q % 64);
            return RC_TIMEOUT;
        }
        if (t - start < 50000) {
            sched_yield();
        } else if (t - start < (uint64_t)c->poll_ns) {
            /* a rank with its own core keeps polling, and keeps the GIL: another thread of the process that
             * took it (an engine's output thread) could delay this op's return by a switch interval (5 ms) */
            sched_yield();
        } else {
            gil_release(c);
            sleep_on(flags[r], target, sleep_ns);
            sleep_ns = sleep_ns * 2 > 1000000 ? 1000000 : sleep_ns * 2;
        }
        t = now_ns();
    }
}

int sync_on(zb_chan *c, int64_t **flags, int64_t seq) {
    signal_flag(flags[c->me], seq);
    return wait_all(c, flags, seq);
}

/* After ARRIVE: copy headers, check sequence numbers and agreement on `fields`. */
int check_headers(zb_chan *c, int64_t seq, const int *fields, int nfields) {
    for (int r = 0; r < c->W; r++) memcpy(c->hdrcopy[r], c->hdr[r], sizeof(c->hdrcopy[r]));
    c->phase_base = 0;
    for (int r = 0; r < c->W; r++)
        if (c->hdrcopy[r][H_PHASE_BASE] > c->phase_base) c->phase_base = c->hdrcopy[r][H_PHASE_BASE];
    for (int r = 0; r < c->W; r++)
        if (c->hdrcopy[r][H_SEQ] != seq) { c->result[1] = r; return RC_STEP; }
    for (int r = 0; r < c->W; r++)
        if (c->hdrcopy[r][H_ERROR]) {
            c->result[1] = r;
            c->result[2] = c->hdrcopy[r][H_ERROR];
            memcpy(c->veccopy[0], c->vec[r], sizeof(c->veccopy[0])); /* its error text */
            return c->hdrcopy[r][H_ERROR] == ERR_NOMEM ? RC_NOMEM : RC_PEER_ERROR;
        }
    for (int f = 0; f < nfields; f++)
        for (int r = 1; r < c->W; r++)
            if (c->hdrcopy[r][fields[f]] != c->hdrcopy[0][fields[f]]) {
                c->result[1] = r;
                c->result[2] = fields[f];
                return RC_MISMATCH;
            }
    return RC_OK;
}

void post_header(zb_chan *c, const zb_op *o) {
    /* zb_op leads with the header's fields (abi.py), so this rank's header is a copy of them */
    memcpy(c->hdr[c->me] + 1, &o->op, (HDR_FIELDS - 1) * sizeof(int64_t));
    c->hdr[c->me][H_PHASE_BASE] = ld(c->phase[c->me]);
    __atomic_store_n(c->hdr[c->me], o->seq, __ATOMIC_RELAXED);
}

int elect_claim(zb_chan *c, int64_t seq) {
    int64_t v = __atomic_load_n(c->elect, __ATOMIC_SEQ_CST);
    while (v < 2 * seq)
        if (__atomic_compare_exchange_n(c->elect, &v, 2 * seq, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) return 1;
    return 0;
}

void elect_release(zb_chan *c, int64_t seq, int rc) {
    c->elect[W_RC] = rc, c->elect[W_RANK] = c->result[1], c->elect[W_FIELD] = c->result[2];
    signal_flag(c->elect, 2 * seq + 1); /* seq_cst: the verdict is visible with it */
}

int begin_op(zb_chan *c, const zb_op *o, const int *fields, int nfields) {
    post_header(c, o);
    int rc = sync_on(c, c->arrive, o->seq);
    if (rc) return rc;
    rc = check_headers(c, o->seq, fields, nfields);
    if (!rc) return RC_OK;
    /* a peer running the oneshot all_reduce may wait on the election word instead of our DONE */
    if (elect_claim(c, o->seq)) elect_release(c, o->seq, rc);
    return fail_op(c, o->seq, rc);
}

int fail_op(zb_chan *c, int64_t seq, int rc) {
    c->result[0] = rc;
    int rc2 = sync_on(c, c->done, seq);
    return rc2 ? rc2 : rc;
}

/* ------------------------------------------------------------ Python glue */

int zb_i64(PyObject *o, int64_t *out) {
    long long v = PyLong_AsLongLong(o);
    if (v == -1 && PyErr_Occurred()) return -1;
    *out = v;
    return 0;
}

/* chan_new(W, me, spin, liveness_ns, timeout_ns, nthreads, table_ptr, poll_ns) -> handle.
 * table: int64[W][CR_COLUMNS], one row per group rank, columns CR_* (abi.CHAN_ROW: its flag lines' and
 * words' addresses, heap base, liveness fd; group rank 0's ELECT line is the group's election word;
 * RABORT the rank's own ABORT line, the world slot's). */
static PyObject *py_chan_new(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    int64_t a[8];
    if (nargs != 8) return PyErr_Format(PyExc_TypeError, "chan_new() takes 8 arguments, got %zd", nargs);
    for (int i = 0; i < 8; i++)
        if (zb_i64(args[i], &a[i])) return NULL;
    if (a[0] < 1 || a[0] > ZB_MAXW || a[1] < 0 || a[1] >= a[0])
        return PyErr_Format(PyExc_ValueError, "chan_new: world size must be in [1, %d]", ZB_MAXW);
    zb_chan *c = calloc(1, sizeof(zb_chan));
    if (!c) return PyErr_NoMemory();
    c->W = a[0], c->me = a[1], c->spin = a[2], c->liveness_ns = a[3], c->timeout_ns = a[4], c->nthreads = a[5];
    c->poll_ns = a[7];
    c->kind_mode = 0;
    const int64_t *t = (const int64_t *)(uintptr_t)a[6];
#define COL(k) ((int64_t *)(uintptr_t)t[CR_##k])
    for (int r = 0; r < c->W; r++, t += CR_COLUMNS) {
        c->arrive[r] = COL(ARRIVE), c->phase[r] = COL(PHASE), c->done[r] = COL(DONE), c->hdr[r] = COL(HEADER);
        c->state[r] = COL(STATE), c->base[r] = (char *)COL(BASE), c->size[r] = COL(SIZE), c->fd[r] = (int)t[CR_FD];
        c->vec[r] = COL(VEC), c->abort[r] = COL(ABORT), c->rabort[r] = COL(RABORT);
        if (r == 0) c->elect = COL(ELECT);
    }
#undef COL
    return PyLong_FromVoidPtr(c);
}

/* chan_configure(handle, kind_mode): the store-kind policy the Python layer sets (-1 auto, 0 cached,
 * 1 streaming). Forgets what auto learnt. */
static PyObject *py_chan_configure(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    int64_t a[2];
    if (nargs != 2) return PyErr_Format(PyExc_TypeError, "chan_configure() takes 2 arguments, got %zd", nargs);
    for (int i = 0; i < 2; i++)
        if (zb_i64(args[i], &a[i])) return NULL;
    if (a[1] < -1 || a[1] > 1)
        return PyErr_Format(PyExc_ValueError, "chan_configure: expected mode -1, 0 or 1, got %lld", (long long)a[1]);
    zb_chan *c = (zb_chan *)(uintptr_t)a[0];
    c->kind_mode = a[1];
    memset(c->kinds, 0, sizeof(c->kinds));
    Py_RETURN_NONE;
}

/* chan_kinds(handle) -> [(bucket, cached ns/B, streaming ns/B, cached samples, streaming samples), ...]
 * for the size buckets (log2 bytes) auto has measured. */
static PyObject *py_chan_kinds(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    int64_t h;
    if (nargs != 1) return PyErr_Format(PyExc_TypeError, "chan_kinds() takes 1 argument, got %zd", nargs);
    if (zb_i64(args[0], &h)) return NULL;
    zb_chan *c = (zb_chan *)(uintptr_t)h;
    PyObject *out = PyList_New(0);
    for (int b = 0; out && b < KIND_BUCKETS; b++) {
        zb_kind *k = &c->kinds[b];
        if (!k->seen[0] && !k->seen[1]) continue;
        PyObject *row = Py_BuildValue("(iddLL)", b, k->rate[0], k->rate[1], (long long)k->seen[0],
                                      (long long)k->seen[1]);
        if (!row || PyList_Append(out, row) < 0) Py_CLEAR(out);
        Py_XDECREF(row);
    }
    return out;
}

/* chan_phases(handle, on) -> the last all_reduce's (arrive, reduce, push, done) in ns; on: keep
 * recording (a few clock reads per op), off: stop. */
static PyObject *py_chan_phases(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    int64_t a[2];
    if (nargs != 2) return PyErr_Format(PyExc_TypeError, "chan_phases() takes 2 arguments, got %zd", nargs);
    for (int i = 0; i < 2; i++)
        if (zb_i64(args[i], &a[i])) return NULL;
    zb_chan *c = (zb_chan *)(uintptr_t)a[0];
    c->trace = a[1] != 0;
    return Py_BuildValue("(LLLL)", (long long)c->phase_ns[0], (long long)c->phase_ns[1], (long long)c->phase_ns[2],
                         (long long)c->phase_ns[3]);
}

static PyObject *py_chan_free(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 1) return PyErr_Format(PyExc_TypeError, "chan_free() takes 1 argument");
    zb_chan *c = PyLong_AsVoidPtr(args[0]);
    if (c) { free(c->scratch); free(c); }
    Py_RETURN_NONE;
}

/* chan_result(handle): the last op's outcome and the copies its error message needs (see the docstring) */
static PyObject *py_chan_result(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 1) return PyErr_Format(PyExc_TypeError, "chan_result() takes 1 argument");
    zb_chan *c = PyLong_AsVoidPtr(args[0]);
    PyObject *late = PyList_New(0);
    if (!late) return NULL;
    for (int q = 0; q < c->W; q++)
        if (c->result[0] == RC_TIMEOUT && (c->late_mask[q / 64] >> (q % 64)) & 1) {
            PyObject *v = PyLong_FromLong(q);
            if (!v || PyList_Append(late, v) < 0) { Py_XDECREF(v); Py_DECREF(late); return NULL; }
            Py_DECREF(v);
        }
    return Py_BuildValue("(LLLLNLL)", (long long)c->result[0], (long long)c->result[1], (long long)c->result[2],
                         (long long)(intptr_t)c->hdrcopy, late, (long long)(intptr_t)c->veccopy,
                         (long long)c->result[3] - 1);
}

/* abi_layout() -> {name: (sizeof, (offsetof of each field, ...))} of every struct Python fills (abi.STRUCTS,
 * as compiled here): native/__init__.py compares it with abi.py when the core loads. */
static PyObject *py_abi_layout(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self, (void)args;
    if (nargs != 0) return PyErr_Format(PyExc_TypeError, "abi_layout() takes no arguments, got %zd", nargs);
    PyObject *out = PyDict_New();
    if (!out) return NULL;
#define REPORT(s)                                                                                           \
    {                                                                                                       \
        static const size_t off[] = {ZB_OFFSETS_##s};                                                      \
        PyObject *offs = PyTuple_New((Py_ssize_t)(sizeof(off) / sizeof(off[0])));                           \
        for (size_t i = 0; offs && i < sizeof(off) / sizeof(off[0]); i++)                                   \
            PyTuple_SET_ITEM(offs, (Py_ssize_t)i, PyLong_FromSize_t(off[i]));                               \
        PyObject *row = offs ? Py_BuildValue("(nN)", (Py_ssize_t)sizeof(s), offs) : NULL;                   \
        if (!row || PyDict_SetItemString(out, #s, row) < 0) {                                               \
            Py_XDECREF(row);                                                                                \
            Py_DECREF(out);                                                                                 \
            return NULL;                                                                                    \
        }                                                                                                   \
        Py_DECREF(row);                                                                                     \
    }
    ZB_ABI_STRUCTS(REPORT)
#undef REPORT
    return out;
}

static PyMethodDef chan_methods[] = {
    {"abi_layout", (PyCFunction)(void (*)(void))py_abi_layout, METH_FASTCALL,
     "abi_layout() -> {struct: (sizeof, offsets)} as compiled (checked against zbccl/native/abi.py)."},
    {"chan_new", (PyCFunction)(void (*)(void))py_chan_new, METH_FASTCALL,
     "chan_new(W, me, spin, liveness_ns, timeout_ns, nthreads, table_ptr, poll_ns) -> handle of a native op "
     "channel."},
    {"chan_free", (PyCFunction)(void (*)(void))py_chan_free, METH_FASTCALL, "chan_free(handle)."},
    {"chan_configure", (PyCFunction)(void (*)(void))py_chan_configure, METH_FASTCALL,
     "chan_configure(handle, kind_mode): all_reduce's store kind (-1 auto, 0 cached, 1 streaming)."},
    {"chan_kinds", (PyCFunction)(void (*)(void))py_chan_kinds, METH_FASTCALL,
     "chan_kinds(handle) -> what the auto store kind measured: (log2 bucket, cached ns/B, streaming ns/B, "
     "cached samples, streaming samples) per bucket."},
    {"chan_phases", (PyCFunction)(void (*)(void))py_chan_phases, METH_FASTCALL,
     "chan_phases(handle, on) -> the last all_reduce's (arrive, reduce, push, done) ns; on: record."},
    {"chan_result", (PyCFunction)(void (*)(void))py_chan_result, METH_FASTCALL,
     "chan_result(handle) -> (code, rank, field, headers_ptr, late ranks, vector copies ptr, rank that may "
     "still write into this rank's memory or -1) of the last op."},
    {NULL, NULL, 0, NULL},
};

int zb_add_chan_methods(PyObject *module) {
    if (PyModule_AddFunctions(module, chan_methods) < 0) return -1;
    return zb_add_chan_ops(module);
}
