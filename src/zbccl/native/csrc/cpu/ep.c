/* zbccl native EP kernels (zbccl.ep normal mode): the plan read, the dispatch pull and the combine sum,
 * one call each, so that a dispatch or a combine costs a handful of Python steps whatever its size.
 *
 * Synchronisation: none here. Python calls these between the handshake all_gather (after it every
 * peer's published plan block and operands are readable) and the closing barrier (after it no peer
 * reads this rank's blocks); these functions only read peers' memory and write this rank's outputs.
 * Every peer address comes from Python already bounds-checked for the whole published block; the
 * kernels check each row index they read from a peer (token indices, handle rows) against that block,
 * so a bad plan or handle gives an error code, never an out-of-bounds read or write.
 *
 * Arguments: one typed block per call, a struct zb_ep_<kernel> then, for kernels with per-rank data, one
 * zb_ep_<kernel>_row per rank (both generated into zb_abi.h from abi.EP_ARGS; Python fills them by field name:
 * zbccl/ep/fast.py, zbccl/ep/low_latency.py). Group sizes up to ZB_MAXW (abi.MAX_WORLD) ranks.
 *
 * Pure data movement and arithmetic on raw addresses: no Python here (py/ep_py.c binds each kernel as
 * ep_<kernel>(args_ptr), releasing the GIL around the ones that copy or sum rows).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ep.h"
#include "reduce.h"

#define PTR(type, v) ((type)(uintptr_t)(v))
/* The per-rank rows that follow a kernel's argument struct `a`. */
#define ROWS(a, type) ((const type *)((a) + 1))

/* ep_plan(zb_ep_plan, then per rank r a row: meta (its plan block's address), meta_len).
 * Sender r's plan block (int64) is counts[R] | per_expert[E] | chan[R * C] (inclusive prefix) | tokens.
 * Writes counts_out[r * R + d] = counts_r[d] (int64 [R, R]), per_expert_out[l] = sum_r per_expert_r[me * L + l]
 * (int64 [L]), recv_chan_out[r * C + c] = chan_r[me][c - 1] (int32 [R, C], column 0 is 0).
 * Returns -1, or the first rank whose block is too short or holds a negative count. */
i64 zbk_ep_plan(const void *args) {
    const zb_ep_plan *a = args;
    const zb_ep_plan_row *row = ROWS(a, zb_ep_plan_row);
    i64 R = a->R, me = a->me, E = a->E, C = a->C, L = a->L;
    i64 *counts = PTR(i64 *, a->counts_out), *per_expert = PTR(i64 *, a->per_expert_out);
    int32_t *recv_chan = PTR(int32_t *, a->recv_chan_out);
    for (i64 l = 0; l < L; l++) per_expert[l] = 0;
    for (i64 r = 0; r < R; r++) {
        const i64 *meta = PTR(const i64 *, row[r].meta);
        i64 len = row[r].meta_len;
        if (len < R + E + R * C) return r;
        for (i64 d = 0; d < R; d++) {
            if (meta[d] < 0) return r;
            counts[r * R + d] = meta[d];
        }
        for (i64 l = 0; l < L; l++) per_expert[l] += meta[R + me * L + l];
        const i64 *chan = meta + R + E + me * C;
        recv_chan[r * C] = 0;
        for (i64 c = 1; c < C; c++) recv_chan[r * C + c] = (int32_t)chan[c - 1];
    }
    return -1;
}

#define EP_FIELDS 4 /* x, scales, topk_idx, topk_weights */

/* Runs of x rows at least this long are copied with streaming stores when the caller asks (stream = 1). */
#define EP_STREAM_MIN 256

/* ep_pull(zb_ep_pull: R, me, head, L, K, n_recv, src_idx_out, stream, then per field f of x, s (scales), i (top-k),
 * w (weights): f_dst, f_row (bytes, 0: field absent); then per rank r a row: meta, meta_len, T, f_src per field).
 * stream = 1: the x rows go to memory with streaming stores (zb_copy_stream), which do not wait on the
 * invalidation of a peer core's copy of each destination line: the reused receive block was read by the peers
 * in the last combine, and in the host's slow cross-core state a cached store into such a line costs ~28 ns
 * (docs/benchmarks.md). The caller measures both kinds (ep/stores.py).
 * Copies, for each sender r in rank order, the rows of its tokens for this rank (token list at head +
 * sum(counts_r[:me]) of its plan block, ascending) into consecutive output rows, merging runs of consecutive
 * tokens into one memcpy; writes src_idx_out[i] (int32) = the source token. With K: topk_idx (int64) becomes
 * local expert ids (-1 where not this rank's, weight 0). Returns the bytes copied, or -(1 + r) for the first
 * sender r whose token list is out of bounds or whose counts add up to more than n_recv. */
i64 zbk_ep_pull(const void *args) {
    const zb_ep_pull *a = args;
    const zb_ep_pull_row *per = ROWS(a, zb_ep_pull_row);
    i64 R = a->R, me = a->me, head = a->head, L = a->L, K = a->K, n_recv = a->n_recv;
    int32_t *src_idx = PTR(int32_t *, a->src_idx_out);
    int stream = a->stream != 0;
    char *dst[EP_FIELDS] = {PTR(char *, a->x_dst), PTR(char *, a->s_dst), PTR(char *, a->i_dst), PTR(char *, a->w_dst)};
    i64 row[EP_FIELDS] = {a->x_row, a->s_row, a->i_row, a->w_row};
    i64 start = 0, moved = 0;
    for (i64 r = 0; r < R; r++) {
        const zb_ep_pull_row *p = per + r;
        const i64 src_of[EP_FIELDS] = {p->x_src, p->s_src, p->i_src, p->w_src};
        const i64 *meta = PTR(const i64 *, p->meta);
        i64 len = p->meta_len, T_r = p->T;
        if (len < head) return -(1 + r);
        i64 cnt = meta[me], at = head;
        for (i64 d = 0; d < me; d++) at += meta[d];
        if (cnt < 0 || at < head || at + cnt > len || start + cnt > n_recv) return -(1 + r);
        const i64 *toks = meta + at;
        for (i64 j = 0; j < cnt; j++)
            if (toks[j] < 0 || toks[j] >= T_r) return -(1 + r);
        for (i64 j = 0; j < cnt;) {
            i64 j1 = j + 1;
            while (j1 < cnt && toks[j1] == toks[j1 - 1] + 1) j1++;
            for (int f = 0; f < EP_FIELDS; f++) {
                if (!row[f]) continue;
                const char *src = PTR(const char *, src_of[f]);
                i64 n = (j1 - j) * row[f];
                if (stream && f == 0 && n >= EP_STREAM_MIN)
                    zb_copy_stream(dst[f] + (start + j) * row[f], src + toks[j] * row[f], n, 1);
                else
                    memcpy(dst[f] + (start + j) * row[f], src + toks[j] * row[f], (size_t)n);
                moved += (j1 - j) * row[f];
            }
            j = j1;
        }
        for (i64 j = 0; j < cnt; j++) src_idx[start + j] = (int32_t)toks[j];
        start += cnt;
    }
    if (K && row[2] && row[3]) {
        i64 *idx = (i64 *)dst[2];
        float *w = (float *)dst[3];
        i64 lo = me * L;
        for (i64 i = 0; i < start * K; i++) {
            i64 e = idx[i] - lo;
            if (e < 0 || e >= L) {
                idx[i] = -1;
                w[i] = 0.0f;
            } else {
                idx[i] = e;
            }
        }
    }
    return moved;
}



/* One fp32-accumulated sum per run of consecutive tokens sent to the same ranks (their rows are consecutive in
 * each of those ranks' blocks): dst rows [t0, t0 + n) = sum over the present ranks (rank order) and the extras. */
static i64 ep_sum(char *dst, i64 T, i64 R, i64 width, i64 isz, int dtype, const uint8_t *in_rank,
                  const int32_t *head, const i64 *base, const i64 *nrows, const i64 *peer, const i64 *extra,
                  i64 nextra) {
    const void *srcs[ZB_MAXW + 2];
    i64 row = width * isz, moved = 0;
    for (i64 t0 = 0; t0 < T;) {
        i64 t1 = t0 + 1;
        while (t1 < T && !memcmp(in_rank + t1 * R, in_rank + t0 * R, (size_t)R)) t1++;
        long n = 0;
        for (i64 k = 0; k < nextra; k++) srcs[n++] = (const char *)(uintptr_t)extra[k] + t0 * row;
        for (i64 r = 0; r < R; r++) {
            if (!in_rank[t0 * R + r]) continue;
            i64 first = base[r] + head[t0 * R + r], last = base[r] + head[(t1 - 1) * R + r];
            if (head[t0 * R + r] < 0 || first < 0 || last != first + (t1 - 1 - t0) || last >= nrows[r])
                return -(1 + r);
            srcs[n++] = (const char *)(uintptr_t)peer[r] + first * row;
            moved += (t1 - t0) * row;
        }
        if (n)
            zb_reduce_n(dst + t0 * row, srcs, n, (long)((t1 - t0) * width), dtype, ZB_OP_SUM, 1.0, 1);
        else
            memset(dst + t0 * row, 0, (size_t)((t1 - t0) * row));
        t0 = t1;
    }
    return moved;
}

/* ep_combine(zb_ep_combine: R, T, in_rank (bool [T, R]), head (int32 [T, R]), then per job j of x, w (weights):
 * j_dst (0: no job), j_width (elements per row), j_itemsize, j_dtype, j_nextra, j_extra0, j_extra1 (the extra
 * addends' addresses); then per rank r a row: base (first row of this rank's tokens in r's block), nrows (rows
 * r published), x, w (their addresses)).
 * The rows are [base_r + head[t, r]] of each rank r with in_rank[t, r]. Returns the bytes read from the
 * ranks, or -(1 + r) for the first rank r whose row index is out of its block. */
i64 zbk_ep_combine(const void *args) {
    const zb_ep_combine *a = args;
    const zb_ep_combine_row *per = ROWS(a, zb_ep_combine_row);
    i64 R = a->R, T = a->T;
    const uint8_t *in_rank = PTR(const uint8_t *, a->in_rank);
    const int32_t *head = PTR(const int32_t *, a->head);
    i64 base[ZB_MAXW], nrows[ZB_MAXW], peer[ZB_MAXW], moved = 0;
    if (R > ZB_MAXW) return -1;
    for (i64 r = 0; r < R; r++) {
        base[r] = per[r].base;
        nrows[r] = per[r].nrows;
    }
    const struct { i64 dst, width, itemsize, dtype, nextra, extra[2]; } jobs[2] = {
        {a->x_dst, a->x_width, a->x_itemsize, a->x_dtype, a->x_nextra, {a->x_extra0, a->x_extra1}},
        {a->w_dst, a->w_width, a->w_itemsize, a->w_dtype, a->w_nextra, {a->w_extra0, a->w_extra1}}};
    for (int j = 0; j < 2; j++) {
        if (!jobs[j].dst) continue;
        for (i64 r = 0; r < R; r++) peer[r] = j ? per[r].w : per[r].x;
        i64 m = ep_sum(PTR(char *, jobs[j].dst), T, R, jobs[j].width, jobs[j].itemsize, (int)jobs[j].dtype, in_rank,
                       head, base, nrows, peer, jobs[j].extra, jobs[j].nextra);
        if (m < 0) return m;
        moved += m;
    }
    return moved;
}

/* ep_ll_combine(zb_ep_ll_combine: T, K, H, dst (bf16 [T, H]), src (int64 [T * K] row addresses, 0: none), w (float
 * [T * K]), acc (float [H] scratch)). The low-latency combine's weighted fp32 sum per token
 * (zb_weighted_rows_bf16); the caller has checked every row address against its owner's published block.
 * Returns the bytes read. */
i64 zbk_ep_ll_combine(const void *args) {
    const zb_ep_ll_combine *a = args;
    i64 T = a->T, K = a->K, H = a->H;
    const i64 *src = PTR(const i64 *, a->src);
    zb_weighted_rows_bf16(PTR(uint16_t *, a->dst), (const uint16_t *const *)src, PTR(const float *, a->w), (long)T,
                          (long)K, (long)H, PTR(float *, a->acc));
    i64 rows = 0;
    for (i64 i = 0; i < T * K; i++) rows += src[i] != 0;
    return rows * H * 2;
}

/* ep_hosts_recv(zb_ep_hosts_recv: nsrc (sources that follow), nbytes (bytes per packed row), bit (this rank's bit in
 * a row's routing mask), K, lo, L (this rank's experts are [lo, lo + L)), idx_at, w_at, s_at, srow, x_at, xrow (each
 * field's byte offset in a row, and the scales' and x's widths), n (rows this rank receives), total (output rows: n,
 * or num_worst_tokens), x_dst ([total, xrow] bytes), s_dst ([total, srow] bytes, 0: none), i_dst (int64 [total, K]),
 * w_dst (float [total, K]; both 0 when K is 0), src_dst (int32 [total]), per_expert_out (int64 [L]), err_out (int64
 * [1]); then per source, in source order, a row: blk (its packed block: [nrows, nbytes], a row being [source token
 * int64][mask int64][idx int64 x K][w float x K][scales][x], internode.Rows), nrows, want (rows of it for this rank,
 * from the headers)).
 * The dispatch's receive across hosts in one pass: each row whose mask holds `bit`, in block order, into the next
 * output row: x and scales as bytes, the top-k ids as local experts (id - lo, -1 when not this rank's), the weights
 * (0 where the id is not this rank's), the source token; rows n..total get ids -1, weights 0, source -1. Counts the
 * local experts' rows into per_expert_out. A block never makes it write past its `want` rows. Returns n, or -(1 + j)
 * for the first source j whose block holds another number of rows for this rank than its `want` (err_out[0]: how
 * many it holds, or want + 1 once it holds more). */
i64 zbk_ep_hosts_recv(const void *args) {
    const zb_ep_hosts_recv *a = args;
    const zb_ep_hosts_recv_row *src = ROWS(a, zb_ep_hosts_recv_row);
    i64 nbytes = a->nbytes, K = a->K, lo = a->lo, L = a->L, n = a->n, total = a->total, xrow = a->xrow;
    i64 srow = a->srow, nsrc = a->nsrc, out = 0;
    uint64_t bit = (uint64_t)1 << a->bit;
    char *x_dst = PTR(char *, a->x_dst), *s_dst = PTR(char *, a->s_dst);
    i64 *i_dst = PTR(i64 *, a->i_dst), *per_expert = PTR(i64 *, a->per_expert_out), *err = PTR(i64 *, a->err_out);
    float *w_dst = PTR(float *, a->w_dst);
    int32_t *src_dst = PTR(int32_t *, a->src_dst);
    for (i64 l = 0; l < L; l++) per_expert[l] = 0;
    for (i64 j = 0; j < nsrc; j++) {
        const char *blk = PTR(const char *, src[j].blk);
        i64 got = 0, want = src[j].want;
        for (i64 r = 0; r < src[j].nrows; r++) {
            const char *row = blk + r * nbytes;
            uint64_t mask;
            memcpy(&mask, row + 8, 8);
            if (!(mask & bit)) continue;
            if (++got > want || out >= n) {
                err[0] = got;
                return -(1 + j);
            }
            i64 token;
            memcpy(&token, row, 8);
            src_dst[out] = (int32_t)token;
            memcpy(x_dst + out * xrow, row + a->x_at, (size_t)xrow);
            if (srow) memcpy(s_dst + out * srow, row + a->s_at, (size_t)srow);
            for (i64 k = 0; k < K; k++) {
                i64 e;
                float w;
                memcpy(&e, row + a->idx_at + 8 * k, 8);
                memcpy(&w, row + a->w_at + 4 * k, 4);
                int local = e >= lo && e < lo + L;
                i_dst[out * K + k] = local ? e - lo : -1;
                w_dst[out * K + k] = local ? w : 0.0f;
                if (local) per_expert[e - lo]++;
            }
            out++;
        }
        if (got != want) {
            err[0] = got;
            return -(1 + j);
        }
    }
    for (i64 t = out; t < total; t++) {
        src_dst[t] = -1;
        for (i64 k = 0; k < K; k++) i_dst[t * K + k] = -1, w_dst[t * K + k] = 0.0f;
    }
    return out;
}

/* ep_hosts_pack(zb_ep_hosts_pack: T, R, H (hosts), in_rank (bool [T, R]), host_of (int64 [R]: each rank's host),
 * bit_of (int64 [R]: its index among its host's ranks, < 63), K, nbytes, idx_at, w_at, s_at, srow, x_at, xrow (as
 * ep_hosts_recv's), x ([T, xrow] bytes), s ([T, srow] bytes, 0: none), idx (int64 [T, K]), w (float [T, K]; both 0
 * when K is 0), dst (the send block, 0: count only), counts_out (int64 [H]), toks_out, masks_out (int64 [H, T], or
 * 0)).
 * The send side of a dispatch across hosts: per host h, the tokens bound for any of its ranks (ascending) and each
 * one's routing mask (bit j: h's j-th rank gets it) into counts_out[h], toks_out[h, :], masks_out[h, :]; with dst,
 * each host's part, [counts_out[h], nbytes] rows in host order, a row being [token][mask][idx x K][w x K][scales][x]
 * (internode.Rows; the padding after x zeroed). Returns the rows of every part, or -1 for a host table out of range. */
i64 zbk_ep_hosts_pack(const void *args) {
    const zb_ep_hosts_pack *a = args;
    i64 T = a->T, R = a->R, H = a->H, K = a->K, nbytes = a->nbytes, xrow = a->xrow, srow = a->srow, total = 0;
    const uint8_t *in_rank = PTR(const uint8_t *, a->in_rank);
    const i64 *host_of = PTR(const i64 *, a->host_of), *bit_of = PTR(const i64 *, a->bit_of);
    const char *x = PTR(const char *, a->x), *s = PTR(const char *, a->s);
    const i64 *idx = PTR(const i64 *, a->idx);
    const float *w = PTR(const float *, a->w);
    char *dst = PTR(char *, a->dst);
    i64 *counts = PTR(i64 *, a->counts_out), *toks = PTR(i64 *, a->toks_out), *masks = PTR(i64 *, a->masks_out);
    for (i64 r = 0; r < R; r++)
        if (host_of[r] < 0 || host_of[r] >= H || bit_of[r] < 0 || bit_of[r] >= 63) return -1;
    i64 tail = a->x_at + xrow;
    for (i64 h = 0; h < H; h++) {
        i64 n = 0;
        char *part = dst ? dst + total * nbytes : NULL;
        for (i64 t = 0; t < T; t++) {
            i64 mask = 0;
            for (i64 r = 0; r < R; r++)
                if (host_of[r] == h && in_rank[t * R + r]) mask |= (i64)1 << bit_of[r];
            if (!mask) continue;
            if (toks) toks[h * T + n] = t;
            if (masks) masks[h * T + n] = mask;
            if (part) {
                char *row = part + n * nbytes;
                memcpy(row, &t, 8);
                memcpy(row + 8, &mask, 8);
                if (K) {
                    memcpy(row + a->idx_at, idx + t * K, (size_t)(8 * K));
                    memcpy(row + a->w_at, w + t * K, (size_t)(4 * K));
                }
                if (srow) memcpy(row + a->s_at, s + t * srow, (size_t)srow);
                memcpy(row + a->x_at, x + t * xrow, (size_t)xrow);
                if (tail < nbytes) memset(row + tail, 0, (size_t)(nbytes - tail));
            }
            n++;
        }
        counts[h] = n;
        total += n;
    }
    return total;
}

/* Column prefix of channels: out[j * C + c] = rows t < end of channel c (tokens [c * per, (c + 1) * per), per =
 * ceil(T / C) at least 1) with bit j set in row t of `cols` (a [T, ncol] bool or, with `host_of`, the any-of-host
 * reduction of a [T, R] bool into ncol hosts). */
static void channel_prefix(int32_t *out, const uint8_t *a, i64 T, i64 R, i64 ncol, const i64 *host_of, i64 C) {
    i64 per = T ? (T + C - 1) / C : 1, at = 0;
    if (per < 1) per = 1;
    memset(out, 0, (size_t)(ncol * C) * sizeof(int32_t));
    int32_t run[ZB_MAXW];
    for (i64 j = 0; j < ncol; j++) run[j] = 0;
    for (i64 c = 0; c < C; c++) {
        for (i64 end = (c + 1) * per < T ? (c + 1) * per : T; at < end; at++) {
            if (host_of) {
                uint8_t seen[ZB_MAXW] = {0};
                for (i64 r = 0; r < R; r++)
                    if (a[at * R + r] && !seen[host_of[r]]) seen[host_of[r]] = 1, run[host_of[r]]++;
            } else {
                for (i64 j = 0; j < ncol; j++) run[j] += a[at * R + j] != 0;
            }
        }
        for (i64 j = 0; j < ncol; j++) out[j * C + c] = run[j];
    }
}

/* ep_hosts_handle(zb_ep_hosts_handle: T, R, H, C, me, in_rank (bool [T, R]), host_of (int64 [R]), counts (int64
 * [R, R], source x destination), src_idx (int32: this rank's received rows' source tokens, by source), T_of (int64
 * [R]: each sender's tokens), scratch (int64 [R * C]), then the outputs, int32: rdma_chan_out [H, C], gbl_chan_out
 * [R, C], recv_rdma_chan_out [H, C], recv_rdma_rank_out [H], recv_gbl_chan_out [R, C], recv_gbl_rank_out [R],
 * rdma_head_out [T, H], nvl_head_out [T, R]).
 * DeepEP's internode handle fields (docs/ep-internode.md defines each): the sender's channel prefixes over its
 * tokens bound for each host and rank, the receiver's per-source channel counts of its rows (a row of source r is
 * in channel min(token / ceil(T_of[r] / C), C - 1)) summed per host, and each token's position among those sent to
 * each host and rank (-1: not sent). Returns 0; -1 for sizes out of range (R > ZB_MAXW, H > R, C < 1); or -(2 + r)
 * for the first source r with a negative source token (nothing is then counted past the scratch). */
i64 zbk_ep_hosts_handle(const void *args) {
    const zb_ep_hosts_handle *a = args;
    i64 T = a->T, R = a->R, H = a->H, C = a->C, me = a->me;
    const uint8_t *in_rank = PTR(const uint8_t *, a->in_rank);
    const i64 *host_of = PTR(const i64 *, a->host_of), *counts = PTR(const i64 *, a->counts);
    const i64 *T_of = PTR(const i64 *, a->T_of);
    const int32_t *src = PTR(const int32_t *, a->src_idx);
    i64 *by_chan = PTR(i64 *, a->scratch);
    if (R > ZB_MAXW || H > R || C < 1) return -1;
    channel_prefix(PTR(int32_t *, a->rdma_chan_out), in_rank, T, R, H, host_of, C);
    channel_prefix(PTR(int32_t *, a->gbl_chan_out), in_rank, T, R, R, NULL, C);
    memset(by_chan, 0, (size_t)(R * C) * sizeof(i64));
    int32_t *recv_gbl_rank = PTR(int32_t *, a->recv_gbl_rank_out);
    i64 row = 0, sum = 0;
    for (i64 r = 0; r < R; r++) {
        i64 n = counts[r * R + me], per = (T_of[r] + C - 1) / C;
        if (per < 1) per = 1;
        for (i64 i = 0; i < n; i++, row++) {
            if (src[row] < 0) return -(2 + r);
            i64 c = src[row] / per;
            by_chan[r * C + (c < C - 1 ? c : C - 1)]++;
        }
        sum += n;
        recv_gbl_rank[r] = (int32_t)sum;
    }
    int32_t *recv_gbl_chan = PTR(int32_t *, a->recv_gbl_chan_out);
    int32_t *recv_rdma_chan = PTR(int32_t *, a->recv_rdma_chan_out);
    int32_t *recv_rdma_rank = PTR(int32_t *, a->recv_rdma_rank_out);
    memset(recv_rdma_chan, 0, (size_t)(H * C) * sizeof(int32_t));
    for (i64 r = 0; r < R; r++) {
        i64 run = 0;
        for (i64 c = 0; c < C; c++) {
            recv_gbl_chan[r * C + c] = (int32_t)run;
            run += by_chan[r * C + c];
        }
    }
    for (i64 h = 0; h < H; h++) {
        i64 run = 0;
        for (i64 c = 0; c < C; c++) {
            for (i64 r = 0; r < R; r++)
                if (host_of[r] == h) run += by_chan[r * C + c];
            recv_rdma_chan[h * C + c] = (int32_t)run;
        }
    }
    i64 total = 0;
    for (i64 h = 0; h < H; h++) {
        total += recv_rdma_chan[h * C + C - 1];
        recv_rdma_rank[h] = (int32_t)total;
    }
    int32_t *rdma_head = PTR(int32_t *, a->rdma_head_out), *nvl_head = PTR(int32_t *, a->nvl_head_out);
    int32_t pos_h[ZB_MAXW], pos_r[ZB_MAXW];
    for (i64 j = 0; j < R; j++) pos_h[j] = pos_r[j] = 0;
    for (i64 t = 0; t < T; t++) {
        uint8_t seen[ZB_MAXW] = {0};
        for (i64 r = 0; r < R; r++) {
            int sent = in_rank[t * R + r] != 0;
            nvl_head[t * R + r] = sent ? pos_r[r]++ : -1;
            if (sent) seen[host_of[r]] = 1;
        }
        for (i64 h = 0; h < H; h++) rdma_head[t * H + h] = seen[h] ? pos_h[h]++ : -1;
    }
    return 0;
}

/* ep_hosts_ll_recv(zb_ep_hosts_ll_recv: nsrc (sources, in rank order), L (local experts), N (slots per expert), xrow,
 * srow (bytes of x and of the scales per row), x_dst ([L, N, xrow] bytes), info_dst (int32 [L, N]), s_dst (the
 * scales, 4-byte elements, 0: none) with its strides in elements s_le, s_slot, s_j, layout_out (int64 [L, nsrc]),
 * count_out (int32 [L]), err_out (int64 [2]); then per source a row: raw (its part: int64 [L] counts, then n rows
 * of `row` bytes, [source token int64][scales][x] in expert order; 0 when n is 0), n, row, dropped (its rows are
 * not taken: a masked sender)).
 * The low-latency dispatch's receive across hosts: each source's rows for local expert e go to slots
 * [begin_e, begin_e + c) of e, after the earlier sources' (layout_out[e, s] = begin << 32 | c; count_out: the
 * slots filled). Returns 0, or -(1 + s) for the first source s whose part is wrong: err_out = (1, first bad count)
 * when its counts are negative or do not sum to n, (2, expert) when an expert gets more rows than its N slots. */
i64 zbk_ep_hosts_ll_recv(const void *args) {
    const zb_ep_hosts_ll_recv *a = args;
    const zb_ep_hosts_ll_recv_row *src = ROWS(a, zb_ep_hosts_ll_recv_row);
    i64 nsrc = a->nsrc, L = a->L, N = a->N, xrow = a->xrow, srow = a->srow;
    char *x_dst = PTR(char *, a->x_dst);
    int32_t *info = PTR(int32_t *, a->info_dst), *count = PTR(int32_t *, a->count_out);
    uint32_t *s_dst = PTR(uint32_t *, a->s_dst);
    i64 *layout_out = PTR(i64 *, a->layout_out), *err = PTR(i64 *, a->err_out);
    for (i64 e = 0; e < L; e++) count[e] = 0;
    for (i64 s = 0; s < nsrc; s++) {
        const char *raw = PTR(const char *, src[s].raw);
        i64 n = src[s].n, row = src[s].row, sum = 0;
        for (i64 e = 0; e < L && raw; e++) {
            i64 c;
            memcpy(&c, raw + 8 * e, 8);
            if (c < 0) {
                err[0] = 1, err[1] = c;
                return -(1 + s);
            }
            sum += c;
        }
        if (sum != n) {
            err[0] = 1, err[1] = sum;
            return -(1 + s);
        }
        const char *rows = raw ? raw + 8 * L : NULL;
        for (i64 e = 0; e < L; e++) {
            i64 c = 0, b = count[e];
            if (raw) memcpy(&c, raw + 8 * e, 8);
            i64 take = src[s].dropped ? 0 : c;  /* a masked sender's rows are skipped */
            layout_out[e * nsrc + s] = b << 32 | take;
            if (b + take > N) {
                err[0] = 2, err[1] = e;
                return -(1 + s);
            }
            for (i64 i = 0; i < take; i++) {
                const char *r = rows + i * row;
                i64 token;
                memcpy(&token, r, 8);
                info[e * N + b + i] = (int32_t)token;
                memcpy(x_dst + (e * N + b + i) * xrow, r + 8 + srow, (size_t)xrow);
                for (i64 j = 0; j < srow / 4; j++)
                    memcpy(s_dst + e * a->s_le + (b + i) * a->s_slot + j * a->s_j, r + 8 + 4 * j, 4);
            }
            if (c) rows += c * row;
            count[e] = (int32_t)(b + take);
        }
    }
    return 0;
}

/* ep_ll_plan(zb_ep_ll_plan: T, K, E, idx (int64 [T, K]), counts_out (int64 [E]), tokens_out (int64 [T * K]),
 * slots_out (int64 [T * K]), err_out (int64 [2])). The low-latency dispatch's plan in one pass (a counting
 * sort): the valid (token, slot) pairs sorted by expert, then slot (so by token), with counts per expert;
 * slot is the flat index t * K + k. Returns the number of pairs, or -1 (err_out = token, value: an entry
 * outside [-1, E)) or -2 (err_out = token, expert: an expert named twice in one token). */
i64 zbk_ep_ll_plan(const void *args) {
    const zb_ep_ll_plan *a = args;
    i64 T = a->T, K = a->K, E = a->E;
    const i64 *idx = PTR(const i64 *, a->idx);
    i64 *counts = PTR(i64 *, a->counts_out), *tokens = PTR(i64 *, a->tokens_out), *slots = PTR(i64 *, a->slots_out);
    i64 *err = PTR(i64 *, a->err_out);
    memset(counts, 0, (size_t)E * sizeof(i64));
    for (i64 t = 0; t < T; t++)
        for (i64 k = 0; k < K; k++) {
            i64 v = idx[t * K + k];
            if (v < -1 || v >= E) {
                err[0] = t, err[1] = v;
                return -1;
            }
            if (v < 0) continue;
            for (i64 j = 0; j < k; j++)
                if (idx[t * K + j] == v) {
                    err[0] = t, err[1] = v;
                    return -2;
                }
            counts[v]++;
        }
    /* counts -> each expert's next position (exclusive prefix), restored to counts at the end */
    i64 n = 0;
    for (i64 e = 0; e < E; e++) {
        i64 c = counts[e];
        counts[e] = n;
        n += c;
    }
    for (i64 t = 0; t < T; t++)
        for (i64 k = 0; k < K; k++) {
            i64 v = idx[t * K + k];
            if (v < 0) continue;
            i64 p = counts[v]++;
            tokens[p] = t, slots[p] = t * K + k;
        }
    for (i64 e = E - 1; e > 0; e--) counts[e] -= counts[e - 1]; /* counts[e] is now the end of e */
    return n;
}


/* ep_ll_pull(zb_ep_ll_pull: R, me, L, N, E, xrow, x_out, count_out (int32 [L]), src_info_out (int32 [L, N]),
 * layout_out (int64 [L, R]), begin_out (int64 [E]), masked (bit s: this rank drops source s), keep_of
 * (int64 [R]: bit s of entry o set when owner o keeps source s), srow (scale row bytes, 0: no scales), s_out,
 * s_e, s_slot, s_j (the scales' strides in bytes; 4-byte scale elements), err_out (int64 [2]); then per rank r
 * a row: meta, meta_len, x, T, s (its plan block, x and scales)).
 * The low-latency dispatch's receive half for this rank (experts me*L .. me*L+L-1), in one pass:
 * sender r's plan block is counts[E] | tokens (its (token, slot) pairs sorted by expert, then token). Rows of
 * local expert l come in source rank order, then source token: slot = begin_r[l] + position, row l * N + slot of
 * out_x gets row t of r's x (runs of consecutive rows merged into one memcpy), src_info[l, slot] = t, and the
 * scale row of t goes to s_out + l * s_stride_e + slot * s_stride_slot + j * s_stride_j. count_out[l] = rows of l,
 * layout_out[l, r] = begin << 32 | rows from r. begin_out[e] = the rows of global expert e that senders before
 * this rank put on e's owner (which keeps them: keep_mask_of), i.e. where this rank's rows of e start there.
 * Returns the bytes copied, or -1 (err_out = rank r, 0: r's plan block is short or its counts negative, or one of
 * its tokens is outside [0, T_r)), -2 (err_out = local expert l, its rows: more rows than its N slots) or -3 (no
 * memory for its tables). */
static i64 ep_ll_pull_with(const zb_ep_ll_pull *a, i64 *mine_tab, i64 *at);
i64 zbk_ep_ll_pull(const void *args) {
    const zb_ep_ll_pull *a = args;
    i64 R = a->R, L = a->L;
    i64 *tab = (i64 *)malloc((size_t)(R + 1) * (size_t)L * sizeof(i64));
    if (!tab) return -3;
    i64 rc = ep_ll_pull_with(a, tab, tab + R * L);
    free(tab);
    return rc;
}

static i64 ep_ll_pull_with(const zb_ep_ll_pull *a, i64 *mine_tab, i64 *at) {
    i64 R = a->R, me = a->me, L = a->L, N = a->N, E = a->E, xrow = a->xrow;
    char *out_x = PTR(char *, a->x_out);
    int32_t *count = PTR(int32_t *, a->count_out), *src_info = PTR(int32_t *, a->src_info_out);
    i64 *layout = PTR(i64 *, a->layout_out), *begin_out = PTR(i64 *, a->begin_out);
    i64 masked = a->masked;
    const i64 *keep_of = PTR(const i64 *, a->keep_of);
    i64 srow = a->srow, s_e = a->s_e, s_slot = a->s_slot, s_j = a->s_j;
    char *s_out = PTR(char *, a->s_out);
    i64 *err = PTR(i64 *, a->err_out);
    const zb_ep_ll_pull_row *per = ROWS(a, zb_ep_ll_pull_row);
#define mine(r, l) mine_tab[(r) * L + (l)]
#define DROPS(r) ((r) < 63 && ((masked >> (r)) & 1))         /* this rank drops source r */
#define KEEPS(o, s) ((s) >= 63 || ((keep_of[o] >> (s)) & 1)) /* owner o keeps source s */
    /* every sender's block: long enough, counts non-negative */
    for (i64 r = 0; r < R; r++) {
        const i64 *meta = PTR(const i64 *, per[r].meta);
        i64 len = per[r].meta_len, n = 0;
        if (len < E) goto short_block;
        for (i64 e = 0; e < E; e++) {
            if (meta[e] < 0 || meta[e] > len) goto short_block; /* (no overflow of the sum below) */
            n += meta[e];
        }
        if (E + n > len) goto short_block;
        for (i64 l = 0; l < L; l++) mine(r, l) = DROPS(r) ? 0 : meta[me * L + l];
        continue;
    short_block:
        err[0] = r, err[1] = 0;
        return -1;
    }
    for (i64 l = 0; l < L; l++) {
        i64 c = 0;
        for (i64 r = 0; r < R; r++) {
            layout[l * R + r] = (c << 32) | mine(r, l);
            c += mine(r, l);
        }
        if (c > N) {
            err[0] = l, err[1] = c;
            return -2;
        }
        count[l] = (int32_t)c;
    }
    for (i64 e = 0; e < E; e++) {
        i64 o = e / L, b = 0;
        for (i64 s = 0; s < me; s++)
            if (KEEPS(o, s)) b += PTR(const i64 *, per[s].meta)[e];
        begin_out[e] = b;
    }
    i64 moved = 0;
    for (i64 r = 0; r < R; r++) {
        const i64 *meta = PTR(const i64 *, per[r].meta);
        const char *x = PTR(const char *, per[r].x), *sc = PTR(const char *, per[r].s);
        i64 T_r = per[r].T, start = E;
        if (DROPS(r)) continue;
        for (i64 e = 0; e < me * L; e++) start += meta[e];
        for (i64 l = 0; l < L; l++) at[l] = layout[l * R + r] >> 32;
        for (i64 l = 0; l < L; l++) {
            const i64 *toks = meta + start;
            i64 n = mine(r, l);
            for (i64 j = 0; j < n; j++)
                if (toks[j] < 0 || toks[j] >= T_r) {
                    err[0] = r, err[1] = 0;
                    return -1;
                }
            for (i64 j = 0; j < n;) {
                i64 j1 = j + 1;
                while (j1 < n && toks[j1] == toks[j1 - 1] + 1) j1++;
                memcpy(out_x + (l * N + at[l] + j) * xrow, x + toks[j] * xrow, (size_t)((j1 - j) * xrow));
                j = j1;
            }
            for (i64 j = 0; j < n; j++) {
                i64 slot = at[l] + j;
                src_info[l * N + slot] = (int32_t)toks[j];
                if (srow)
                    for (i64 q = 0; q < srow / 4; q++)
                        memcpy(s_out + l * s_e + slot * s_slot + q * s_j, sc + toks[j] * srow + 4 * q, 4);
            }
            moved += n * (xrow + srow);
            start += n;
        }
    }
    return moved;
#undef mine
#undef DROPS
#undef KEEPS
}


/* ep_ll_addrs(zb_ep_ll_addrs: T, K, E, L, R, row_bytes, idx (int64 [T, K]), w (float [T, K]), begin (int64 [E]),
 * addr_out (int64 [T, K]), w_out (float [T, K]), err_out (int64 [2]); then per owner r a row: meta (int64 [L]: the
 * first row of each of r's local experts in its published block), x (its block's address), nrows (its rows;
 * -1: skip the slots of experts on r)).
 * The low-latency combine's row addresses: the slot of token t naming expert e (owner r = e / L) reads row
 * bases_r[e - r * L] + begin[e] + (t's position among this rank's tokens naming e) of r's block. Each token's
 * slots are written in ascending expert order (no expert first; a stable sort, as torch's argsort(stable=True)),
 * with their weights, address 0 for no expert or a skipped owner (ep_ll_combine skips those). Returns 0, -1
 * (err_out = owner r, the row) for a row outside r's block, or -3 (no memory for its tables). */
i64 zbk_ep_ll_addrs(const void *args) {
    const zb_ep_ll_addrs *a = args;
    i64 T = a->T, K = a->K, E = a->E, L = a->L, R = a->R, rb = a->row_bytes;
    const i64 *idx = PTR(const i64 *, a->idx), *begin = PTR(const i64 *, a->begin);
    const float *w = PTR(const float *, a->w);
    i64 *addr = PTR(i64 *, a->addr_out), *err = PTR(i64 *, a->err_out);
    float *w_out = PTR(float *, a->w_out);
    const zb_ep_ll_addrs_row *per = ROWS(a, zb_ep_ll_addrs_row);
    i64 *seen = (i64 *)calloc((size_t)E + 1, sizeof(i64));
    int *order = (int *)malloc((size_t)K * sizeof(int) + 1);
    i64 rc = 0;
    if (!seen || !order) {
        rc = -3;
        goto out;
    }
    for (i64 t = 0; t < T && !rc; t++) {
        const i64 *it = idx + t * K;
        for (int k = 0; k < K; k++) { /* insertion sort of the slots by expert, stable */
            int j = k;
            while (j > 0 && it[order[j - 1]] > it[k]) {
                order[j] = order[j - 1];
                j--;
            }
            order[j] = k;
        }
        for (int j = 0; j < K; j++) {
            int k = order[j];
            i64 e = it[k], r = e >= 0 ? e / L : -1, v = 0;
            w_out[t * K + j] = w[t * K + k];
            if (e >= 0) {
                i64 pos = seen[e]++, nrows = per[r].nrows;
                if (nrows >= 0) {
                    i64 row = nrows ? PTR(const i64 *, per[r].meta)[e - r * L] + begin[e] + pos : pos;
                    if (row < 0 || row >= nrows) {
                        err[0] = r, err[1] = row;
                        rc = -1;
                        break;
                    }
                    v = per[r].x + row * rb;
                }
            }
            addr[t * K + j] = v;
        }
    }
out:
    free(seen);
    free(order);
    (void)R;
    return rc;
}




/* ep_layout(zb_ep_layout: idx (int64 or int32 [T, K]), T, K, E, R, idx_is_int32, per_rank_out (int32 [R] or 0),
 * per_expert_out (int32 [E]), in_rank_out (bool [T, R] or 0)): get_dispatch_layout in one pass (a token counts
 * once per rank, -1 selects nothing). Returns -1, or the flat index of the first entry outside [-1, E) (then
 * the outputs are undefined). */
i64 zbk_ep_layout(const void *args) {
    const zb_ep_layout *a = args;
    i64 T = a->T, K = a->K, E = a->E, R = a->R, L = E / R;
    const i64 *idx64 = PTR(const i64 *, a->idx);
    const int32_t *idx32 = PTR(const int32_t *, a->idx);
    int32_t *per_rank = PTR(int32_t *, a->per_rank_out), *per_expert = PTR(int32_t *, a->per_expert_out);
    uint8_t *in_rank = PTR(uint8_t *, a->in_rank_out);
    uint8_t seen[ZB_MAXW];
    if (R > ZB_MAXW || L < 1) return 0;
    for (i64 e = 0; e < E; e++) per_expert[e] = 0;
    if (per_rank)
        for (i64 r = 0; r < R; r++) per_rank[r] = 0;
    int is32 = a->idx_is_int32 != 0;
    for (i64 t = 0; t < T; t++) {
        memset(seen, 0, (size_t)R);
        for (i64 k = 0; k < K; k++) {
            i64 e = is32 ? idx32[t * K + k] : idx64[t * K + k];
            if ((uint64_t)(e + 1) > (uint64_t)E) return t * K + k; /* outside [-1, E) */
            if (e < 0) continue;
            per_expert[e]++;
            seen[e / L] = 1;
        }
        for (i64 r = 0; r < R; r++) {
            if (per_rank) per_rank[r] += seen[r];
            if (in_rank) in_rank[t * R + r] = seen[r];
        }
    }
    return -1;
}


/* ep_route(zb_ep_route: in_rank (bool [T, R]), T, R, C, E, meta (int64 block), meta_len, head_out (int32 [T, R]),
 * expect (int64 [R]: the tokens per rank the caller sized the block for)): a sender's plan block
 * counts[R] | (per expert, left to the caller) | chan[R * C] (inclusive prefix over DeepEP's channels: channel c
 * owns tokens [c * ceil(T / C), ...)) | tokens (per rank, ascending), and the handle's send_head (position of a
 * token among those sent to a rank, -1: not sent). Returns -1, or the first rank whose count differs from
 * expect (nothing written past the counts then). */
i64 zbk_ep_route(const void *args) {
    const zb_ep_route *a = args;
    const uint8_t *in_rank = PTR(const uint8_t *, a->in_rank);
    i64 T = a->T, R = a->R, C = a->C, E = a->E, len = a->meta_len;
    i64 *meta = PTR(i64 *, a->meta), *expect = PTR(i64 *, a->expect);
    int32_t *head = PTR(int32_t *, a->head_out);
    i64 at[ZB_MAXW], first[ZB_MAXW], total = 0;
    if (R > ZB_MAXW || C < 1) return 0;
    for (i64 r = 0; r < R; r++) meta[r] = 0;
    for (i64 t = 0; t < T; t++)
        for (i64 r = 0; r < R; r++) meta[r] += in_rank[t * R + r] != 0;
    for (i64 r = 0; r < R; r++) {
        if (meta[r] != expect[r]) return r;
        at[r] = R + E + R * C + total;
        total += meta[r];
    }
    if (R + E + R * C + total > len) return 0;
    i64 *chan = meta + R + E, per = (T + C - 1) / C;
    if (per < 1) per = 1;
    for (i64 i = 0; i < R * C; i++) chan[i] = 0;
    for (i64 r = 0; r < R; r++) first[r] = at[r];
    for (i64 t = 0; t < T; t++) {
        i64 c = t / per;
        for (i64 r = 0; r < R; r++) {
            if (in_rank[t * R + r]) {
                head[t * R + r] = (int32_t)(at[r] - first[r]);
                meta[at[r]++] = t;
                chan[r * C + c]++;
            } else {
                head[t * R + r] = -1;
            }
        }
    }
    for (i64 r = 0; r < R; r++)
        for (i64 c = 1; c < C; c++) chan[r * C + c] += chan[r * C + c - 1];
    return -1;
}
