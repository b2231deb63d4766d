/*
 * zbccl native core: atomics, waits and raw copies on shared memory.
 *
 * Every address is a raw integer pointing into memory that several processes
 * map (MAP_SHARED), so all futex calls are *shared* (no FUTEX_PRIVATE_FLAG).
 *
 * Flag layout contract (one 64-byte cache line per flag, so flags never share
 * a line and a poll never bounces a neighbour's line):
 *
 *     +0   int64  value     written with store-release / seq_cst by the signaller
 *     +8   int32  waiters   number of processes futex-sleeping on this flag
 *     +12  padding to 64 bytes
 *
 * Synchronisation protocol (Dekker-style, both sides seq_cst):
 *   signaller: store value; load waiters; if > 0: FUTEX_WAKE(low 32 bits of value)
 *   waiter:    waiters += 1; load value; if unsatisfied: FUTEX_WAIT(low word, seen)
 *              waiters -= 1
 * Either the signaller sees waiters > 0 and wakes, or the waiter's re-check
 * sees the new value; FUTEX_WAIT itself also refuses to sleep when the low
 * word already changed. A change by an exact multiple of 2^32 would be missed
 * by the kernel compare, so every sleep is bounded (50 us doubling to 2 ms).
 *
 * Waits poll `spin` times with a CPU relax instruction while holding the GIL,
 * then release the GIL and sched_yield() between polls for the process's poll
 * phase (set_wait_poll; at least 50 us), then sleep on the futex. spin=0 yields at once (ranks outnumber cores). Flags waited on
 * by wait_ge are expected to be monotonic: a flag seen satisfied is not re-read.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "arch.h"
#include "zb_abi.h"

#define FLAG_BYTES 64
#define WAITERS_OFFSET (W_WAITERS * 8) /* abi.WORDS */
#define YIELD_PHASE_NS 50000LL
#define SLEEP_MIN_NS 50000LL
#define SLEEP_MAX_NS 2000000LL
#define NOGIL_COPY_BYTES (256u * 1024u)

/* ------------------------------------------------------------------ helpers */

static inline uint64_t mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Address of the low 32 bits of the int64 at p: the futex word. */
static inline uint32_t *low_word(int64_t *p) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    return (uint32_t *)p + 1;
#else
    return (uint32_t *)p;
#endif
}

static inline void futex_wake_all(int64_t *p) {
    syscall(SYS_futex, low_word(p), FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

static inline void futex_wait_ns(int64_t *p, uint32_t seen, int64_t ns) {
    struct timespec ts = {(time_t)(ns / 1000000000LL), (long)(ns % 1000000000LL)};
    syscall(SYS_futex, low_word(p), FUTEX_WAIT, seen, &ts, NULL, 0);
}

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

typedef struct {
    const uint64_t *addrs; /* flag addresses */
    Py_ssize_t n;
    int64_t target;
    int eq; /* 0: value >= target, 1: value == target */
} waitset;

static inline int flag_ok(const waitset *w, int64_t v) { return w->eq ? v == w->target : v >= w->target; }

/* First index >= i whose flag is unsatisfied, or n. */
static inline Py_ssize_t scan(const waitset *w, Py_ssize_t i) {
    for (; i < w->n; i++) {
        int64_t v = __atomic_load_n((int64_t *)w->addrs[i], __ATOMIC_ACQUIRE);
        if (!flag_ok(w, v)) break;
    }
    return i;
}

/* Futex phase on flag i: one bounded sleep. Returns 1 when the deadline passed. */
static int futex_sleep_once(const waitset *w, Py_ssize_t i, uint64_t deadline, int64_t sleep_ns) {
    int64_t *val = (int64_t *)w->addrs[i];
    int32_t *waiters = (int32_t *)((char *)val + WAITERS_OFFSET);
    int expired = 0;
    __atomic_fetch_add(waiters, 1, __ATOMIC_SEQ_CST);
    int64_t v = __atomic_load_n(val, __ATOMIC_SEQ_CST);
    if (!flag_ok(w, v)) {
        uint64_t t = mono_ns();
        if (t >= deadline) {
            expired = 1;
        } else {
            uint64_t left = deadline - t;
            futex_wait_ns(val, (uint32_t)(uint64_t)v, (uint64_t)sleep_ns < left ? sleep_ns : (int64_t)left);
        }
    }
    __atomic_fetch_sub(waiters, 1, __ATOMIC_SEQ_CST);
    return expired;
}

/* How long a wait keeps polling (yielding the core between polls) before it sleeps on the futex:
 * set_wait_poll, once per process at init (runtime/state.py picks it from the ranks' cores). */
static int64_t poll_phase_ns = YIELD_PHASE_NS;

/* Yield then futex phases, called without the GIL. Returns first unsatisfied index or n. */
static Py_ssize_t wait_nogil(const waitset *w, Py_ssize_t i, uint64_t deadline) {
    uint64_t t = mono_ns();
    uint64_t yield_end = t + (uint64_t)__atomic_load_n(&poll_phase_ns, __ATOMIC_RELAXED);
    while (t < deadline && t < yield_end) {
        sched_yield();
        i = scan(w, i);
        if (i == w->n) return i;
        t = mono_ns();
    }
    int64_t sleep_ns = SLEEP_MIN_NS;
    while (mono_ns() < deadline) {
        if (futex_sleep_once(w, i, deadline, sleep_ns)) break;
        i = scan(w, i);
        if (i == w->n) return i;
        sleep_ns = sleep_ns * 2 > SLEEP_MAX_NS ? SLEEP_MAX_NS : sleep_ns * 2;
    }
    return scan(w, i);
}

/* Full strategy. budget_ns < 0: no deadline; 0: poll once. Returns -1 or an index. */
static Py_ssize_t do_wait(const waitset *w, int64_t spin, int64_t budget_ns) {
    Py_ssize_t i = scan(w, 0);
    if (i == w->n) return -1;
    if (budget_ns == 0) return i;
    uint64_t start = mono_ns();
    uint64_t deadline = budget_ns < 0 ? UINT64_MAX : start + (uint64_t)budget_ns;
    for (int64_t s = 0; s < spin; s++) {
        cpu_relax();
        i = scan(w, i);
        if (i == w->n) return -1;
        if ((s & 255) == 255 && mono_ns() >= deadline) return i;
    }
    Py_BEGIN_ALLOW_THREADS
    i = wait_nogil(w, i, deadline);
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

/* Wake the flag's sleepers if any; the caller's preceding store must be seq_cst. */
static inline void wake_if_waiters(int64_t *p) {
    int32_t *waiters = (int32_t *)((char *)p + WAITERS_OFFSET);
    if (__atomic_load_n(waiters, __ATOMIC_SEQ_CST) > 0) futex_wake_all(p);
}

static PyObject *py_signal(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t a;
    int64_t v;
    if (check_nargs("signal", nargs, 2) || get_addr("signal", args[0], 8, &a) || get_i64("signal", args[1], &v))
        return NULL;
    /* seq_cst (not just release) so the waiters load below cannot move before it. */
    __atomic_store_n((int64_t *)a, v, __ATOMIC_SEQ_CST);
    wake_if_waiters((int64_t *)a);
    Py_RETURN_NONE;
}

static PyObject *py_fetch_add_signal(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t a;
    int64_t d;
    if (check_nargs("fetch_add_signal", nargs, 2) || get_addr("fetch_add_signal", args[0], 8, &a) ||
        get_i64("fetch_add_signal", args[1], &d))
        return NULL;
    int64_t old = __atomic_fetch_add((int64_t *)a, d, __ATOMIC_SEQ_CST);
    wake_if_waiters((int64_t *)a);
    return PyLong_FromLongLong(old);
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
    waitset w = {addrs, (Py_ssize_t)n, target, 0};
    return PyLong_FromSsize_t(do_wait(&w, spin, budget));
}

static PyObject *py_wait_eq(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t a;
    int64_t value, spin, budget;
    if (check_nargs("wait_eq", nargs, 4) || get_addr("wait_eq", args[0], 8, &a) ||
        get_i64("wait_eq", args[1], &value) || get_i64("wait_eq", args[2], &spin) ||
        get_i64("wait_eq", args[3], &budget))
        return NULL;
    waitset w = {&a, 1, value, 1};
    return PyBool_FromLong(do_wait(&w, spin, budget) == -1);
}

static PyObject *py_now_ns(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (check_nargs("now_ns", nargs, 0)) return NULL;
    return PyLong_FromUnsignedLongLong(mono_ns());
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

static PyObject *py_set_wait_poll(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t ns;
    if (check_nargs("set_wait_poll", nargs, 1) || get_i64("set_wait_poll", args[0], &ns)) return NULL;
    if (ns < 0) return PyErr_Format(PyExc_ValueError, "set_wait_poll: expected ns >= 0, got %lld", (long long)ns);
    __atomic_store_n(&poll_phase_ns, ns < YIELD_PHASE_NS ? YIELD_PHASE_NS : ns, __ATOMIC_RELAXED);
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
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef core_module = {
    PyModuleDef_HEAD_INIT, "zbccl._native_core",
    "zbccl native core: shared-memory atomics, futex waits and raw copies.", -1, core_methods,
};

/* reduce_py.c: reduce_n, copy, copy_many */
int zb_add_reduce_methods(PyObject *module);
/* chan.c: chan_new, chan_free, chan_all_reduce, chan_result */
int zb_add_chan_methods(PyObject *module);
int zb_add_ep_methods(PyObject *module); /* ep.c: ep_plan, ep_pull, ep_combine */

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
