/* zbccl native op channel: shared declarations of chan.c (waits, handshake), chan_ops.c (ops) and kind.c
 * (the store-kind learner). Pure C: no Python header (py/ holds the binding; tests/unit/test_native_layers.py
 * checks). Every constant (header fields H_*, op and algorithm codes, RC_*, ERR_*, ABORT_*, VEC_CAP, the
 * argument struct zb_op) comes from zb_abi.h, generated from zbccl/native/abi.py. */
#ifndef ZBCCL_CHAN_H
#define ZBCCL_CHAN_H
#include <stdint.h>

#include "transport.h"
#include "zb_abi.h"

/* Per log2 size bucket (kind.c, core policy): each store kind's cost (EWMA of ns per byte), samples taken, time of the last. */
#define KIND_BUCKETS 64
#define KIND_HIST 4
typedef struct {
    double rate[2], hist[2][KIND_HIST]; /* rate: the least of the last KIND_HIST samples (ns per byte) */
    int64_t seen[2], last_ns[2];
    int64_t ops, explore_at, interval; /* ops of the bucket; the op that re-measures the other kind; backoff */
    int64_t prev, run;                 /* kind of the last op (+1; 0 none); ops left of an exploring run */
} zb_kind;

typedef struct {
    const zb_transport *tp; /* every flag, liveness probe and byte moved goes through it */
    zb_hooks hooks;         /* the running op's caller (set per op by zb_chan_run's caller) */
    int blocked;            /* 1 once this op called hooks.block */
    int64_t W, me, spin, liveness_ns, timeout_ns, nthreads;
    int64_t poll_ns; /* how long a wait polls (yielding between polls) before it sleeps on the futex */
    /* Store kind of all_reduce's pushes (see kind.c "Store kind"): -1 auto, 0 cached, 1 streaming */
    int64_t kind_mode;
    zb_kind kinds[KIND_BUCKETS];
    int64_t *arrive[ZB_MAXW], *phase[ZB_MAXW], *done[ZB_MAXW], *hdr[ZB_MAXW], *state[ZB_MAXW], *vec[ZB_MAXW];
    int64_t *abort[ZB_MAXW];   /* each rank's ABORT line: non-zero once it left an op half-way */
    int64_t *rabort[ZB_MAXW];  /* each rank's own ABORT line (the world slot's; words W_*): any op it left */
    /* group rank 0's ELECT line (oneshot all_reduce, chan_ops.c): word W_VALUE 2*seq once a rank claimed op
     * seq, 2*seq+1 once it finished (futex waiters in W_WAITERS); W_RC its result code, W_RANK, W_FIELD */
    int64_t *elect;
    int64_t phase_base;        /* max of every rank's posted PHASE value: step k of this op is base + k */
    char *base[ZB_MAXW];
    /* each rank's published heap size word (segment header HEAP_BYTES): heaps may grow during the
     * job, never shrink, so operands are checked against the size read (acquire) at check time */
    int64_t *size[ZB_MAXW];
    int fd[ZB_MAXW];
    int64_t grank[ZB_MAXW];   /* each channel rank's world rank (the CAUSE and VIA words of ABORT lines) */
    int64_t result[4];            /* code, rank, field, rank still writing into us + 1 (leave_op) */
    int64_t late_mask[ZB_MAXW / 64];  /* on RC_TIMEOUT: the peers whose flag never reached the target */
    int64_t hdrcopy[ZB_MAXW][HDR_FIELDS];
    /* size-vector areas a failed op's message needs, copied before its DONE handshake (a peer may
     * overwrite its area with its next op right after): an error text, or two ranks' sizes/splits */
    int64_t veccopy[2][VEC_CAP];
    char *scratch;
    int64_t scratch_bytes;
    /* chan_phases(handle, 1): all_reduce records where its time goes (ns): arrive, reduce, push, done;
     * summed over an op's chunks, overwritten by the next op */
    int64_t trace, phase_ns[4];
    /* the protocol (WHERE_*) this rank reports on its ABORT lines when it leaves the running op half-way:
     * WHERE_COLLECTIVE, or a barrier's own (zb_op.aux: the communicator's barrier, EP's tagged barrier) */
    int64_t where;
} zb_chan;

/* The core's entry points (py/chan_py.c binds them; a C caller may use them directly). */
/* A channel over transport tp: W ranks, this one me, table int64[W][CR_COLUMNS] (abi.CHAN_ROW). NULL: no
 * memory, or W/me out of range. */
zb_chan *zb_chan_new(const zb_transport *tp, int64_t W, int64_t me, int64_t spin, int64_t liveness_ns,
                     int64_t timeout_ns, int64_t nthreads, const int64_t *table, int64_t poll_ns);
void zb_chan_free(zb_chan *c);
/* 0 if `o` may run on c's transport, 1 for bad op arguments (op, nvec, timeout), 2 for a bad dtype/op pair. */
int zb_op_check(const zb_chan *c, const zb_op *o);
/* Run one op from start to end (the caller holds the channel's lock): an RC_* code, or -1 when zb_op_check
 * refuses it. Calls c->hooks.block before long waits and large copies. On any way of leaving the op half-way
 * it marks this rank's ABORT line and returns once no peer writes into this rank (leave_op). */
int zb_chan_run(zb_chan *c, zb_op *o);

/* Let the caller's other threads run (once per op). */
void chan_block(zb_chan *c);
static inline void signal_flag(zb_chan *c, int64_t *p, int64_t v) { c->tp->signal(p, v); }
static inline int64_t ld(const zb_chan *c, const int64_t *p) { return c->tp->load(p); }
/* Wait until flags[r] >= target for every peer r (spin, yield, futex; liveness and timeout). */
int wait_all(zb_chan *c, int64_t **flags, int64_t target);
/* Signal our flag = seq, then wait_all. */
int sync_on(zb_chan *c, int64_t **flags, int64_t seq);
/* Copy every header, check sequence numbers, error flags and agreement on `fields`. */
int check_headers(zb_chan *c, int64_t seq, const int *fields, int nfields);
/* The oneshot all_reduce's election word (chan_ops.c): claim op `seq` (1 for exactly one rank), and
 * release it with the claimant's verdict `rc` (result[1], result[2] with it). */
int elect_claim(zb_chan *c, int64_t seq);
void elect_release(zb_chan *c, int64_t seq, int rc);
/* Post this rank's header: the leading header fields of `o`, then SEQ (the caller signals ARRIVE). */
void post_header(zb_chan *c, const zb_op *o);
/* Post this rank's header (the leading header fields of `o`, then SEQ), ARRIVE, and check `fields`.
 * On a disagreement the DONE handshake is done before returning the code. */
int begin_op(zb_chan *c, const zb_op *o, const int *fields, int nfields);
/* 1 (result[1] = rank) if a peer left an op half-way (its ABORT line); call before writing into peers. */
int peer_left(zb_chan *c);
/* 1 (result[1] = the rank, one that left by its own cause first) if a peer's ABORT line, its own or this
 * channel's, is set: it left some op half-way. */
int peer_aborted(zb_chan *c);
/* This rank leaves op `seq` half-way for `why` (ABORT_*): mark ABORT, wait until no peer writes into us. */
void leave_op(zb_chan *c, int64_t seq, int why);
/* End an op that failed after ARRIVE: DONE handshake, then the original code. */
int fail_op(zb_chan *c, int64_t seq, int rc);
/* Run one op described by `o` (dispatch on o->op); returns an RC_* code. */
int run_op(zb_chan *c, zb_op *o);
/* kind.c: the store kind of all_reduce's pushes (core policy, see kind.c). */
int kind_choose(zb_chan *c, int64_t nbytes, int64_t now);
void kind_learn(zb_chan *c, int64_t nbytes, int kind, int64_t start, int64_t now);
/* Forget what auto learnt and use `mode` (-1 auto, 0 cached, 1 streaming). */
void zb_chan_configure(zb_chan *c, int64_t mode);

#endif
