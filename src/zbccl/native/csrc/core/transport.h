/* zbccl native core: what the protocol needs from a transport (zb_transport) and from its caller (zb_hooks).
 *
 * The protocol engine (core/chan.c, core/chan_ops.c, core/kind.c) is a state machine over these two tables:
 * it never touches a flag, a peer's liveness handle or a byte range except through them, and it includes
 * no Python header. A transport supplies the verbs below (the CPU transport: cpu/transport.c over shared
 * host memory, futexes and pidfds; CUDA and inter-host transports add their own table); the caller that
 * runs an op supplies zb_hooks (the CPython binding, py/chan_py.c: the GIL and Ctrl-C).
 *
 * Flag words follow the flag layout of abi.WORDS: the value at W_VALUE, a sleeper count at W_WAITERS. What
 * each verb guarantees:
 *   load        a sequentially consistent load of a flag word (the handshake's Dekker pairs rely on it:
 *               store ARRIVE, load the peers' ARRIVE, see abi.py and chan.c leave_op). On x86 and AArch64 it
 *               costs what an acquire load costs.
 *   signal      a sequentially consistent store of v, then wake every sleeper of the flag; every write the
 *               caller made before it is visible to a peer that loads v.
 *   raise_to    atomically (seq_cst) set the flag to v if its value is below v: 1 if this call did, 0 if the
 *               value was already >= v (the oneshot all_reduce's election: exactly one rank wins a claim).
 *   sleep_on    block the caller until the flag's value >= target or about ns passed (it may return early,
 *               spuriously); never returns later than ns plus the scheduler's latency.
 *   peer_gone   non-blocking liveness probe of a peer's handle (abi.CHAN_ROW FD, -1: none): 1 once the peer
 *               process is gone, 0 while it lives (or the transport cannot tell).
 *   copy        dst <- src, nbytes bytes, split over nthreads for large sizes; stream = 1: stores that skip
 *               the read for ownership (non-temporal) and a closing store fence.
 *   copy_rows   rows blocks of rowbytes, row i from src + i*src_stride to dst + i*dst_stride (stream as copy).
 *   reduce      dst[i] = op over srcs[0..n-1][i] for i < count elements (zb_abi.h dtype/op codes), AVG divides
 *               by divisor; dst may alias a source; stream as copy.
 *   reduce_valid 1 if the transport's kernels support the (dtype, op) pair.
 * copy, copy_rows and reduce are ordered before the caller's next signal (cpu: plain stores plus the fences
 * the stream kinds end with). All verbs are thread-safe and never block except sleep_on.
 *
 * Why per-flag verbs are indirect calls, not static inline for the CPU: one indirect call per flag load
 * costs about a nanosecond against a handshake of a microsecond. Measured when the table came in (2-core
 * VM, world 2, `zbccl bench --ops all_reduce --dtypes fp32 --quick`, four runs alternating with the
 * inline build): fp32 all_reduce 4 KiB 1.03-1.07 us inline, 0.99-1.08 us through the table; 64 KiB
 * 2.88-2.96 against 2.82-2.90. No difference beyond the runs' spread, so the core stays transport-blind. */
#ifndef ZBCCL_TRANSPORT_H
#define ZBCCL_TRANSPORT_H
#include <stdint.h>

typedef struct zb_transport {
    const char *name;
    int64_t (*load)(const int64_t *flag);
    void (*signal)(int64_t *flag, int64_t v);
    int (*raise_to)(int64_t *flag, int64_t v);
    void (*sleep_on)(int64_t *flag, int64_t target, int64_t ns);
    int (*peer_gone)(int fd);
    void (*copy)(void *dst, const void *src, long nbytes, int nthreads, int stream);
    void (*copy_rows)(void *dst, long dst_stride, const void *src, long src_stride, long rows, long rowbytes,
                      int nthreads, int stream);
    void (*reduce)(void *dst, const void *const *srcs, long n, long count, int dtype, int op, double divisor,
                   int nthreads, int stream);
    int (*reduce_valid)(int dtype, int op);
} zb_transport;

/* What the core asks of the thread that runs an op, set per call (py/chan_py.c installs the CPython ones):
 *   block          the op is about to wait or copy for long: let other threads of the caller run (release
 *                  the GIL). Called at most once per op; the caller undoes it after the op returns.
 *   check_signals  a long wait asks whether the caller was interrupted (Ctrl-C): 1 ends the op with
 *                  RC_INTERRUPTED (the caller raises its own exception), 0 goes on.
 * Either may be NULL (a C caller with no interpreter). ctx is passed back unchanged. */
typedef struct zb_hooks {
    void (*block)(void *ctx);
    int (*check_signals)(void *ctx);
    void *ctx;
} zb_hooks;

#endif
