/* zbccl CPU transport: flag words, futex sleeps and waits over a set of flags (see flags.h). */
#include "flags.h"

#include <limits.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define YIELD_PHASE_NS 50000LL
#define SLEEP_MIN_NS 50000LL
#define SLEEP_MAX_NS 2000000LL

uint64_t zb_mono_ns(void) {
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

static inline int32_t *waiters_of(int64_t *p) { return (int32_t *)((char *)p + WAITERS_OFFSET); }

/* Wake the flag's sleepers if any; the caller's preceding store must be seq_cst. */
static inline void wake_if_waiters(int64_t *p) {
    if (__atomic_load_n(waiters_of(p), __ATOMIC_SEQ_CST) > 0)
        syscall(SYS_futex, low_word(p), FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

void zb_flag_signal(int64_t *p, int64_t v) {
    /* seq_cst (not just release) so the waiters load below cannot move before it. */
    __atomic_store_n(p, v, __ATOMIC_SEQ_CST);
    wake_if_waiters(p);
}

int64_t zb_flag_add_signal(int64_t *p, int64_t d) {
    int64_t old = __atomic_fetch_add(p, d, __ATOMIC_SEQ_CST);
    wake_if_waiters(p);
    return old;
}

static inline int satisfied(int64_t v, int64_t target, int eq) { return eq ? v == target : v >= target; }

int zb_flag_sleep(int64_t *p, int64_t target, int eq, int64_t ns) {
    int32_t *waiters = waiters_of(p);
    int slept = 0;
    __atomic_fetch_add(waiters, 1, __ATOMIC_SEQ_CST);
    int64_t v = __atomic_load_n(p, __ATOMIC_SEQ_CST);
    if (!satisfied(v, target, eq)) {
        struct timespec ts = {(time_t)(ns / 1000000000LL), (long)(ns % 1000000000LL)};
        syscall(SYS_futex, low_word(p), FUTEX_WAIT, (uint32_t)(uint64_t)v, &ts, NULL, 0);
        slept = 1;
    }
    __atomic_fetch_sub(waiters, 1, __ATOMIC_SEQ_CST);
    return slept;
}

long zb_waitset_scan(const zb_waitset *w, long i) {
    for (; i < w->n; i++) {
        int64_t v = __atomic_load_n((int64_t *)w->addrs[i], __ATOMIC_ACQUIRE);
        if (!satisfied(v, w->target, w->eq)) break;
    }
    return i;
}

/* How long a wait keeps polling (yielding the core between polls) before it sleeps on the futex:
 * set_wait_poll, once per process at init (runtime/state.py picks it from the ranks' cores). */
static int64_t poll_phase_ns = YIELD_PHASE_NS;

void zb_set_wait_poll(int64_t ns) {
    __atomic_store_n(&poll_phase_ns, ns < YIELD_PHASE_NS ? YIELD_PHASE_NS : ns, __ATOMIC_RELAXED);
}

long zb_waitset_block(const zb_waitset *w, long i, uint64_t deadline) {
    uint64_t t = zb_mono_ns();
    uint64_t yield_end = t + (uint64_t)__atomic_load_n(&poll_phase_ns, __ATOMIC_RELAXED);
    while (t < deadline && t < yield_end) {
        sched_yield();
        i = zb_waitset_scan(w, i);
        if (i == w->n) return i;
        t = zb_mono_ns();
    }
    int64_t sleep_ns = SLEEP_MIN_NS;
    while ((t = zb_mono_ns()) < deadline) {
        uint64_t left = deadline - t;
        zb_flag_sleep((int64_t *)w->addrs[i], w->target, w->eq, (uint64_t)sleep_ns < left ? sleep_ns : (int64_t)left);
        i = zb_waitset_scan(w, i);
        if (i == w->n) return i;
        sleep_ns = sleep_ns * 2 > SLEEP_MAX_NS ? SLEEP_MAX_NS : sleep_ns * 2;
    }
    return zb_waitset_scan(w, i);
}
