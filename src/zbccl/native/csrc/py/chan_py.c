/* CPython binding of the native op channel (core/chan.c, core/chan_ops.c): the chan_* functions of the core
 * module, argument parsing, and the GIL and Ctrl-C as the core's zb_hooks. Channels run on the CPU transport
 * (cpu/transport.c). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>

#include "../core/chan.h"
#include "../cpu/transport_cpu.h"

/* A Python int as int64 (-1 and an exception on failure). */
static int zb_i64(PyObject *o, int64_t *out) {
    long long v = PyLong_AsLongLong(o);
    if (v == -1 && PyErr_Occurred()) return -1;
    *out = v;
    return 0;
}

/* The GIL as the core's zb_hooks: a long wait releases it (block), Ctrl-C reaches Python's handler
 * (check_signals, run with the GIL re-taken for the call), and zb_chan_call re-takes it after the op. */
typedef struct {
    int held;              /* 1 while the calling thread still holds the GIL */
    PyThreadState *saved;  /* its thread state once a long wait released it */
} gil_state;

static void gil_block(void *ctx) {
    gil_state *g = ctx;
    if (g->held) {
        g->saved = PyEval_SaveThread();
        g->held = 0;
    }
}

static int gil_check_signals(void *ctx) {
    gil_state *g = ctx;
    if (g->held) return PyErr_CheckSignals() < 0;
    PyEval_RestoreThread(g->saved);
    int raised = PyErr_CheckSignals() < 0;
    g->saved = PyEval_SaveThread();
    return raised;
}

/* Run one op on the core (core/chan_ops.c zb_chan_run) from Python. Called with the GIL held; returns an
 * RC_* code, or -1 with a Python exception set (bad arguments, or the signal handler's exception after an
 * interrupted wait). Also the native hot entry's (py/hot.cpp) way into the channel, through
 * chan_call_addr(). */
int zb_chan_call(zb_chan *c, zb_op *o) {
    int bad = zb_op_check(c, o);
    if (bad == 1) {
        PyErr_Format(PyExc_ValueError, "chan_run: bad op arguments (op %lld, nvec %lld, timeout %lld ns)",
                     (long long)o->op, (long long)o->nvec, (long long)o->timeout_ns);
        return -1;
    }
    if (bad) {
        PyErr_Format(PyExc_ValueError, "chan_run: bad dtype/op %lld/%lld", (long long)o->dtype, (long long)o->redop);
        return -1;
    }
    gil_state g = {1, NULL};
    c->hooks = (zb_hooks){gil_block, gil_check_signals, &g};
    int rc = zb_chan_run(c, o);
    if (!g.held) PyEval_RestoreThread(g.saved);
    c->hooks = (zb_hooks){NULL, NULL, NULL};
    return rc == RC_INTERRUPTED ? -1 : rc; /* the signal handler's exception (KeyboardInterrupt) is set */
}

static PyObject *py_chan_run(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    int64_t a[2];
    if (nargs != 2) return PyErr_Format(PyExc_TypeError, "chan_run() takes 2 arguments, got %zd", nargs);
    if (zb_i64(args[0], &a[0]) || zb_i64(args[1], &a[1])) return NULL;
    int rc = zb_chan_call((zb_chan *)(uintptr_t)a[0], (zb_op *)(uintptr_t)a[1]);
    return rc < 0 ? NULL : PyLong_FromLong(rc);
}

static PyObject *py_chan_call_addr(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self, (void)args;
    if (nargs != 0) return PyErr_Format(PyExc_TypeError, "chan_call_addr() takes no arguments, got %zd", nargs);
    return PyLong_FromVoidPtr((void *)zb_chan_call);
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
    zb_chan *c = zb_chan_new(&zb_cpu_transport, a[0], a[1], a[2], a[3], a[4], a[5],
                             (const int64_t *)(uintptr_t)a[6], a[7]);
    if (!c) return PyErr_NoMemory();
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
    zb_chan_configure((zb_chan *)(uintptr_t)a[0], a[1]);
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
    if (!c && PyErr_Occurred()) return NULL;
    zb_chan_free(c);
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
    /* the copies as bytes (W headers, then the two size-vector areas), so Python reads no native address */
    return Py_BuildValue("(LLLy#Ny#L)", (long long)c->result[0], (long long)c->result[1], (long long)c->result[2],
                         (const char *)c->hdrcopy, (Py_ssize_t)(c->W * sizeof(c->hdrcopy[0])), late,
                         (const char *)c->veccopy, (Py_ssize_t)sizeof(c->veccopy), (long long)c->result[3] - 1);
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
    {"chan_run", (PyCFunction)(void (*)(void))py_chan_run, METH_FASTCALL,
     "chan_run(handle, args_addr) -> result code: run the op described by the zb_op at args_addr."},
    {"chan_call_addr", (PyCFunction)(void (*)(void))py_chan_call_addr, METH_FASTCALL,
     "chan_call_addr() -> address of int zb_chan_call(zb_chan *, zb_op *): chan_run for native callers."},
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
     "chan_result(handle) -> (code, rank, field, headers (bytes: W x 16 int64), late ranks, size-vector copies "
     "(bytes: 2 x VEC_CAP int64), rank that may still write into this rank's memory or -1) of the last op."},
    {NULL, NULL, 0, NULL},
};

int zb_add_chan_methods(PyObject *module) {
    return PyModule_AddFunctions(module, chan_methods);
}
