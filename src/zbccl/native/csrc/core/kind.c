/* zbccl native core: the store kind of all_reduce's pushes, learnt at run time. CORE POLICY.
 *
 * This is the one decision the core makes by itself instead of Python (docs/design.md section 4.6, the
 * store kind): it needs the whole op's time on group rank 0, per op, at rates of 10^5 ops/s, and the
 * choice must be posted in rank 0's header in the same call (H_KIND), so a Python decider would add a
 * call and a GIL round trip to the op it measures. Python sets the mode (zb_chan_configure: -1 auto,
 * 0 cached, 1 streaming; ZBCCL_STREAM_STORES auto/off/on, ops/tuner.py store_kind_mode) and reads what
 * auto measured (chan_kinds). */
#include <string.h>

#include "chan.h"

/* Store kind
 *
 * twoshot's pushes write into peers' lines this rank has just read. What a cached store into such a
 * line costs depends on the host and changes over minutes (docs/benchmarks.md, "Host state probe": on
 * the test VM ~7 ns a line in the fast state, ~28 in the slow one); a streaming store skips the read
 * for ownership but sends the line to memory, so the next read of it misses. Which is
 * faster depends on the size and the state, so group rank 0 measures: per log2 size bucket, the whole
 * op's ns per byte under each kind, as the least of its last KIND_HIST samples (an op that lost its
 * core to another process must not make a kind look slow). An op costs differently right after the kind changed (it reads lines the previous op
 * wrote the other way), so the first op of each kind after a switch is not sampled, and the other kind
 * is re-measured in runs of KIND_RUN ops. It uses the cheaper kind and starts a run of the other after
 * `interval` ops (4, doubling up to KIND_MAX_INTERVAL while the other keeps losing, back to 4 when it
 * wins) or once its last sample is KIND_STALE_NS old, whichever comes first: a change of state is
 * followed within a few hundred milliseconds at any op rate, and a kind that keeps losing costs at most
 * KIND_RUN ops in KIND_MAX_INTERVAL. A sample after a stale one starts the kind's history afresh.
 * Rank 0 posts its choice in its header (H_KIND) and every rank uses it: each rank's op time includes
 * waiting for the others, so choices made per rank are measured against the peers' choices and cannot
 * tell the kinds apart (measured: per-rank choices settled on cached stores in the slow state, 10 us
 * where streaming takes 6.5 at 16 KiB). Either kind writes the same bytes and fences before the next
 * flag. Below KIND_MIN_BYTES the op is all handshake: cached stores, not measured. */
#define KIND_STALE_NS 200000000LL
#define KIND_MIN_BYTES 2048
#define KIND_MAX_INTERVAL 64
#define KIND_RUN 3

static int kind_bucket(int64_t nbytes) { return 63 - __builtin_clzll((unsigned long long)nbytes); }

int kind_choose(zb_chan *c, int64_t nbytes, int64_t now) {
    if (c->kind_mode >= 0) return (int)c->kind_mode;
    if (nbytes < KIND_MIN_BYTES) return 0;
    zb_kind *k = &c->kinds[kind_bucket(nbytes)];
    if (k->run > 0) return (int)k->prev - 1;
    if (k->seen[0] < 2) return 0; /* cached first: it won in both host states (docs/benchmarks.md) */
    if (k->seen[1] < 2) return 1;
    int best = k->rate[1] < k->rate[0];
    if (k->ops >= k->explore_at || now - k->last_ns[1 - best] > KIND_STALE_NS) {
        k->run = KIND_RUN;
        return 1 - best;
    }
    return best;
}

void kind_learn(zb_chan *c, int64_t nbytes, int kind, int64_t start, int64_t now) {
    if (c->kind_mode >= 0 || nbytes < KIND_MIN_BYTES) return;
    zb_kind *k = &c->kinds[kind_bucket(nbytes)];
    double rate = (double)(now - start) / (double)nbytes;
    int stale = now - k->last_ns[kind] > KIND_STALE_NS, switched = k->prev != kind + 1;
    int exploring = k->run > 0;
    k->prev = kind + 1;
    k->ops++;
    if (k->run > 0) k->run--;
    if (switched) return; /* this op read what the other kind wrote: not a sample of either */
    k->last_ns[kind] = now;
    double *h = k->hist[kind];
    if (stale) h[0] = h[1] = h[2] = h[3] = rate;
    h[k->seen[kind]++ % KIND_HIST] = rate;
    int n = k->seen[kind] < KIND_HIST ? (int)k->seen[kind] : KIND_HIST;
    k->rate[kind] = h[0];
    for (int i = 1; i < n; i++) k->rate[kind] = h[i] < k->rate[kind] ? h[i] : k->rate[kind];
    if (k->seen[0] < 2 || k->seen[1] < 2 || (exploring && k->run > 0)) return;
    if (exploring) { /* the run that re-measured the kind not in use ended: back off while it keeps losing */
        int lost = k->rate[kind] > k->rate[1 - kind];
        k->interval = lost ? (k->interval * 2 > KIND_MAX_INTERVAL ? KIND_MAX_INTERVAL : k->interval * 2) : 4;
        k->explore_at = k->ops + k->interval;
    } else if (!k->interval) {
        k->interval = 4;
        k->explore_at = k->ops + 4;
    }
}


void zb_chan_configure(zb_chan *c, int64_t mode) {
    c->kind_mode = mode;
    memset(c->kinds, 0, sizeof(c->kinds));
}
