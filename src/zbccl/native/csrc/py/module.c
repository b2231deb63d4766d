/*
 * zbccl native core module (zbccl._native_core): the CPython binding of the native code.
 *
 * The native code is in three layers (docs/design.md, "native"): core/ is the protocol engine (pure C, no
 * Python header, over a transport's verbs), cpu/ the CPU transport and its kernels (flags and futexes,
 * copies, reductions, EP rows), and py/ (this directory) the binding: argument parsing, the GIL and the
 * module. This file binds the flag verbs (cpu/flags.c) that the Python layer's own waits use; chan_py.c,
 * reduce_py.c and ep_py.c bind the rest.
 *
 * Every address is a raw integer pointing into memory that several processes map. Waits poll `spin` times
 * with a CPU relax instruction while holding the GIL, then release the GIL and sched_yield() between polls
 * for the process's poll phase (set_wait_poll; at least 50 us), then sleep on the futex (cpu/flags.h has the
 * flag layout and the sleep protocol). spin=0 yields at once (ranks outnumber cores). Flags waited on by
 * wait_ge are expected to be monotonic: a flag seen satisfied is not re-read.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>

#include "../core/arch.h"
#include "../cpu/flags.h"

#define NOGIL_COPY_BYTES (256u * 1024u)

static int check_nargs(const char *fn, Py_ssize_t nargs, Py_ssize_t want) {
    if (nargs == want) return 0;
    PyErr_Format(PyExc_TypeError, "%s: wrong number of arguments, expected %zd, got %zd", fn, want, nargs);
    return -1;
}

static int get_i64(const char *fn, PyObject *o, int64_t *out) {
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "%s: expected an int, got %.100s", fn, Py_TYPE(o)->tp_name);
        return -1;
    }
    long long v = PyLong_AsLongLong(o);
    if (v == -1 && PyErr_Occurred()) return -1;
    *out = (int64_t)v;
    return 0;
}

/* A raw address: a non-zero int, aligned to `align` (a power of two). */
static int get_addr(const char *fn, PyObject *o, uint64_t align, uint64_t *out) {
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "%s: expected an int address, got %.100s", fn, Py_TYPE(o)->tp_name);
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    if (v == 0 || (v & (align - 1)) != 0) {
        PyErr_Format(PyExc_ValueError, "%s: bad address, expected a non-zero multiple of %llu, got 0x%llx", fn,
                     (unsigned long long)align, v);
        return -1;
    }
    *out = (uint64_t)v;
    return 0;
}

/* -------------------------------------------------------------------- waits */

/* Spin (GIL held), then the CPU transport's yield and futex phases without the GIL. budget_ns < 0: no
 * deadline; 0: poll once. Returns -1 when every flag is satisfied, else the first unsatisfied index. */
static Py_ssize_t do_wait(const zb_waitset *w, int64_t spin, int64_t budget_ns) {
    long i = zb_waitset_scan(w, 0);
    if (i == w->n) return -1;
    if (budget_ns == 0) return i;
    uint64_t start = zb_mono_ns();
    uint64_t deadline = budget_ns < 0 ? UINT64_MAX : start + (uint64_t)budget_ns;
    for (int64_t s = 0; s < spin; s++) {
        cpu_relax();
        i = zb_waitset_scan(w, i);
        if (i == w->n) return -1;
        if ((s & 255) == 255 && zb_mono_ns() >= deadline) return i;
    }
    Py_BEGIN_ALLOW_THREADS
    i = zb_waitset_block(w, i, deadline);
    Py_END_ALLOW_THREADS
    return i == w->n ? -1 : i;
}

/* ---------------------------------------------------------- Python methods */

static PyObject *py_load_acquire(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t a;
    if (check_nargs("load_acquire", nargs, 1) || get_addr("load_acquire", args[0], 8, &a)) return NULL;
    return PyLong_FromLongLong(__atomic_load_n((int64_t *)a, __ATOMIC_ACQUIRE));
}

static PyObject *py_store_release(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t a;
    int64_t v;
    if (check_nargs("store_release", nargs, 2) || get_addr("store_release", args[0], 8, &a) ||
        get_i64("store_release", args[1], &v))
        return NULL;
    __atomic_store_n((int64_t *)a, v, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

static PyObject *py_fetch_add(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t a;
    int64_t d;
    if (check_nargs("fetch_add", nargs, 2) || get_addr("fetch_add", args[0], 8, &a) ||
        get_i64("fetch_add", args[1], &d))
        return NULL;
    return PyLong_FromLongLong(__atomic_fetch_add((int64_t *)a, d, __ATOMIC_ACQ_REL));
}

static PyObject *py_signal(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t a;
    int64_t v;
    if (check_nargs("signal", nargs, 2) || get_addr("signal", args[0], 8, &a) || get_i64("signal", args[1], &v))
        return NULL;
    zb_flag_signal((int64_t *)a, v);
    Py_RETURN_NONE;
}

static PyObject *py_fetch_add_signal(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t a;
    int64_t d;
    if (check_nargs("fetch_add_signal", nargs, 2) || get_addr("fetch_add_signal", args[0], 8, &a) ||
        get_i64("fetch_add_signal", args[1], &d))
        return NULL;
    return PyLong_FromLongLong(zb_flag_add_signal((int64_t *)a, d));
}

static PyObject *py_wait_ge(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t arr;
    int64_t n, target, spin, budget;
    if (check_nargs("wait_ge", nargs, 5) || get_addr("wait_ge", args[0], 8, &arr) ||
        get_i64("wait_ge", args[1], &n) || get_i64("wait_ge", args[2], &target) ||
        get_i64("wait_ge", args[3], &spin) || get_i64("wait_ge", args[4], &budget))
        return NULL;
    if (n < 0) {
        PyErr_Format(PyExc_ValueError, "wait_ge: bad flag count, expected >= 0, got %lld", (long long)n);
        return NULL;
    }
    const uint64_t *addrs = (const uint64_t *)arr;
    for (int64_t k = 0; k < n; k++) {
        if (addrs[k] == 0 || (addrs[k] & 7) != 0) {
            PyErr_Format(PyExc_ValueError, "wait_ge: bad flag address at index %lld, got 0x%llx", (long long)k,
                         (unsigned long long)addrs[k]);
            return NULL;
        }
    }
    zb_waitset w = {addrs, (long)n, target, 0};
    return PyLong_FromSsize_t(do_wait(&w, spin, budget));
}

static PyObject *py_wait_eq(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t a;
    int64_t value, spin, budget;
    if (check_nargs("wait_eq", nargs, 4) || get_addr("wait_eq", args[0], 8, &a) ||
        get_i64("wait_eq", args[1], &value) || get_i64("wait_eq", args[2], &spin) ||
        get_i64("wait_eq", args[3], &budget))
        return NULL;
    zb_waitset w = {&a, 1, value, 1};
    return PyBool_FromLong(do_wait(&w, spin, budget) == -1);
}

static PyObject *py_now_ns(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (check_nargs("now_ns", nargs, 0)) return NULL;
    return PyLong_FromUnsignedLongLong(zb_mono_ns());
}

static PyObject *py_memcpy(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t d, s;
    int64_t n;
    if (check_nargs("memcpy", nargs, 3) || get_i64("memcpy", args[2], &n)) return NULL;
    if (n < 0) return PyErr_Format(PyExc_ValueError, "memcpy: bad size, expected >= 0, got %lld", (long long)n);
    if (n == 0) Py_RETURN_NONE;
    if (get_addr("memcpy", args[0], 1, &d) || get_addr("memcpy", args[1], 1, &s)) return NULL;
    if ((uint64_t)n >= NOGIL_COPY_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        memcpy((void *)d, (const void *)s, (size_t)n);
        Py_END_ALLOW_THREADS
    } else {
        memcpy((void *)d, (const void *)s, (size_t)n);
    }
    Py_RETURN_NONE;
}

static PyObject *py_memset(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t d;
    int64_t byte, n;
    if (check_nargs("memset", nargs, 3) || get_i64("memset", args[1], &byte) || get_i64("memset", args[2], &n))
        return NULL;
    if (n < 0) return PyErr_Format(PyExc_ValueError, "memset: bad size, expected >= 0, got %lld", (long long)n);
    if (n == 0) Py_RETURN_NONE;
    if (get_addr("memset", args[0], 1, &d)) return NULL;
    if ((uint64_t)n >= NOGIL_COPY_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        memset((void *)d, (int)(byte & 0xff), (size_t)n);
        Py_END_ALLOW_THREADS
    } else {
        memset((void *)d, (int)(byte & 0xff), (size_t)n);
    }
    Py_RETURN_NONE;
}

/* XXH64 (Yann Collet's xxHash, 64-bit variant), written from its published algorithm: the check word of a
 * one-write step across hosts (ops/hosts/mesh.py), over bytes that may still be landing. */
#define XXP1 0x9E3779B185EBCA87ULL
#define XXP2 0xC2B2AE3D27D4EB4FULL
#define XXP3 0x165667B19E3779F9ULL
#define XXP4 0x85EBCA77C2B2AE63ULL
#define XXP5 0x27D4EB2F165667C5ULL

static inline uint64_t xx_rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
static inline uint64_t xx_read64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static inline uint32_t xx_read32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint64_t xx_round(uint64_t acc, uint64_t in) { return xx_rotl(acc + in * XXP2, 31) * XXP1; }
static inline uint64_t xx_merge(uint64_t acc, uint64_t v) { return (acc ^ xx_round(0, v)) * XXP1 + XXP4; }

static uint64_t zb_hash64(const uint8_t *p, size_t n, uint64_t seed) {
    const uint8_t *end = p + n;
    uint64_t h;
    if (n >= 32) {
        uint64_t v1 = seed + XXP1 + XXP2, v2 = seed + XXP2, v3 = seed, v4 = seed - XXP1;
        const uint8_t *limit = end - 32;
        do {
            v1 = xx_round(v1, xx_read64(p));
            v2 = xx_round(v2, xx_read64(p + 8));
            v3 = xx_round(v3, xx_read64(p + 16));
            v4 = xx_round(v4, xx_read64(p + 24));
            p += 32;
        } while (p <= limit);
        h = xx_rotl(v1, 1) + xx_rotl(v2, 7) + xx_rotl(v3, 12) + xx_rotl(v4, 18);
        h = xx_merge(h, v1);
        h = xx_merge(h, v2);
        h = xx_merge(h, v3);
        h = xx_merge(h, v4);
    } else {
        h = seed + XXP5;
    }
    h += (uint64_t)n;
    for (; p + 8 <= end; p += 8) h = xx_rotl(h ^ xx_round(0, xx_read64(p)), 27) * XXP1 + XXP4;
    if (p + 4 <= end) {
        h = xx_rotl(h ^ ((uint64_t)xx_read32(p) * XXP1), 23) * XXP2 + XXP3;
        p += 4;
    }
    for (; p < end; p++) h = xx_rotl(h ^ ((uint64_t)*p * XXP5), 11) * XXP1;
    h ^= h >> 33;
    h *= XXP2;
    h ^= h >> 29;
    h *= XXP3;
    h ^= h >> 32;
    return h;
}

static PyObject *py_hash64(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t a = 0, h;
    int64_t n;
    if (check_nargs("hash64", nargs, 3) || get_i64("hash64", args[1], &n)) return NULL;
    if (n < 0) return PyErr_Format(PyExc_ValueError, "hash64: bad size, expected >= 0, got %lld", (long long)n);
    if (!PyLong_Check(args[2]))
        return PyErr_Format(PyExc_TypeError, "hash64: expected an int seed, got %.100s", Py_TYPE(args[2])->tp_name);
    uint64_t seed = (uint64_t)PyLong_AsUnsignedLongLongMask(args[2]);
    if (seed == (uint64_t)-1 && PyErr_Occurred()) return NULL;
    if (n && get_addr("hash64", args[0], 1, &a)) return NULL;
    if ((uint64_t)n >= NOGIL_COPY_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        h = zb_hash64((const uint8_t *)a, (size_t)n, seed);
        Py_END_ALLOW_THREADS
    } else {
        h = zb_hash64((const uint8_t *)a, (size_t)n, seed);
    }
    return PyLong_FromUnsignedLongLong(h);
}

static PyObject *py_nap(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t ns;
    if (check_nargs("nap", nargs, 1) || get_i64("nap", args[0], &ns)) return NULL;
    if (ns < 0 || ns > 1000000000) return PyErr_Format(PyExc_ValueError, "nap: expected 0 <= ns <= 1e9, got %lld",
                                                       (long long)ns);
    Py_BEGIN_ALLOW_THREADS
    /* the thread's timer slack (50 us by default) would stretch a 5 us sleep to 55: tighten it for this sleep only */
    int old = prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0);
    if (old > 1000) prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
    struct timespec ts = {(time_t)(ns / 1000000000), (long)(ns % 1000000000)};
    nanosleep(&ts, NULL);
    if (old > 1000) prctl(PR_SET_TIMERSLACK, (unsigned long)old, 0, 0, 0);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_set_wait_poll(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t ns;
    if (check_nargs("set_wait_poll", nargs, 1) || get_i64("set_wait_poll", args[0], &ns)) return NULL;
    if (ns < 0) return PyErr_Format(PyExc_ValueError, "set_wait_poll: expected ns >= 0, got %lld", (long long)ns);
    zb_set_wait_poll(ns);
    Py_RETURN_NONE;
}

#define FASTCALL(name, fn, doc) {name, (PyCFunction)(void (*)(void))fn, METH_FASTCALL, doc}

static PyMethodDef core_methods[] = {
    FASTCALL("load_acquire", py_load_acquire, "load_acquire(addr) -> int: acquire load of the int64 at addr."),
    FASTCALL("store_release", py_store_release, "store_release(addr, value): release store of an int64."),
    FASTCALL("fetch_add", py_fetch_add, "fetch_add(addr, delta) -> old: acq_rel atomic add of an int64."),
    FASTCALL("signal", py_signal,
             "signal(addr, value): store value (seq_cst), then FUTEX_WAKE the flag's sleepers if any."),
    FASTCALL("fetch_add_signal", py_fetch_add_signal,
             "fetch_add_signal(addr, delta) -> old: seq_cst add, then wake the flag's sleepers if any."),
    FASTCALL("wait_ge", py_wait_ge,
             "wait_ge(addrs_ptr, n, target, spin, budget_ns) -> int: wait until every flag in the uint64[n] "
             "array at addrs_ptr is >= target. -1 when all are, else the first unsatisfied index once "
             "budget_ns passed (budget_ns < 0: no limit; 0: poll once). Releases the GIL once spin is spent."),
    FASTCALL("wait_eq", py_wait_eq,
             "wait_eq(addr, value, spin, budget_ns) -> bool: wait until the flag == value; False on timeout."),
    FASTCALL("set_wait_poll", py_set_wait_poll,
             "set_wait_poll(ns): how long waits poll (yielding between polls, GIL released) before they sleep on "
             "the futex; at least 50 us. Process-wide."),
    FASTCALL("now_ns", py_now_ns, "now_ns() -> int: CLOCK_MONOTONIC in nanoseconds."),
    FASTCALL("memcpy", py_memcpy, "memcpy(dst, src, nbytes): raw copy; releases the GIL from 256 KiB."),
    FASTCALL("memset", py_memset, "memset(dst, byte, nbytes): raw fill; releases the GIL from 256 KiB."),
    FASTCALL("nap", py_nap,
             "nap(ns): sleep ns nanoseconds (GIL released), the thread's timer slack at 1 us meanwhile."),
    FASTCALL("hash64", py_hash64,
             "hash64(addr, nbytes, seed) -> int: XXH64 of the bytes (unsigned); releases the GIL from 256 KiB."),
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef core_module = {
    PyModuleDef_HEAD_INIT, "zbccl._native_core",
    "zbccl native core: shared-memory atomics, futex waits and raw copies.", -1, core_methods,
};

/* reduce_py.c: reduce_n, copy, copy_many */
int zb_add_reduce_methods(PyObject *module);
/* chan_py.c: chan_new, chan_free, chan_run, chan_result, ... */
int zb_add_chan_methods(PyObject *module);
int zb_add_ep_methods(PyObject *module); /* ep_py.c: ep_layout, ep_plan, ep_pull, ep_combine, ... */

PyMODINIT_FUNC PyInit__native_core(void) {
    PyObject *m = PyModule_Create(&core_module);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "FLAG_BYTES", FLAG_BYTES) < 0 ||
        PyModule_AddIntConstant(m, "WAITERS_OFFSET", WAITERS_OFFSET) < 0 ||
        zb_add_reduce_methods(m) < 0 || zb_add_chan_methods(m) < 0 || zb_add_ep_methods(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
