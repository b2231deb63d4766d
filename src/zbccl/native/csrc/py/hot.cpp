/* zbccl native hot entries: a repeated all_reduce or all_gather in one C call from the tensor objects.
 *
 * Inside a model step every call of zbccl's Python entry finds the interpreter, the communicator
 * and the tensor's accessors evicted by the layer's matmuls (docs/benchmarks.md, "the cold Python
 * entry"). This entry takes the torch tensor itself: it reads contiguity, data pointer, element
 * count and dtype through the torch C++ API, finds the prefilled zb_op (the plan the Python layer
 * made and registered for exactly that tensor), takes the sequence number and runs the op through
 * the core's zb_chan_call. Anything it cannot serve (another tensor, a non-contiguous one, the
 * profiler on, the channel busy or disabled) returns -1 and the caller takes the Python path,
 * which does every check.
 *
 * One table per op channel (ops/channel.py), never freed (a few KiB per communicator; a caller
 * may hold its entry function after the channel closed):
 *   enabled  0 once the channel closed, broke, or the process forked (pthread_atfork child)
 *   busy     the channel's native lock: every op on the channel, hot or from Python, holds it
 *   seq      the channel's op sequence number (OpChannel.seq reads and writes it through hot_seq)
 * The hot entry takes `busy` (CAS, never waits) before it reads `enabled`; a closing channel clears
 * `enabled` before it waits for `busy` to drop: so either the entry sees the channel disabled or
 * the close waits for its op (both sequentially consistent). Registrations and clears run with
 * `busy` held by the Python layer (hot_acquire/hot_release).
 *
 * hot_submit is the Python path's one native call per op (OpChannel.submit, with the communicator's op
 * lock held): it takes `busy` (waiting for a hot call of another thread, without the GIL), numbers the
 * op, gives it this call's timeout, runs it and drops `busy`, so the Python layer takes no second lock
 * and touches no word of the table itself.
 */
#include <Python.h>

#include <pthread.h>
#include <sched.h>
#include <time.h>

#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <mutex>
#include <vector>

#include "zb_abi.h"

namespace {

constexpr int kSlots = 32;

/* A registered op: its input's key, its zb_op, and for an all_gather the output's address and size
 * (0 for an all_reduce, which is in place) and its blocks (the product of the input's sizes before the
 * gathered dimension; 1 for a gather along dim 0). */
struct Entry {
    int64_t ptr, numel, dtype, op, out_ptr, out_numel, blocks;
};

bool same_key(const Entry &e, const Entry &k) {
    return e.op && e.ptr == k.ptr && e.numel == k.numel && e.dtype == k.dtype && e.out_ptr == k.out_ptr &&
           e.out_numel == k.out_numel && e.blocks == k.blocks;
}

struct Table {
    int64_t enabled, busy, seq, chan, call, next, pad[2];
    Entry e[kSlots];
};

using ChanCall = int (*)(void *, void *);

std::mutex g_tables_lock;
std::vector<Table *> g_tables;

void disable_all_in_child() {
    for (Table *t : g_tables) t->enabled = 0; /* a forked child may not touch the parent's heap */
}

uint64_t now_ns() {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

bool try_lock(Table *t) {
    int64_t z = 0;
    return __atomic_compare_exchange_n(&t->busy, &z, 1, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
}

void unlock(Table *t) { __atomic_store_n(&t->busy, 0, __ATOMIC_SEQ_CST); }

/* Wait (GIL released) until `busy` can be taken (take = true) or is 0; false at the deadline. */
bool wait_busy(Table *t, int64_t timeout_ns, bool take) {
    auto ready = [&] { return take ? try_lock(t) : __atomic_load_n(&t->busy, __ATOMIC_SEQ_CST) == 0; };
    if (ready()) return true;
    bool ok = false;
    Py_BEGIN_ALLOW_THREADS
    uint64_t deadline = now_ns() + (uint64_t)timeout_ns;
    long sleep_ns = 1000;
    while (!(ok = ready()) && now_ns() < deadline) {
        timespec ts = {0, sleep_ns};
        nanosleep(&ts, nullptr);
        sleep_ns = sleep_ns * 2 > 1000000 ? 1000000 : sleep_ns * 2;
    }
    Py_END_ALLOW_THREADS
    return ok;
}

Table *table_of(PyObject *o) {
    void *p = PyLong_AsVoidPtr(o);
    if (!p && !PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "hot: null table");
    return (Table *)p;
}

/* The tensor's key, or false when the hot entry cannot serve it. */
bool key_of(PyObject *obj, Entry *k) {
    if (!THPVariable_Check(obj)) return false;
    const at::Tensor &t = THPVariable_Unpack(obj);
    if (!t.defined() || !t.device().is_cpu() || !t.is_contiguous() || t.numel() == 0) return false;
    k->ptr = (int64_t)(uintptr_t)t.const_data_ptr();
    k->numel = t.numel();
    k->dtype = (int64_t)t.scalar_type();
    return true;
}

/* Run the registered op matching `k` (input key, output address and size), or -1 if none. */
PyObject *run(Table *t, const Entry &k) {
    if (torch::autograd::profiler::profilerEnabled() || !try_lock(t)) return PyLong_FromLong(-1);
    if (!__atomic_load_n(&t->enabled, __ATOMIC_SEQ_CST)) {
        unlock(t);
        return PyLong_FromLong(-1);
    }
    zb_op *op = nullptr;
    for (int i = 0; i < kSlots; i++) {
        if (same_key(t->e[i], k)) {
            op = (zb_op *)(uintptr_t)t->e[i].op;
            break;
        }
    }
    if (!op) {
        unlock(t);
        return PyLong_FromLong(-1);
    }
    op->seq = ++t->seq;
    int rc = ((ChanCall)(uintptr_t)t->call)((void *)(uintptr_t)t->chan, (void *)op);
    unlock(t);
    return rc < 0 ? nullptr : PyLong_FromLong(rc);
}

/* all_reduce entry(tensor) -> 0 done, -1 not served (take the Python path), > 0 the op's result code. */
PyObject *hot_call(PyObject *self, PyObject *tensor) {
    Table *t = (Table *)PyCapsule_GetPointer(self, nullptr);
    if (!t) return nullptr;
    Entry k{};
    if (!key_of(tensor, &k)) return PyLong_FromLong(-1);
    return run(t, k);
}

/* The blocks of a gather of `in` into `out` along `dim` (the product of in's sizes before dim), or -1
 * when the shapes are not a gather along dim (every size equal but dim's) or dim is out of range. */
int64_t blocks_of(PyObject *out, PyObject *in, PyObject *dim_obj) {
    long dim = PyLong_AsLong(dim_obj);
    if (dim == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    const at::Tensor &o = THPVariable_Unpack(out), &i = THPVariable_Unpack(in);
    int64_t nd = i.dim();
    if (dim < 0) dim += nd;
    if (dim < 0 || dim >= nd || o.dim() != nd) return -1;
    int64_t blocks = 1;
    for (int64_t j = 0; j < nd; j++) {
        if (j != dim && o.size(j) != i.size(j)) return -1;
        if (j < dim) blocks *= i.size(j);
    }
    return blocks;
}

/* all_gather entry(output, input[, dim]): as hot_call; the output must be the registered one, same
 * dtype; with dim, the shapes must be a gather along it (the registered output size fixes dim's size). */
PyObject *hot_gather(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Table *t = (Table *)PyCapsule_GetPointer(self, nullptr);
    if (!t) return nullptr;
    Entry k{}, o{};
    if (nargs < 2 || nargs > 3 || !key_of(args[1], &k) || !key_of(args[0], &o) || o.dtype != k.dtype)
        return PyLong_FromLong(-1);
    k.out_ptr = o.ptr, k.out_numel = o.numel, k.blocks = 1;
    if (nargs == 3 && (k.blocks = blocks_of(args[0], args[1], args[2])) < 0) return PyLong_FromLong(-1);
    return run(t, k);
}

PyMethodDef hot_call_def = {"hot_all_reduce", (PyCFunction)hot_call, METH_O,
                            "entry(tensor) -> 0 done, -1 not served here, > 0 the op's result code."};
PyMethodDef hot_gather_def = {"hot_all_gather", (PyCFunction)(void (*)(void))hot_gather, METH_FASTCALL,
                              "entry(output, input[, dim]) -> 0 done, -1 not served here, > 0 the op's result code."};

PyObject *py_new(PyObject *, PyObject *args) {
    long long chan, call;
    if (!PyArg_ParseTuple(args, "LL", &chan, &call)) return nullptr;
    Table *t = (Table *)calloc(1, sizeof(Table));
    if (!t) return PyErr_NoMemory();
    t->chan = chan, t->call = call, t->enabled = 1;
    {
        std::lock_guard<std::mutex> g(g_tables_lock);
        g_tables.push_back(t);
    }
    return PyLong_FromVoidPtr(t);
}

PyObject *py_entry(PyObject *, PyObject *args) {
    PyObject *addr;
    int gather;
    if (!PyArg_ParseTuple(args, "Op", &addr, &gather)) return nullptr;
    Table *t = table_of(addr);
    if (!t) return nullptr;
    PyObject *cap = PyCapsule_New(t, nullptr, nullptr);
    if (!cap) return nullptr;
    PyObject *fn = PyCFunction_New(gather ? &hot_gather_def : &hot_call_def, cap);
    Py_DECREF(cap);
    return fn;
}

PyObject *py_register(PyObject *, PyObject *args) {
    PyObject *addr, *tensor, *out = Py_None;
    long long op, blocks = 1;
    if (!PyArg_ParseTuple(args, "OOL|OL", &addr, &tensor, &op, &out, &blocks)) return nullptr;
    Table *t = table_of(addr);
    if (!t) return nullptr;
    Entry k{}, o{};
    if (!key_of(tensor, &k)) return PyLong_FromLong(-1);
    if (out != Py_None) {
        if (!key_of(out, &o) || o.dtype != k.dtype) return PyLong_FromLong(-1);
        k.out_ptr = o.ptr, k.out_numel = o.numel, k.blocks = blocks > 1 ? blocks : 1;
    }
    int slot = -1;
    for (int i = 0; i < kSlots && slot < 0; i++)
        if (same_key(t->e[i], k)) slot = i;
    if (slot < 0) slot = (int)(t->next++ % kSlots);
    k.op = op;
    t->e[slot] = k;
    return PyLong_FromLong(slot);
}

PyObject *py_clear(PyObject *, PyObject *addr) {
    Table *t = table_of(addr);
    if (!t) return nullptr;
    for (int i = 0; i < kSlots; i++) t->e[i] = Entry{};
    t->next = 0;
    Py_RETURN_NONE;
}

/* (table, timeout_ns) arguments of acquire and disable. */
Table *table_and_timeout(PyObject *args, long long *timeout_ns) {
    PyObject *addr;
    if (!PyArg_ParseTuple(args, "OL", &addr, timeout_ns)) return nullptr;
    return table_of(addr);
}

PyObject *py_acquire(PyObject *, PyObject *args) {
    long long timeout_ns;
    Table *t = table_and_timeout(args, &timeout_ns);
    return t ? PyBool_FromLong(wait_busy(t, timeout_ns, true)) : nullptr;
}

PyObject *py_release(PyObject *, PyObject *addr) {
    Table *t = table_of(addr);
    if (!t) return nullptr;
    unlock(t);
    Py_RETURN_NONE;
}

PyObject *py_disable(PyObject *, PyObject *args) {
    long long timeout_ns;
    Table *t = table_and_timeout(args, &timeout_ns);
    if (!t) return nullptr;
    __atomic_store_n(&t->enabled, 0, __ATOMIC_SEQ_CST);
    return PyBool_FromLong(timeout_ns <= 0 || wait_busy(t, timeout_ns, false));
}

/* hot_submit(table, zb_op address, timeout_ns) -> the op's result code, or -1 when the channel stayed
 * busy (another thread's hot call) past timeout_ns + 15 s. The zb_op keeps its own timeout_ns after the
 * call (a cached plan holds the communicator's default, which the hot entry uses). */
PyObject *py_submit(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) return PyErr_Format(PyExc_TypeError, "hot_submit() takes 3 arguments, got %zd", nargs);
    Table *t = table_of(args[0]);
    if (!t) return nullptr;
    zb_op *op = (zb_op *)PyLong_AsVoidPtr(args[1]);
    long long timeout_ns = PyLong_AsLongLong(args[2]);
    if ((!op || timeout_ns == -1) && PyErr_Occurred()) return nullptr;
    if (!wait_busy(t, timeout_ns + 15000000000LL, true)) return PyLong_FromLong(-1);
    int64_t keep = op->timeout_ns;
    op->seq = ++t->seq;
    op->timeout_ns = timeout_ns;
    int rc = ((ChanCall)(uintptr_t)t->call)((void *)(uintptr_t)t->chan, (void *)op);
    op->timeout_ns = keep;
    unlock(t);
    return rc < 0 ? nullptr : PyLong_FromLong(rc);
}

/* hot_seq(table[, value]) -> the channel's op sequence number (first set to value when given). */
PyObject *py_seq(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) return PyErr_Format(PyExc_TypeError, "hot_seq() takes 1 or 2 arguments");
    Table *t = table_of(args[0]);
    if (!t) return nullptr;
    if (nargs == 2) {
        long long v = PyLong_AsLongLong(args[1]);
        if (v == -1 && PyErr_Occurred()) return nullptr;
        t->seq = v;
    }
    return PyLong_FromLongLong(t->seq);
}

PyMethodDef methods[] = {
    {"hot_new", py_new, METH_VARARGS, "hot_new(chan_handle, chan_call_addr) -> table address (enabled)."},
    {"hot_entry", py_entry, METH_VARARGS,
     "hot_entry(table, gather) -> all_reduce entry(tensor), or all_gather entry(output, input) when gather; "
     "each -> 0 | -1 | result code."},
    {"hot_register", py_register, METH_VARARGS,
     "hot_register(table, input, zb_op address[, output[, blocks]]) -> slot, or -1 if it cannot be served "
     "(busy held)."},
    {"hot_clear", py_clear, METH_O, "hot_clear(table): forget every registered op (busy held)."},
    {"hot_acquire", py_acquire, METH_VARARGS,
     "hot_acquire(table, timeout_ns) -> bool: take the channel's native lock, waiting without the GIL."},
    {"hot_release", py_release, METH_O, "hot_release(table): drop the channel's native lock."},
    {"hot_submit", (PyCFunction)(void (*)(void))py_submit, METH_FASTCALL,
     "hot_submit(table, zb_op address, timeout_ns) -> result code (-1: the channel stayed busy): the Python "
     "path's op, numbered and run under the channel's native lock."},
    {"hot_seq", (PyCFunction)(void (*)(void))py_seq, METH_FASTCALL,
     "hot_seq(table[, value]) -> the channel's op sequence number (set first when value is given)."},
    {"hot_disable", py_disable, METH_VARARGS,
     "hot_disable(table, timeout_ns) -> bool: no more hot calls; then wait (GIL released) until none runs."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "zbccl._native_hot",
                      "zbccl native hot entry: a repeated all_reduce in one call from the tensor.", -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__native_hot(void) {
    static std::once_flag once;
    std::call_once(once, [] { pthread_atfork(nullptr, nullptr, disable_all_in_child); });
    PyObject *m = PyModule_Create(&module);
    if (!m) return nullptr;
    return m;
}
