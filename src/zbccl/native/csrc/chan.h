/* zbccl native op channel: shared declarations of chan.c (waits, handshake) and chan_ops.c (ops). */
#ifndef ZBCCL_CHAN_H
#define ZBCCL_CHAN_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define ZB_MAXW 256
#define HDR_FIELDS 16
/* header fields (zbccl/ops/channel.py Header) */
enum { H_SEQ, H_OP, H_DTYPE, H_REDOP, H_IN_NUMEL, H_OUT_NUMEL, H_IN_OFF, H_OUT_OFF, H_ALGO, H_ROOT, H_ROW,
       H_DIGEST, H_ERROR, H_AUX, H_PHASE_BASE };
/* H_ERROR values: the kind of error a rank posts (channel.py ERR_*) */
#define ERR_USAGE 1
#define ERR_NOMEM 2
/* ABORT line: value (seq) at +0, futex waiters at +8, reason at +16 (channel.py ABORT_*) */
#define ABORT_INTERRUPT 1
/* int64 entries of a rank's size-vector area (channel.py VECTOR_CAPACITY) */
#define VEC_CAP 960
/* result codes, mirrored in zbccl/ops/fastpath.py */
enum { RC_OK = 0, RC_TIMEOUT = 1, RC_DEAD = 2, RC_GONE = 3, RC_MISMATCH = 4, RC_STEP = 5, RC_SPAN = 6,
       RC_PEER_ERROR = 7, RC_SPLITS = 8, RC_FALLBACK = 9, RC_INTERRUPTED = 10, RC_NOMEM = 11, RC_SIZES = 12,
       RC_ABORTED = 13 };
#define STATE_FINALIZED 2
#define STATE_FAILED 3
#define ALGO_ONESHOT 1
#define ALGO_PUSH 4
#define OP_ALL_REDUCE 1
#define OP_ALL_GATHER 2
#define OP_REDUCE_SCATTER 3
#define OP_ALL_TO_ALL 4
#define OP_BROADCAST 5

typedef struct {
    int64_t W, me, spin, liveness_ns, timeout_ns, nthreads;
    int64_t stream_bytes;   /* twoshot gathers at least this large use streaming stores (Python sets it) */
    int64_t *arrive[ZB_MAXW], *phase[ZB_MAXW], *done[ZB_MAXW], *hdr[ZB_MAXW], *state[ZB_MAXW], *vec[ZB_MAXW];
    int64_t *abort[ZB_MAXW];   /* each rank's ABORT line: non-zero once it left an op half-way */
    int64_t phase_base;        /* max of every rank's posted PHASE value: step k of this op is base + k */
    char *base[ZB_MAXW];
    int64_t *size[ZB_MAXW];   /* each rank's live heap size: its header's HEAP_BYTES word (heaps grow) */
    int fd[ZB_MAXW];
    int64_t result[4];            /* code, rank, field, 0 */
    int64_t late_mask[ZB_MAXW / 64];  /* on RC_TIMEOUT: the peers whose flag never reached the target */
    int64_t hdrcopy[ZB_MAXW][HDR_FIELDS];
    /* size-vector areas a failed op's message needs, copied before its DONE handshake (a peer may
     * overwrite its area with its next op right after): an error text, or two ranks' sizes/splits */
    int64_t veccopy[2][VEC_CAP];
    char *scratch;
    int64_t scratch_bytes;
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
/* Post this rank's header (fields 1..15 of `mine`, then SEQ), ARRIVE, and check `fields`. On a
 * disagreement the DONE handshake is done before returning the code. */
int begin_op(zb_chan *c, int64_t seq, const int64_t *mine, const int *fields, int nfields);
/* End an op that failed after ARRIVE: DONE handshake, then the original code. */
int fail_op(zb_chan *c, int64_t seq, int rc);
int zb_add_chan_ops(PyObject *module);
/* A Python int as int64 (-1 and an exception on failure). */
int zb_i64(PyObject *o, int64_t *out);

#endif
