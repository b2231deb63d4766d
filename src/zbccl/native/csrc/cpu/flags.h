/* zbccl CPU transport: flag words in shared host memory (atomics, futex sleeps, waits over a set of flags).
 *
 * Every address points into memory that several processes map (MAP_SHARED), so all futex calls are
 * *shared* (no FUTEX_PRIVATE_FLAG). Flag layout (abi.WORDS; one 64-byte line per flag, so flags never
 * share a line and a poll never bounces a neighbour's line):
 *
 *     +0   int64  value     written with store-release / seq_cst by the signaller
 *     +8   int32  waiters   number of processes futex-sleeping on this flag (word W_WAITERS)
 *
 * Synchronisation protocol (Dekker-style, both sides seq_cst):
 *   signaller: store value; load waiters; if > 0: FUTEX_WAKE(low 32 bits of value)
 *   waiter:    waiters += 1; load value; if unsatisfied: FUTEX_WAIT(low word, seen); waiters -= 1
 * Either the signaller sees waiters > 0 and wakes, or the waiter's re-check sees the new value; FUTEX_WAIT
 * itself also refuses to sleep when the low word already changed. A change by an exact multiple of 2^32
 * would be missed by the kernel compare, so every sleep is bounded. */
#ifndef ZBCCL_CPU_FLAGS_H
#define ZBCCL_CPU_FLAGS_H
#include <stdint.h>

#include "zb_abi.h"

#define FLAG_BYTES 64
#define WAITERS_OFFSET (W_WAITERS * 8) /* abi.WORDS */

uint64_t zb_mono_ns(void);
/* seq_cst store of v, then wake the flag's sleepers if any. */
void zb_flag_signal(int64_t *p, int64_t v);
/* seq_cst add of d, then wake the flag's sleepers if any; returns the old value. */
int64_t zb_flag_add_signal(int64_t *p, int64_t d);
/* One bounded futex sleep while the flag is below target (or != target with eq = 1). 1 if the flag was
 * unsatisfied and the sleep ran, 0 if it was already satisfied. */
int zb_flag_sleep(int64_t *p, int64_t target, int eq, int64_t ns);

/* A set of flags to wait on: every flag >= target (eq = 0) or == target (eq = 1). */
typedef struct {
    const uint64_t *addrs;
    long n;
    int64_t target;
    int eq;
} zb_waitset;

/* The first index >= i whose flag is unsatisfied, or n. */
long zb_waitset_scan(const zb_waitset *w, long i);
/* The yield then futex phases (the caller has spun and released its GIL): the first unsatisfied index once
 * `deadline` (CLOCK_MONOTONIC ns) passed, or n. Polls, yielding the core, for the process's poll phase. */
long zb_waitset_block(const zb_waitset *w, long i, uint64_t deadline);
/* How long zb_waitset_block polls before it sleeps (at least 50 us); process-wide. */
void zb_set_wait_poll(int64_t ns);

#endif
