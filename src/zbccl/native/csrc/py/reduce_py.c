/* CPython bindings of the CPU kernels (cpu/reduce.c), added to the core module by zb_add_reduce_methods(). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "../cpu/reduce.h"

static int args_ll(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, long long *out, const char *fn) {
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments, got %zd", fn, want, nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) {
        out[i] = PyLong_AsLongLong(args[i]);
        if (out[i] == -1 && PyErr_Occurred()) return -1;
    }
    return 0;
}

/* reduce_n(dst, srcs_ptr, n, count, dtype, op, divisor, nthreads) */
static PyObject *py_reduce_n(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long a[8];
    if (nargs != 8) {
        PyErr_Format(PyExc_TypeError, "reduce_n() takes 8 arguments, got %zd", nargs);
        return NULL;
    }
    for (int i = 0; i < 8; i++) {
        if (i == 6) continue;
        a[i] = PyLong_AsLongLong(args[i]);
        if (a[i] == -1 && PyErr_Occurred()) return NULL;
    }
    double divisor = PyFloat_AsDouble(args[6]);
    if (divisor == -1.0 && PyErr_Occurred()) return NULL;
    int dtype = (int)a[4], op = (int)a[5];
    if (!zb_reduce_valid(dtype, op) || a[2] < 1 || a[3] < 0) {
        PyErr_Format(PyExc_ValueError, "reduce_n: unsupported dtype %d / op %d / n %lld / count %lld", dtype, op,
                     a[2], a[3]);
        return NULL;
    }
    void *dst = (void *)(uintptr_t)a[0];
    const void *const *srcs = (const void *const *)(uintptr_t)a[1];
    if (a[3] >= 16384) {
        Py_BEGIN_ALLOW_THREADS
        zb_reduce_n(dst, srcs, (long)a[2], (long)a[3], dtype, op, divisor, (int)a[7]);
        Py_END_ALLOW_THREADS
    } else {
        zb_reduce_n(dst, srcs, (long)a[2], (long)a[3], dtype, op, divisor, 1);
    }
    Py_RETURN_NONE;
}

/* copy(dst, src, nbytes, nthreads) */
static PyObject *py_copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long a[4];
    if (args_ll(args, nargs, 4, a, "copy") < 0) return NULL;
    if (a[2] <= 0) Py_RETURN_NONE;
    if (a[2] >= (1 << 16)) {
        Py_BEGIN_ALLOW_THREADS
        zb_copy((void *)(uintptr_t)a[0], (const void *)(uintptr_t)a[1], (long)a[2], (int)a[3]);
        Py_END_ALLOW_THREADS
    } else {
        zb_copy((void *)(uintptr_t)a[0], (const void *)(uintptr_t)a[1], (long)a[2], 1);
    }
    Py_RETURN_NONE;
}

/* copy_many(table_ptr, n, nthreads): table is int64[3n] of (dst, src, nbytes) triples. */
static PyObject *py_copy_many(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long a[3];
    if (args_ll(args, nargs, 3, a, "copy_many") < 0) return NULL;
    const long long *t = (const long long *)(uintptr_t)a[0];
    long long total = 0;
    for (long long i = 0; i < a[1]; i++) total += t[3 * i + 2];
    if (total >= (1 << 16)) {
        Py_BEGIN_ALLOW_THREADS
        for (long long i = 0; i < a[1]; i++)
            zb_copy((void *)(uintptr_t)t[3 * i], (const void *)(uintptr_t)t[3 * i + 1], (long)t[3 * i + 2], (int)a[2]);
        Py_END_ALLOW_THREADS
    } else {
        for (long long i = 0; i < a[1]; i++)
            zb_copy((void *)(uintptr_t)t[3 * i], (const void *)(uintptr_t)t[3 * i + 1], (long)t[3 * i + 2], 1);
    }
    Py_RETURN_NONE;
}

static PyMethodDef reduce_methods[] = {
    {"reduce_n", (PyCFunction)(void (*)(void))py_reduce_n, METH_FASTCALL,
     "reduce_n(dst, srcs_ptr, n, count, dtype, op, divisor, nthreads): dst[i] = op over the n source "
     "pointers in the uint64[n] array at srcs_ptr, in index order; bf16/fp16 accumulate in fp32."},
    {"copy", (PyCFunction)(void (*)(void))py_copy, METH_FASTCALL,
     "copy(dst, src, nbytes, nthreads): memcpy, split over threads when large."},
    {"copy_many", (PyCFunction)(void (*)(void))py_copy_many, METH_FASTCALL,
     "copy_many(table_ptr, n, nthreads): n copies described by int64 (dst, src, nbytes) triples."},
    {NULL, NULL, 0, NULL},
};

int zb_add_reduce_methods(PyObject *module) { return PyModule_AddFunctions(module, reduce_methods); }
