/* zbccl native op channel: waits and the handshake shared by the native ops (chan_ops.c).
 *
 * The native ops are the only protocol of zbccl/ops/ at world size >= 2: each
 * runs a whole collective in one call (chan_run, one zb_op argument struct
 * whose layout and every constant come from zbccl/native/abi.py):
 *
 *   post header (16 int64) -> ARRIVE=seq -> wait every peer's ARRIVE >= seq
 *   -> check all headers agree -> move bytes (oneshot or twoshot)
 *   -> [PHASE] -> DONE=seq -> wait every peer's DONE >= seq
 *
 * Python validates, decides the algorithm, stages operands that are not in
 * the heap and owns every policy but one: the store kind of all_reduce's pushes, which the core learns
 * from its own op timings (core policy, kind.c; Python only picks auto or a fixed kind). This file moves
 * no bytes itself: it waits and hands off to the transport (transport.h), and includes no Python header
 * (the GIL and Ctrl-C reach it as zb_hooks). Waits spin `spin` polls, then yield between polls for
 * `poll_ns` (at least 50 us; the caller's GIL kept), then call hooks.block (the binding releases the GIL)
 * and sleep on the flag (transport sleep_on; the CPU transport's futex, flag layout abi.WORDS), and
 * every `liveness_ns` they apply the one liveness rule (zbccl/runtime/liveness.py;
 * check_peers below is its C twin): this rank finalized; any peer's ABORT line
 * set (its own, the world slot's, or this channel's: it left an op half-way, in
 * any protocol); a late peer failed, finalized or dead (pidfd). Each ends the
 * wait at once with the rank. An op
 * interrupted here marks this rank's own ABORT line before returning, so its
 * peers learn it within a liveness interval instead of the timeout. Errors are returned as codes; detail (rank, field) and a copy of
 * all headers taken before the DONE handshake stay in the channel for Python
 * to format the message.
 */
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "arch.h"
#include "chan.h"

/* A wait that outlasts the spin and yield phases lets the caller's other threads run (the GIL). */
void chan_block(zb_chan *c) {
    if (!c->blocked) {
        c->blocked = 1;
        if (c->hooks.block) c->hooks.block(c->hooks.ctx);
    }
}

/* Whether the caller was interrupted during a long wait (Ctrl-C); 1 ends the op. */
static int check_signals(zb_chan *c) { return c->hooks.check_signals && c->hooks.check_signals(c->hooks.ctx); }

static inline uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* The ABORT reason of rank r (its own line first, then this channel's), 0 if it left no op half-way. */
static int64_t abort_why(zb_chan *c, int r) {
    if (ld(c, c->rabort[r])) return c->rabort[r][W_WHY] ? c->rabort[r][W_WHY] : ABORT_EXCEPTION;
    if (ld(c, c->abort[r])) return c->abort[r][W_WHY] ? c->abort[r][W_WHY] : ABORT_EXCEPTION;
    return 0;
}

/* The liveness rule of zbccl/runtime/liveness.py `check`, in the same order:
 * 1. this rank finalized (another thread): RC_GONE with result[1] = our own rank;
 * 2. any peer (not only the late ones) left an op half-way by its own cause: RC_ABORTED with its rank;
 * 3. a peer we still wait for failed or finalized (RC_GONE) or died (RC_DEAD);
 * 4. any peer left an op because a peer did (ABORT_PEER): RC_ABORTED with its rank.
 * Peers whose flag already reached the target are not checked for death: they may exit at will. */
static int check_peers(zb_chan *c, int64_t **flags, int64_t target) {
    int left = -1;
    /* finalize() on this rank (another thread) marks our own STATE first, then waits for us to leave. */
    if (ld(c, c->state[c->me]) == STATE_FINALIZED) {
        c->result[1] = c->me;
        return RC_GONE;
    }
    for (int r = 0; r < c->W; r++) {
        if (r == c->me) continue;
        int64_t why = abort_why(c, r);
        if (why && (left < 0 || why != ABORT_PEER)) left = r;
        if (why && why != ABORT_PEER) break;
    }
    if (left >= 0 && abort_why(c, left) != ABORT_PEER) {
        c->result[1] = left;
        return RC_ABORTED;
    }
    for (int r = 0; r < c->W; r++) {
        if (r == c->me || ld(c, flags[r]) >= target) continue;
        int64_t st = ld(c, c->state[r]);
        if (st == STATE_FINALIZED || st == STATE_FAILED) {
            c->result[1] = r;
            return RC_GONE;
        }
        if (c->fd[r] >= 0 && c->tp->peer_gone(c->fd[r])) {
            c->result[1] = r;
            return RC_DEAD;
        }
    }
    if (left >= 0) {
        c->result[1] = left;
        return RC_ABORTED;
    }
    return 0;
}

int peer_aborted(zb_chan *c) {
    int left = -1;
    for (int r = 0; r < c->W; r++) {
        if (r == c->me) continue;
        int64_t why = abort_why(c, r);
        if (why && (left < 0 || why != ABORT_PEER)) left = r;
        if (why && why != ABORT_PEER) break;
    }
    if (left < 0) return 0;
    c->result[1] = left;
    return 1;
}

/* 1 (and result[1] = the rank) if a peer left an op half-way: ranks write into peers' tensors only
 * after this check, made after their own ARRIVE with a full fence between (see leave_op). */
int peer_left(zb_chan *c) {
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    for (int r = 0; r < c->W; r++)
        if (r != c->me && ld(c, c->abort[r])) {
            c->result[1] = r;
            return 1;
        }
    return 0;
}

/* Whether peer r may still work on op `seq`: it arrived, has not signalled DONE, has not left (ABORT),
 * is not finalized or failed, and is alive. */
static int peer_in_op(zb_chan *c, int r, int64_t seq) {
    if (ld(c, c->arrive[r]) < seq || ld(c, c->done[r]) >= seq || ld(c, c->abort[r])) return 0;
    int64_t st = ld(c, c->state[r]);
    if (st == STATE_FINALIZED || st == STATE_FAILED) return 0;
    return c->fd[r] < 0 || !c->tp->peer_gone(c->fd[r]);
}

/* This rank leaves op `seq` half-way (timeout, interrupt, a lost peer): it marks its ABORT line, then
 * waits until no peer can still write into its memory (twoshot all_reduce and the push exchanges write
 * into peers' tensors). Against a peer arriving at the same moment the two orders are fenced as in
 * Dekker's algorithm: we store ABORT, then load the peer's ARRIVE; the peer stores ARRIVE, then loads
 * our ABORT (peer_left) before it writes into us. So either it sees our ABORT and writes nothing, or we
 * see its ARRIVE and wait until it finished (DONE), left too (ABORT), was finalized or died, for at most
 * LEAVE_WAIT_NS; a peer still in the op after that is reported in result[3] (its rank + 1). */
#define LEAVE_WAIT_NS 10000000000LL
static void mark_abort(zb_chan *c, int64_t *line, int64_t seq, int why, int64_t cause, int64_t via) {
    if (ld(c, line)) return; /* the first reason stays */
    line[W_WHY] = why, line[W_WHERE] = c->where ? c->where : WHERE_COLLECTIVE;
    line[W_CAUSE] = cause, line[W_VIA] = via;
    signal_flag(c, line, seq > 0 ? seq : 1); /* seq_cst: the words are visible with it */
}

/* The chain of a leave for `why` (abi.WORDS CAUSE, VIA: world rank + 1): a timeout or a lost peer goes back
 * to result[1], the rank waited for (late, dead, finalized) or that left first; that rank's CAUSE when it
 * left an op itself (its own line, else this channel's), else that rank. A Ctrl-C's cause is this rank. */
static void chain_of(zb_chan *c, int why, int64_t *cause, int64_t *via) {
    int64_t q = c->result[1];
    *cause = c->grank[c->me] + 1, *via = 0;
    if ((why != ABORT_PEER && why != ABORT_TIMEOUT) || q < 0 || q >= c->W || q == c->me) return;
    *via = c->grank[q] + 1;
    *cause = *via;
    int64_t *lines[2] = {c->rabort[q], c->abort[q]};
    for (int i = 0; i < 2; i++)
        if (ld(c, lines[i]) && lines[i][W_CAUSE] > 0) {
            *cause = lines[i][W_CAUSE];
            break;
        }
}

void leave_op(zb_chan *c, int64_t seq, int why) {
    int64_t cause, via;
    chain_of(c, why, &cause, &via);
    mark_abort(c, c->abort[c->me], seq, why, cause, via);
    mark_abort(c, c->rabort[c->me], seq, why, cause, via); /* this rank's own line: every wait of every peer reads it */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    uint64_t deadline = now_ns() + (uint64_t)(c->timeout_ns < LEAVE_WAIT_NS ? c->timeout_ns : LEAVE_WAIT_NS);
    for (int r = 0; r < c->W; r++) {
        int64_t sleep_ns = 20000;
        while (r != c->me && peer_in_op(c, r, seq)) {
            if (now_ns() > deadline) {
                c->result[3] = r + 1;
                break;
            }
            c->tp->sleep_on(c->done[r], seq, sleep_ns);
            sleep_ns = sleep_ns * 2 > 1000000 ? 1000000 : sleep_ns * 2;
        }
    }
}

/* Wait until flags[r] >= target for every peer r. */
int wait_all(zb_chan *c, int64_t **flags, int64_t target) {
    int r = 0;
    for (int64_t s = 0; s <= c->spin; s++) {
        while (r < c->W && (r == c->me || ld(c, flags[r]) >= target)) r++;
        if (r == c->W) return RC_OK;
        cpu_relax();
    }
    uint64_t start = now_ns(), t = start, next_check = start + (uint64_t)c->liveness_ns;
    uint64_t deadline = start + (uint64_t)c->timeout_ns;
    int64_t sleep_ns = 20000;
    while (1) {
        while (r < c->W && (r == c->me || ld(c, flags[r]) >= target)) r++;
        if (r == c->W) return RC_OK;
        if (t >= next_check) {
            int rc = check_peers(c, flags, target);
            if (rc) return rc;
            if (check_signals(c)) return RC_INTERRUPTED;
            next_check = t + (uint64_t)c->liveness_ns;
        }
        if (t >= deadline) {
            c->result[1] = r;
            memset(c->late_mask, 0, sizeof(c->late_mask));
            for (int q = 0; q < c->W; q++)
                if (q != c->me && ld(c, flags[q]) < target) c->late_mask[q / 64] |= 1ull << (q % 64);
            return RC_TIMEOUT;
        }
        if (t - start < 50000) {
            sched_yield();
        } else if (t - start < (uint64_t)c->poll_ns) {
            /* a rank with its own core keeps polling, and keeps the GIL: another thread of the process that
             * took it (an engine's output thread) could delay this op's return by a switch interval (5 ms) */
            sched_yield();
        } else {
            chan_block(c);
            c->tp->sleep_on(flags[r], target, sleep_ns);
            sleep_ns = sleep_ns * 2 > 1000000 ? 1000000 : sleep_ns * 2;
        }
        t = now_ns();
    }
}

int sync_on(zb_chan *c, int64_t **flags, int64_t seq) {
    signal_flag(c, flags[c->me], seq);
    return wait_all(c, flags, seq);
}

/* After ARRIVE: copy headers, check sequence numbers and agreement on `fields`. */
int check_headers(zb_chan *c, int64_t seq, const int *fields, int nfields) {
    for (int r = 0; r < c->W; r++) memcpy(c->hdrcopy[r], c->hdr[r], sizeof(c->hdrcopy[r]));
    c->phase_base = 0;
    for (int r = 0; r < c->W; r++)
        if (c->hdrcopy[r][H_PHASE_BASE] > c->phase_base) c->phase_base = c->hdrcopy[r][H_PHASE_BASE];
    for (int r = 0; r < c->W; r++)
        if (c->hdrcopy[r][H_SEQ] != seq) { c->result[1] = r; return RC_STEP; }
    for (int r = 0; r < c->W; r++)
        if (c->hdrcopy[r][H_ERROR]) {
            c->result[1] = r;
            c->result[2] = c->hdrcopy[r][H_ERROR];
            memcpy(c->veccopy[0], c->vec[r], sizeof(c->veccopy[0])); /* its error text */
            return c->hdrcopy[r][H_ERROR] == ERR_NOMEM ? RC_NOMEM : RC_PEER_ERROR;
        }
    for (int f = 0; f < nfields; f++)
        for (int r = 1; r < c->W; r++)
            if (c->hdrcopy[r][fields[f]] != c->hdrcopy[0][fields[f]]) {
                c->result[1] = r;
                c->result[2] = fields[f];
                return RC_MISMATCH;
            }
    return RC_OK;
}

void post_header(zb_chan *c, const zb_op *o) {
    /* A seqlock for the one reader that may race with the next header (the barrier, chan_ops.c): SEQ is 0
     * while the fields change and the op's number once they are written. Every other reader copies the
     * header only between ARRIVE and the DONE handshake, when it cannot change. */
    __atomic_store_n(c->hdr[c->me], 0, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
    /* zb_op leads with the header's fields (abi.py), so this rank's header is a copy of them */
    memcpy(c->hdr[c->me] + 1, &o->op, (HDR_FIELDS - 1) * sizeof(int64_t));
    c->hdr[c->me][H_PHASE_BASE] = ld(c, c->phase[c->me]);
    __atomic_store_n(c->hdr[c->me], o->seq, __ATOMIC_RELEASE);
}

int elect_claim(zb_chan *c, int64_t seq) { return c->tp->raise_to(c->elect, 2 * seq); }

void elect_release(zb_chan *c, int64_t seq, int rc) {
    c->elect[W_RC] = rc, c->elect[W_RANK] = c->result[1], c->elect[W_FIELD] = c->result[2];
    signal_flag(c, c->elect, 2 * seq + 1); /* seq_cst: the verdict is visible with it */
}

int begin_op(zb_chan *c, const zb_op *o, const int *fields, int nfields) {
    post_header(c, o);
    int rc = sync_on(c, c->arrive, o->seq);
    if (rc) return rc;
    rc = check_headers(c, o->seq, fields, nfields);
    if (!rc) return RC_OK;
    /* a peer running the oneshot all_reduce may wait on the election word instead of our DONE */
    if (elect_claim(c, o->seq)) elect_release(c, o->seq, rc);
    return fail_op(c, o->seq, rc);
}

int fail_op(zb_chan *c, int64_t seq, int rc) {
    c->result[0] = rc;
    int rc2 = sync_on(c, c->done, seq);
    return rc2 ? rc2 : rc;
}


/* ------------------------------------------------------------ the channel's life */

zb_chan *zb_chan_new(const zb_transport *tp, int64_t W, int64_t me, int64_t spin, int64_t liveness_ns,
                     int64_t timeout_ns, int64_t nthreads, const int64_t *t, int64_t poll_ns) {
    if (!tp || W < 1 || W > ZB_MAXW || me < 0 || me >= W) return NULL;
    zb_chan *c = calloc(1, sizeof(zb_chan));
    if (!c) return NULL;
    c->tp = tp;
    c->W = W, c->me = me, c->spin = spin, c->liveness_ns = liveness_ns, c->timeout_ns = timeout_ns;
    c->nthreads = nthreads, c->poll_ns = poll_ns;
    c->kind_mode = 0;
#define COL(k) ((int64_t *)(uintptr_t)t[CR_##k])
    for (int r = 0; r < c->W; r++, t += CR_COLUMNS) {
        c->arrive[r] = COL(ARRIVE), c->phase[r] = COL(PHASE), c->done[r] = COL(DONE), c->hdr[r] = COL(HEADER);
        c->state[r] = COL(STATE), c->base[r] = (char *)COL(BASE), c->size[r] = COL(SIZE), c->fd[r] = (int)t[CR_FD];
        c->vec[r] = COL(VEC), c->abort[r] = COL(ABORT), c->rabort[r] = COL(RABORT);
        c->grank[r] = t[CR_RANK];
        if (r == 0) c->elect = COL(ELECT);
    }
#undef COL
    return c;
}

void zb_chan_free(zb_chan *c) {
    if (c) {
        free(c->scratch);
        free(c);
    }
}
