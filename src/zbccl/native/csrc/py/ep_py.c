/* CPython bindings of the CPU EP kernels (cpu/ep.c), added to the core module by zb_add_ep_methods(): each
 * ep_<kernel>(args_ptr) takes the address of its typed argument block and returns the kernel's result. The
 * kernels that copy or sum rows run without the GIL; the counting ones (layout, route, plan) keep it. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "../cpu/ep.h"

typedef i64 (*ep_kernel)(const void *);

static int get_args(PyObject *const *args, Py_ssize_t nargs, const char *fn, const void **a) {
    if (nargs != 1) {
        PyErr_Format(PyExc_TypeError, "%s() takes 1 argument (the address of its argument block), got %zd", fn,
                     nargs);
        return -1;
    }
    unsigned long long p = PyLong_AsUnsignedLongLong(args[0]);
    if (p == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *a = (const void *)(uintptr_t)p;
    return 0;
}

static PyObject *call(PyObject *const *args, Py_ssize_t nargs, const char *name, ep_kernel fn, int nogil) {
    const void *a;
    i64 rc;
    if (get_args(args, nargs, name, &a) < 0) return NULL;
    if (nogil) {
        Py_BEGIN_ALLOW_THREADS
        rc = fn(a);
        Py_END_ALLOW_THREADS
    } else {
        rc = fn(a);
    }
    return PyLong_FromLongLong(rc);
}

#define BIND(name, nogil)                                                                   \
    static PyObject *py_##name(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {   \
        (void)self;                                                                         \
        return call(args, nargs, #name, zbk_##name, nogil);                                  \
    }
BIND(ep_layout, 0)
BIND(ep_route, 0)
BIND(ep_plan, 0)
BIND(ep_pull, 1)
BIND(ep_combine, 1)
BIND(ep_ll_plan, 1)
BIND(ep_ll_pull, 1)
BIND(ep_ll_addrs, 1)
BIND(ep_ll_combine, 1)
BIND(ep_hosts_recv, 1)
BIND(ep_hosts_pack, 1)
BIND(ep_hosts_handle, 1)
BIND(ep_hosts_ll_recv, 1)
#undef BIND

#define FASTCALL(name, doc) {#name, (PyCFunction)(void (*)(void))py_##name, METH_FASTCALL, doc}

static PyMethodDef ep_methods[] = {
    FASTCALL(ep_layout,
             "ep_layout(args_ptr) -> -1 or the first bad top-k entry: get_dispatch_layout's counts (cpu/ep.c)."),
    FASTCALL(ep_route,
             "ep_route(args_ptr) -> -1 or a rank whose count differs: a sender's plan block and send_head "
             "(cpu/ep.c)."),
    FASTCALL(ep_plan,
             "ep_plan(args_ptr) -> -1 or a bad rank: the [R, R] counts, per local expert counts and receive channel "
             "prefix of a dispatch, read from every sender's plan block (cpu/ep.c)."),
    FASTCALL(ep_pull,
             "ep_pull(args_ptr) -> bytes copied, or -(1 + bad rank): a dispatch's row copies from every sender "
             "(cpu/ep.c)."),
    FASTCALL(ep_combine, "ep_combine(args_ptr) -> bytes read, or -(1 + bad rank): a combine's fp32 sums (cpu/ep.c)."),
    FASTCALL(ep_ll_plan,
             "ep_ll_plan(args_ptr) -> pairs, or -1 (entry out of range) / -2 (expert twice in a token): the "
             "low-latency dispatch's expert-sorted (token, slot) pairs (cpu/ep.c)."),
    FASTCALL(ep_ll_pull,
             "ep_ll_pull(args_ptr) -> bytes copied, or -1 (a bad sender block) / -2 (an expert over its slots): the "
             "low-latency dispatch's receive half (cpu/ep.c)."),
    FASTCALL(ep_ll_addrs,
             "ep_ll_addrs(args_ptr) -> 0, or -1 (a row outside its owner's block): the low-latency combine's row "
             "addresses and weights in per-token expert order (cpu/ep.c)."),
    FASTCALL(ep_ll_combine,
             "ep_ll_combine(args_ptr) -> bytes read: the low-latency combine's weighted fp32 sums (cpu/ep.c)."),
    FASTCALL(ep_hosts_recv,
             "ep_hosts_recv(args_ptr) -> rows copied, or -(1 + source): a dispatch's receive across hosts, the rows "
             "whose routing mask names this rank, out of each source's packed block (cpu/ep.c)."),
    FASTCALL(ep_hosts_pack,
             "ep_hosts_pack(args_ptr) -> rows, or -1 (a bad host table): a dispatch's send side across hosts, the "
             "tokens bound for each host with their routing masks, packed into one send block (cpu/ep.c)."),
    FASTCALL(ep_hosts_handle,
             "ep_hosts_handle(args_ptr) -> 0, -1 (sizes out of range) or -(2 + source) (a received row with a negative "
             "source token): "
             "DeepEP's internode handle fields of a dispatch across hosts (cpu/ep.c)."),
    FASTCALL(ep_hosts_ll_recv,
             "ep_hosts_ll_recv(args_ptr) -> 0, or -(1 + source) (err_out says why): the low-latency dispatch's "
             "receive across hosts, each source's rows placed per local expert (cpu/ep.c)."),
    {NULL, NULL, 0, NULL},
};

int zb_add_ep_methods(PyObject *module) { return PyModule_AddFunctions(module, ep_methods); }
