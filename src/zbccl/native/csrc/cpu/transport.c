/* zbccl CPU transport: the protocol engine's verbs (core/transport.h) over shared host memory.
 *
 * Flags are int64 words in MAP_SHARED memory with a futex sleeper count beside them (flags.h); a peer's
 * liveness handle is its pidfd (readable, or hung up, once the process exited); bytes move with the CPU
 * kernels of reduce.c (OpenMP-split memcpy, streaming stores, SIMD reductions). */
#define _GNU_SOURCE
#include <poll.h>

#include "../core/transport.h"
#include "flags.h"
#include "reduce.h"
#include "transport_cpu.h"

static int64_t cpu_load(const int64_t *p) { return __atomic_load_n(p, __ATOMIC_SEQ_CST); }

static int cpu_raise_to(int64_t *p, int64_t v) {
    int64_t cur = __atomic_load_n(p, __ATOMIC_SEQ_CST);
    while (cur < v)
        if (__atomic_compare_exchange_n(p, &cur, v, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) return 1;
    return 0;
}

static void cpu_sleep_on(int64_t *p, int64_t target, int64_t ns) { zb_flag_sleep(p, target, 0, ns); }

static int cpu_peer_gone(int fd) {
    struct pollfd pf = {fd, POLLIN | POLLRDHUP, 0};
    return poll(&pf, 1, 0) > 0 && pf.revents;
}

static void cpu_copy(void *dst, const void *src, long nbytes, int nthreads, int stream) {
    if (stream) zb_copy_stream(dst, src, nbytes, nthreads);
    else zb_copy(dst, src, nbytes, nthreads);
}

static void cpu_reduce(void *dst, const void *const *srcs, long n, long count, int dtype, int op, double divisor,
                       int nthreads, int stream) {
    if (stream) zb_reduce_n_stream(dst, srcs, n, count, dtype, op, divisor, nthreads);
    else zb_reduce_n(dst, srcs, n, count, dtype, op, divisor, nthreads);
}

const zb_transport zb_cpu_transport = {
    .name = "cpu",
    .load = cpu_load,
    .signal = zb_flag_signal,
    .raise_to = cpu_raise_to,
    .sleep_on = cpu_sleep_on,
    .peer_gone = cpu_peer_gone,
    .copy = cpu_copy,
    .copy_rows = zb_copy_rows,
    .reduce = cpu_reduce,
    .reduce_valid = zb_reduce_valid,
};
