/* zbccl native reductions: dst[i] = op(src[0][i], src[1][i], ..., src[n-1][i]).
 *
 * One pass: every source is read once and dst is written once. Work is cut
 * into blocks of BLOCK elements; a block's accumulator lives in a small fp32
 * (or fp64 / native integer) array that stays in L1 while the n sources
 * stream through it. Sources are always combined in index order (0, 1, ...),
 * and the caller passes them in rank order, so every rank computes the same
 * bits (bf16/fp16 accumulate in fp32 and round once, at the store).
 *
 * CPU dispatch: on x86-64 the block kernels are compiled three times
 * (x86-64-v4 = AVX-512, v3 = AVX2+F16C+FMA, baseline) with GCC's
 * target_clones; the loader picks one per machine (ifunc). Elsewhere the
 * compiler's own vectorisation for the target is used.
 *
 * Threads: blocks are split statically over `nthreads` OpenMP threads; a
 * block never straddles two threads, so results do not depend on nthreads.
 */
#include "reduce.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define ZB_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define ZB_CLONES
#endif

#define BLOCK 2048

/* ---------------------------------------------------------------- conversions */
static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    /* round to nearest even; NaN stays a (quiet) NaN */
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    uint32_t nan = ((u >> 16) & 0x8000u) | 0x7fc0u;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

/* dst[t] = bf16(sum over j < k of w[t * k + j] * src[t * k + j][0 .. width)), each product rounded to fp32 and
 * added in j order to an fp32 accumulator that starts at 0 (torch's mul_ then index_add_, bit for bit); a
 * null source is skipped. acc: fp32 scratch of width elements. */
void zb_weighted_rows_bf16(uint16_t *dst, const uint16_t *const *src, const float *w, long tokens, long k,
                           long width, float *acc) {
    if (zb_simd_weighted_rows_bf16(dst, src, w, tokens, k, width, acc)) return;
    for (long t = 0; t < tokens; t++) {
        for (long i = 0; i < width; i++) acc[i] = 0.0f;
        for (long j = 0; j < k; j++) {
            const uint16_t *row = src[t * k + j];
            if (!row) continue;
            float wj = w[t * k + j];
            for (long i = 0; i < width; i++) {
                float p = bf16_to_f32(row[i]) * wj;
                acc[i] += p;
            }
        }
        for (long i = 0; i < width; i++) dst[t * width + i] = f32_to_bf16(acc[i]);
    }
}

static inline float f16_to_f32(uint16_t h) {
#if defined(__FLT16_MAX__)
    _Float16 v;
    memcpy(&v, &h, 2);
    return (float)v;
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
    if (exp == 0) {
        if (man == 0) u = sign;
        else { float f = ldexpf((float)man, -24); memcpy(&u, &f, 4); u |= sign; }
    } else if (exp == 31) u = sign | 0x7f800000u | (man << 13);
    else u = sign | ((exp + 112) << 23) | (man << 13);
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

static inline uint16_t f32_to_f16(float f) {
#if defined(__FLT16_MAX__)
    _Float16 v = (_Float16)f;
    uint16_t h;
    memcpy(&h, &v, 2);
    return h;
#else
    /* portable round-to-nearest-even conversion */
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);
    if (a >= 0x47800000u) return (uint16_t)(sign | 0x7c00u);
    if (a < 0x38800000u) { /* subnormal or zero */
        float m;
        uint32_t am = a;
        memcpy(&m, &am, 4);
        return (uint16_t)(sign | (uint32_t)lrintf(m * 16777216.0f));
    }
    uint32_t r = a + 0x0fffu + ((a >> 13) & 1u) - 0x38000000u;
    return (uint16_t)(sign | (r >> 13));
#endif
}

/* ------------------------------------------------------------- block kernels */
#define COMBINE(op, acc, x)                                  \
    switch (op) {                                            \
    case ZB_OP_SUM: case ZB_OP_AVG:                          \
        for (long i = 0; i < m; i++) acc[i] += (x);          \
        break;                                               \
    case ZB_OP_PROD:                                         \
        for (long i = 0; i < m; i++) acc[i] *= (x);          \
        break;                                               \
    case ZB_OP_MAX:                                          \
        for (long i = 0; i < m; i++) { float _v = (x); acc[i] = _v > acc[i] || _v != _v ? _v : acc[i]; } \
        break;                                               \
    default:                                                 \
        for (long i = 0; i < m; i++) { float _v = (x); acc[i] = _v < acc[i] || _v != _v ? _v : acc[i]; } \
        break;                                               \
    }

/* 16-bit floats (bf16 when is_bf16, else fp16), accumulated in fp32. */
ZB_CLONES static void block_half(uint16_t *dst, const uint16_t *const *srcs, long n, long off, long m,
                                 int op, float divisor, int is_bf16) {
    float acc[BLOCK];
    const uint16_t *s0 = srcs[0] + off;
    if (is_bf16) for (long i = 0; i < m; i++) acc[i] = bf16_to_f32(s0[i]);
    else for (long i = 0; i < m; i++) acc[i] = f16_to_f32(s0[i]);
    for (long k = 1; k < n; k++) {
        const uint16_t *s = srcs[k] + off;
        if (is_bf16) { COMBINE(op, acc, bf16_to_f32(s[i])); }
        else { COMBINE(op, acc, f16_to_f32(s[i])); }
    }
    uint16_t *d = dst + off;
    if (op == ZB_OP_AVG) for (long i = 0; i < m; i++) acc[i] /= divisor;
    if (is_bf16) for (long i = 0; i < m; i++) d[i] = f32_to_bf16(acc[i]);
    else for (long i = 0; i < m; i++) d[i] = f32_to_f16(acc[i]);
}

ZB_CLONES static void block_f32(float *dst, const float *const *srcs, long n, long off, long m, int op,
                                float divisor) {
    float acc[BLOCK];
    memcpy(acc, srcs[0] + off, (size_t)m * sizeof(float));
    for (long k = 1; k < n; k++) {
        const float *s = srcs[k] + off;
        COMBINE(op, acc, s[i]);
    }
    if (op == ZB_OP_AVG) for (long i = 0; i < m; i++) acc[i] /= divisor;
    memcpy(dst + off, acc, (size_t)m * sizeof(float));
}

#define COMBINE_T(op, acc, x)                                                      \
    switch (op) {                                                                  \
    case ZB_OP_SUM: case ZB_OP_AVG: for (long i = 0; i < m; i++) acc[i] += (x); break; \
    case ZB_OP_PROD: for (long i = 0; i < m; i++) acc[i] *= (x); break;            \
    case ZB_OP_MAX: for (long i = 0; i < m; i++) acc[i] = (x) > acc[i] ? (x) : acc[i]; break; \
    default: for (long i = 0; i < m; i++) acc[i] = (x) < acc[i] ? (x) : acc[i]; break; \
    }

ZB_CLONES static void block_f64(double *dst, const double *const *srcs, long n, long off, long m, int op,
                                double divisor) {
    double acc[BLOCK];
    memcpy(acc, srcs[0] + off, (size_t)m * sizeof(double));
    for (long k = 1; k < n; k++) {
        const double *s = srcs[k] + off;
        if (op == ZB_OP_MAX) { for (long i = 0; i < m; i++) acc[i] = s[i] > acc[i] || s[i] != s[i] ? s[i] : acc[i]; }
        else if (op == ZB_OP_MIN) { for (long i = 0; i < m; i++) acc[i] = s[i] < acc[i] || s[i] != s[i] ? s[i] : acc[i]; }
        else { COMBINE_T(op, acc, s[i]); }
    }
    if (op == ZB_OP_AVG) for (long i = 0; i < m; i++) acc[i] /= divisor;
    memcpy(dst + off, acc, (size_t)m * sizeof(double));
}

/* Integers wrap like torch's integer arithmetic. U is an unsigned type at least as wide as
 * unsigned int: a narrower one (uint16_t) is promoted to signed int before the multiply, and
 * 65535 * 65535 overflows int (undefined behaviour). The cast back to T keeps the low bits. */
#define INT_KERNEL(name, T, U)                                                                  \
    ZB_CLONES static void name(T *dst, const T *const *srcs, long n, long off, long m, int op) {   \
        T acc[BLOCK];                                                                           \
        memcpy(acc, srcs[0] + off, (size_t)m * sizeof(T));                                      \
        for (long k = 1; k < n; k++) {                                                          \
            const T *s = srcs[k] + off;                                                         \
            if (op == ZB_OP_SUM) { for (long i = 0; i < m; i++) acc[i] = (T)((U)acc[i] + (U)s[i]); } \
            else if (op == ZB_OP_PROD) { for (long i = 0; i < m; i++) acc[i] = (T)((U)acc[i] * (U)s[i]); } \
            else if (op == ZB_OP_MAX) { for (long i = 0; i < m; i++) acc[i] = s[i] > acc[i] ? s[i] : acc[i]; } \
            else { for (long i = 0; i < m; i++) acc[i] = s[i] < acc[i] ? s[i] : acc[i]; }        \
        }                                                                                       \
        memcpy(dst + off, acc, (size_t)m * sizeof(T));                                          \
    }

INT_KERNEL(block_i8, int8_t, uint32_t)
INT_KERNEL(block_u8, uint8_t, uint32_t)
INT_KERNEL(block_i16, int16_t, uint32_t)
INT_KERNEL(block_i32, int32_t, uint32_t)
INT_KERNEL(block_i64, int64_t, uint64_t)

/* bool: sum/max are "any", prod/min are "all" (torch's bool semantics). */
static void block_bool(uint8_t *dst, const uint8_t *const *srcs, long n, long off, long m, int op) {
    uint8_t acc[BLOCK];
    for (long i = 0; i < m; i++) acc[i] = srcs[0][off + i] != 0;
    for (long k = 1; k < n; k++) {
        const uint8_t *s = srcs[k] + off;
        if (op == ZB_OP_SUM || op == ZB_OP_MAX) for (long i = 0; i < m; i++) acc[i] |= s[i] != 0;
        else for (long i = 0; i < m; i++) acc[i] &= s[i] != 0;
    }
    memcpy(dst + off, acc, (size_t)m);
}

static long dtype_size(int dtype) {
    switch (dtype) {
    case ZB_DT_F32: case ZB_DT_I32: return 4;
    case ZB_DT_BF16: case ZB_DT_F16: case ZB_DT_I16: return 2;
    case ZB_DT_F64: case ZB_DT_I64: return 8;
    default: return 1;
    }
}

/* The vector kernel (reduce_simd.c) for float SUM/AVG: how many leading elements it did. */
static long simd_part(char *dst, const void *const *srcs, long n, long off, long m, int dtype, int op,
                      double divisor, int stream) {
    if ((op != ZB_OP_SUM && op != ZB_OP_AVG) || (dtype != ZB_DT_F32 && dtype != ZB_DT_BF16 && dtype != ZB_DT_F16))
        return 0;
    long isz = dtype_size(dtype);
    const void *part[ZB_MAXW];
    for (long k = 0; k < n; k++) part[k] = (const char *)srcs[k] + off * isz;
    return zb_simd_sum(dst + off * isz, part, n, m, dtype, op == ZB_OP_AVG, (float)divisor, stream);
}

static void reduce_block(void *dst, const void *const *srcs, long n, long off, long m, int dtype, int op,
                         double divisor) {
    long done = simd_part(dst, srcs, n, off, m, dtype, op, divisor, 0);
    if (done == m) return;
    off += done, m -= done;
    switch (dtype) {
    case ZB_DT_F32: block_f32(dst, (const float *const *)srcs, n, off, m, op, (float)divisor); break;
    case ZB_DT_BF16: block_half(dst, (const uint16_t *const *)srcs, n, off, m, op, (float)divisor, 1); break;
    case ZB_DT_F16: block_half(dst, (const uint16_t *const *)srcs, n, off, m, op, (float)divisor, 0); break;
    case ZB_DT_F64: block_f64(dst, (const double *const *)srcs, n, off, m, op, divisor); break;
    case ZB_DT_I8: block_i8(dst, (const int8_t *const *)srcs, n, off, m, op); break;
    case ZB_DT_U8: block_u8(dst, (const uint8_t *const *)srcs, n, off, m, op); break;
    case ZB_DT_I16: block_i16(dst, (const int16_t *const *)srcs, n, off, m, op); break;
    case ZB_DT_I32: block_i32(dst, (const int32_t *const *)srcs, n, off, m, op); break;
    case ZB_DT_I64: block_i64(dst, (const int64_t *const *)srcs, n, off, m, op); break;
    default: block_bool(dst, (const uint8_t *const *)srcs, n, off, m, op); break;
    }
}

int zb_reduce_valid(int dtype, int op) {
    if (dtype < 0 || dtype > ZB_DT_BOOL || op < 0 || op > ZB_OP_AVG) return 0;
    if (op == ZB_OP_AVG && dtype >= ZB_DT_I8) return 0; /* average needs a float type */
    return 1;
}

void zb_reduce_n(void *dst, const void *const *srcs, long n, long count, int dtype, int op, double divisor,
                 int nthreads) {
    long nblocks = (count + BLOCK - 1) / BLOCK;
    if (nthreads > 1 && nblocks > 1) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
        for (long b = 0; b < nblocks; b++) {
            long off = b * BLOCK, m = count - off < BLOCK ? count - off : BLOCK;
            reduce_block(dst, srcs, n, off, m, dtype, op, divisor);
        }
        return;
    }
    for (long b = 0; b < nblocks; b++) {
        long off = b * BLOCK, m = count - off < BLOCK ? count - off : BLOCK;
        reduce_block(dst, srcs, n, off, m, dtype, op, divisor);
    }
}

/* Split a copy into 1 MiB pieces over nthreads when it is large enough to pay for the threads. */
static void split_copy(void *dst, const void *src, long nbytes, int nthreads,
                       void (*fn)(char *, const char *, long)) {
    const long piece = 1L << 20;
    if (nthreads > 1 && nbytes >= 2 * piece) {
        long np = (nbytes + piece - 1) / piece;
#pragma omp parallel for num_threads(nthreads) schedule(static)
        for (long p = 0; p < np; p++) {
            long off = p * piece, m = nbytes - off < piece ? nbytes - off : piece;
            fn((char *)dst + off, (const char *)src + off, m);
        }
        return;
    }
    fn(dst, src, nbytes);
}

static void copy_plain(char *dst, const char *src, long nbytes) { memcpy(dst, src, (size_t)nbytes); }

void zb_copy(void *dst, const void *src, long nbytes, int nthreads) {
    split_copy(dst, src, nbytes, nthreads, copy_plain);
}

#if defined(__x86_64__)
#include <immintrin.h>
/* Streaming (non-temporal) copy: stores go to memory without first reading the destination
 * lines into this core's cache, and without waiting on each invalidation when another core
 * holds those lines. Used for large writes into lines a peer has just read (the twoshot
 * gather), where cached stores stall on one invalidation per line. Ends with sfence, so a
 * following release store (the phase/done flag) is ordered after the data. */
static void copy_stream(char *dst, const char *src, long nbytes) {
    long head = (long)((64 - ((uintptr_t)dst & 63)) & 63);
    if (head > nbytes) head = nbytes;
    memcpy(dst, src, (size_t)head);
    dst += head, src += head, nbytes -= head;
    long n16 = nbytes / 16;
    for (long i = 0; i < n16; i++)
        _mm_stream_si128((__m128i *)(dst + 16 * i), _mm_loadu_si128((const __m128i *)(src + 16 * i)));
    memcpy(dst + 16 * n16, src + 16 * n16, (size_t)(nbytes - 16 * n16));
    _mm_sfence();
}
static void store_fence(void) { _mm_sfence(); }
#else
static void copy_stream(char *dst, const char *src, long nbytes) {
    memcpy(dst, src, (size_t)nbytes);
    __atomic_thread_fence(__ATOMIC_RELEASE);
}
static void store_fence(void) { __atomic_thread_fence(__ATOMIC_RELEASE); }
#endif

void zb_copy_stream(void *dst, const void *src, long nbytes, int nthreads) {
    split_copy(dst, src, nbytes, nthreads, copy_stream);
}

void zb_copy_rows(void *dst, long dst_stride, const void *src, long src_stride, long rows, long rowbytes,
                  int nthreads, int stream) {
    void (*fn)(char *, const char *, long) = stream ? copy_stream : copy_plain;
    if (rows == 1 || rowbytes >= (2L << 20)) { /* few large rows: each split over the threads */
        for (long i = 0; i < rows; i++)
            split_copy((char *)dst + i * dst_stride, (const char *)src + i * src_stride, rowbytes, nthreads, fn);
        return;
    }
    if (nthreads > 1 && rows * rowbytes >= (2L << 20)) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
        for (long i = 0; i < rows; i++) fn((char *)dst + i * dst_stride, (const char *)src + i * src_stride, rowbytes);
        return;
    }
    for (long i = 0; i < rows; i++) fn((char *)dst + i * dst_stride, (const char *)src + i * src_stride, rowbytes);
}

/* One block reduced into an L1-resident buffer, then streamed out: no read-for-ownership of dst's
 * lines and no wait on the invalidation of a peer's copy (see copy_stream). */
static void reduce_block_stream(char *dst, const void *const *srcs, long n, long off, long m, int dtype, int op,
                                double divisor, long isz) {
    long done = simd_part(dst, srcs, n, off, m, dtype, op, divisor, 1);
    if (done == m) return;
    off += done, m -= done;
    _Alignas(64) char tmp[BLOCK * 8];
    const void *part[ZB_MAXW];
    for (long k = 0; k < n; k++) part[k] = (const char *)srcs[k] + off * isz;
    reduce_block(tmp, part, n, 0, m, dtype, op, divisor);
    copy_stream(dst + off * isz, tmp, m * isz);
}

void zb_reduce_n_stream(void *dst, const void *const *srcs, long n, long count, int dtype, int op, double divisor,
                        int nthreads) {
    long nblocks = (count + BLOCK - 1) / BLOCK, isz = dtype_size(dtype);
    if (n > ZB_MAXW) n = ZB_MAXW;
    if (nthreads > 1 && nblocks > 1) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
        for (long b = 0; b < nblocks; b++) {
            long off = b * BLOCK, m = count - off < BLOCK ? count - off : BLOCK;
            reduce_block_stream(dst, srcs, n, off, m, dtype, op, divisor, isz);
        }
    } else {
        for (long b = 0; b < nblocks; b++) {
            long off = b * BLOCK, m = count - off < BLOCK ? count - off : BLOCK;
            reduce_block_stream(dst, srcs, n, off, m, dtype, op, divisor, isz);
        }
    }
    store_fence();
}
