/* zbccl native op channel: shared declarations of chan.c (waits, handshake) and chan_ops.c (ops).
 * Every constant (header fields H_*, op and algorithm codes, RC_*, ERR_*, ABORT_*, VEC_CAP, the
 * argument struct zb_op) comes from zb_abi.h, generated from zbccl/native/abi.py. */
#ifndef ZBCCL_CHAN_H
#define ZBCCL_CHAN_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "zb_abi.h"

/* Per log2 size bucket: each store kind's cost (EWMA of ns per byte), samples taken, time of the last. */
#define KIND_BUCKETS 64
#define KIND_HIST 4
typedef struct {
    double rate[2], hist[2][KIND_HIST]; /* rate: the least of the last KIND_HIST samples (ns per byte) */
    int64_t seen[2], last_ns[2];
    int64_t ops, explore_at, interval; /* ops of the bucket; the op that re-measures the other kind; backoff */
    int64_t prev, run;                 /* kind of the last op (+1; 0 none); ops left of an exploring run */
} zb_kind;

typedef struct {
    int64_t W, me, spin, liveness_ns, timeout_ns, nthreads;
    int64_t poll_ns; /* how long a wait polls (yielding between polls) before it sleeps on the futex */
    /* Store kind of all_reduce's pushes (see chan_ops.c "Store kind"): -1 auto, 0 cached, 1 streaming */
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
    int gil_held;           /* 1 while the calling thread still holds the GIL */
    PyThreadState *saved;   /* its thread state once a long wait released the GIL */
} zb_chan;


void gil_release(zb_chan *c);
void signal_flag(int64_t *p, int64_t v);
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
/* This rank leaves op `seq` half-way for `why` (ABORT_*): mark ABORT, wait until no peer writes into us. */
void leave_op(zb_chan *c, int64_t seq, int why);
/* End an op that failed after ARRIVE: DONE handshake, then the original code. */
int fail_op(zb_chan *c, int64_t seq, int rc);
/* Run one op described by `o` (dispatch on o->op); returns an RC_* code. */
int run_op(zb_chan *c, zb_op *o);
int zb_add_chan_ops(PyObject *module);
/* A Python int as int64 (-1 and an exception on failure). */
int zb_i64(PyObject *o, int64_t *out);

#endif
