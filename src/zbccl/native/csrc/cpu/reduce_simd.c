/* zbccl vector kernels for the common case: SUM or AVG of float32, bfloat16 or float16.
 *
 * One fused pass per block of elements: load every source, widen to fp32,
 * add in source (rank) order, divide for AVG, round once, store. The
 * arithmetic is the scalar kernels' (reduce.c) step for step, so the result
 * is bitwise the same whichever kernel runs: IEEE fp32 adds in the same
 * order, bf16 rounded to nearest even with NaN made the canonical quiet NaN,
 * fp16 through the hardware's round-to-nearest-even conversion.
 *
 * Stores are cached or non-temporal (`stream`): a streaming store does not
 * read the destination line for ownership and does not wait on invalidating
 * a peer's copy, which is what a write into lines a peer has just read costs
 * (docs/benchmarks.md, "Host state probe"). A streamed kernel ends with sfence.
 *
 * Dispatch: AVX-512 (F+BW) or AVX2+F16C, chosen once per process from CPUID;
 * elsewhere zb_simd_sum returns 0 and the caller uses the scalar kernels.
 */
#include "reduce.h"

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,f16c,fma")))
#define T256 __attribute__((target("avx2,f16c,fma")))

/* -------------------------------------------------------------- AVX-512: 16 lanes */
T512 static inline __m512 ld512(const void *p, int dt) {
    if (dt == ZB_DT_F32) return _mm512_loadu_ps(p);
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    if (dt == ZB_DT_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

T512 static inline __m256i bf16_512(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    __m512i mag = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
    __mmask16 nan = _mm512_cmpgt_epu32_mask(mag, _mm512_set1_epi32(0x7f800000));
    __m512i qnan = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x8000)),
                                   _mm512_set1_epi32(0x7fc0));
    return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(r, nan, qnan));
}

T512 static inline void st512(void *p, __m512 v, int dt, int stream) {
    if (dt == ZB_DT_F32) {
        if (stream) _mm512_stream_ps(p, v);
        else _mm512_storeu_ps(p, v);
        return;
    }
    __m256i h = dt == ZB_DT_F16 ? _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC) : bf16_512(v);
    if (stream) _mm256_stream_si256((__m256i *)p, h);
    else _mm256_storeu_si256((__m256i *)p, h);
}

/* One copy of the loop per dtype and store kind, so the per-vector branches fold away. */
#define SUM_LOOP(W, LD, ST, DIV, SET1, ADD)                                      \
    const __m##W d = SET1(divisor);                                              \
    long i = 0;                                                                  \
    for (; i + (W / 32) <= m; i += W / 32) {                                     \
        long b = i * isz;                                                        \
        __m##W acc = LD(s[0] + b, dt);                                           \
        for (long k = 1; k < n; k++) acc = ADD(acc, LD(s[k] + b, dt));           \
        if (avg) acc = DIV(acc, d);                                              \
        ST(dst + b, acc, dt, stream);                                            \
    }                                                                            \
    return i;

#define SUM_FN(name, T, W, LD, ST, DIV, SET1, ADD, DT, STREAM)                                            \
    T static long name(char *dst, const char *const *s, long n, long m, long isz, int avg, float divisor) { \
        const int dt = DT, stream = STREAM;                                                              \
        SUM_LOOP(W, LD, ST, DIV, SET1, ADD)                                                              \
    }

#define SUM512(name, DT, STREAM) SUM_FN(name, T512, 512, ld512, st512, _mm512_div_ps, _mm512_set1_ps, _mm512_add_ps, DT, STREAM)
SUM512(s512_f32, ZB_DT_F32, 0)
SUM512(s512_f32_nt, ZB_DT_F32, 1)
SUM512(s512_f16, ZB_DT_F16, 0)
SUM512(s512_f16_nt, ZB_DT_F16, 1)

/* --------------------------------------------------------------- AVX2: 8 lanes */
T256 static inline __m256 ld256(const void *p, int dt) {
    if (dt == ZB_DT_F32) return _mm256_loadu_ps(p);
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (dt == ZB_DT_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

T256 static inline __m128i bf16_256(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    __m256i mag = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
    __m256i nan = _mm256_cmpgt_epi32(mag, _mm256_set1_epi32(0x7f800000)); /* mag < 2^31: signed compare is fine */
    __m256i qnan = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x8000)),
                                   _mm256_set1_epi32(0x7fc0));
    r = _mm256_blendv_epi8(r, qnan, nan);
    /* pack the low 16 bits of 8 lanes (values < 2^16, so unsigned saturation keeps them) */
    __m128i lo = _mm256_castsi256_si128(r), hi = _mm256_extracti128_si256(r, 1);
    return _mm_packus_epi32(lo, hi);
}

T256 static inline void st256(void *p, __m256 v, int dt, int stream) {
    if (dt == ZB_DT_F32) {
        if (stream) _mm256_stream_ps(p, v);
        else _mm256_storeu_ps(p, v);
        return;
    }
    __m128i h = dt == ZB_DT_F16 ? _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC) : bf16_256(v);
    if (stream) _mm_stream_si128((__m128i *)p, h);
    else _mm_storeu_si128((__m128i *)p, h);
}

/* bf16 with AVX-512, 32 elements a step and no lane shuffles: the even elements of a 32-bit pair widen by
 * a shift, the odd ones by a mask; both halves are summed as they lie and rounded into their own half. */
T512 static inline __m512i rne_high(__m512 v) { /* each lane rounded to bf16, in its high 16 bits */
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i t = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    __m512i q = _mm512_or_si512(_mm512_and_si512(u, _mm512_set1_epi32((int)0x80000000u)),
                                _mm512_set1_epi32(0x7fc00000));
    return _mm512_and_si512(_mm512_mask_mov_epi32(t, nan, q), _mm512_set1_epi32((int)0xffff0000u));
}

#define BF16_PAIR_SUM(STREAM)                                                                            \
    const __m512 d = _mm512_set1_ps(divisor);                                                            \
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);                                              \
    long i = 0;                                                                                          \
    for (; i + 32 <= m; i += 32) {                                                                       \
        __m512i x = _mm512_loadu_si512(s[0] + 2 * i);                                                    \
        __m512 e = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)), o = _mm512_castsi512_ps(_mm512_and_si512(x, hi)); \
        for (long k = 1; k < n; k++) {                                                                   \
            x = _mm512_loadu_si512(s[k] + 2 * i);                                                        \
            e = _mm512_add_ps(e, _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)));                         \
            o = _mm512_add_ps(o, _mm512_castsi512_ps(_mm512_and_si512(x, hi)));                          \
        }                                                                                                \
        if (avg) e = _mm512_div_ps(e, d), o = _mm512_div_ps(o, d);                                       \
        __m512i r = _mm512_or_si512(_mm512_srli_epi32(rne_high(e), 16), rne_high(o));                    \
        if (STREAM) _mm512_stream_si512((__m512i *)(dst + 2 * i), r);                                    \
        else _mm512_storeu_si512(dst + 2 * i, r);                                                        \
    }                                                                                                    \
    return i;

T512 static long s512_bf16(char *dst, const char *const *s, long n, long m, long isz, int avg, float divisor) {
    (void)isz;
    BF16_PAIR_SUM(0)
}

T512 static long s512_bf16_nt(char *dst, const char *const *s, long n, long m, long isz, int avg, float divisor) {
    (void)isz;
    BF16_PAIR_SUM(1)
}

#define SUM256(name, DT, STREAM) SUM_FN(name, T256, 256, ld256, st256, _mm256_div_ps, _mm256_set1_ps, _mm256_add_ps, DT, STREAM)
SUM256(s256_f32, ZB_DT_F32, 0)
SUM256(s256_f32_nt, ZB_DT_F32, 1)
SUM256(s256_bf16, ZB_DT_BF16, 0)
SUM256(s256_bf16_nt, ZB_DT_BF16, 1)
SUM256(s256_f16, ZB_DT_F16, 0)
SUM256(s256_f16_nt, ZB_DT_F16, 1)

typedef long (*sum_fn)(char *, const char *const *, long, long, long, int, float);
/* [level - 1][dtype][stream] */
static const sum_fn SUMS[2][3][2] = {
    {{s256_f32, s256_f32_nt}, {s256_bf16, s256_bf16_nt}, {s256_f16, s256_f16_nt}},
    {{s512_f32, s512_f32_nt}, {s512_bf16, s512_bf16_nt}, {s512_f16, s512_f16_nt}},
};

static int simd_level(void) {
    static int level = -1;
    if (level < 0) {
        __builtin_cpu_init();
        int l = 0;
        if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma")) l = 1;
        if (l && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512vl"))
            l = 2;
        level = l;
    }
    return level;
}

/* The EP low-latency combine's weighted rows (reduce.c zb_weighted_rows_bf16), 16 lanes at a time: the same
 * fp32 product and sum per element, in the same order (mul and add with explicit rounding: never fused into an
 * FMA), and the same bf16 rounding, so the result is bitwise the scalar kernel's. */
T512 static void wrows512(uint16_t *dst, const uint16_t *const *src, const float *w, long tokens, long k, long width,
                          float *acc) {
    const int rn = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    long vw = width & ~15L;
    for (long t = 0; t < tokens; t++) {
        for (long i = 0; i < width; i++) acc[i] = 0.0f;
        for (long j = 0; j < k; j++) {
            const uint16_t *row = src[t * k + j];
            if (!row) continue;
            float wj = w[t * k + j];
            __m512 vwj = _mm512_set1_ps(wj);
            for (long i = 0; i < vw; i += 16) {
                __m512 p = _mm512_mul_round_ps(ld512(row + i, ZB_DT_BF16), vwj, rn);
                _mm512_storeu_ps(acc + i, _mm512_add_round_ps(_mm512_loadu_ps(acc + i), p, rn));
            }
            for (long i = vw; i < width; i++) {
                uint32_t u = (uint32_t)row[i] << 16;
                float x, p;
                memcpy(&x, &u, 4);
                p = x * wj;
                __asm__("" : "+x"(p)); /* keep the product rounded on its own: no contraction with the add */
                acc[i] += p;
            }
        }
        long i = 0;
        for (; i < vw; i += 16) _mm256_storeu_si256((__m256i *)(dst + t * width + i), bf16_512(_mm512_loadu_ps(acc + i)));
        if (i < width) {
            __mmask16 m = (__mmask16)((1u << (width - i)) - 1);
            __m512 v = _mm512_maskz_loadu_ps(m, acc + i);
            _mm256_mask_storeu_epi16(dst + t * width + i, m, bf16_512(v));
        }
    }
}

int zb_simd_weighted_rows_bf16(uint16_t *dst, const uint16_t *const *src, const float *w, long tokens, long k,
                               long width, float *acc) {
    if (simd_level() != 2) return 0;
    wrows512(dst, src, w, tokens, k, width, acc);
    return 1;
}

long zb_simd_sum(void *dst, const void *const *srcs, long n, long m, int dtype, int avg, float divisor, int stream) {
    if (dtype != ZB_DT_F32 && dtype != ZB_DT_BF16 && dtype != ZB_DT_F16) return 0;
    long isz = dtype == ZB_DT_F32 ? 4 : 2;
    int level = simd_level();
    const char *const *s = (const char *const *)srcs;
    /* a streamed store needs its destination aligned to the vector: otherwise fewer lanes, or none */
    if (level == 2 && stream && ((uintptr_t)dst & (16 * isz - 1))) level = 1;
    if (level == 1 && stream && ((uintptr_t)dst & (8 * isz - 1))) level = 0;
    if (!level) return 0;
    return SUMS[level - 1][dtype][stream ? 1 : 0]((char *)dst, s, n, m, isz, avg, divisor);
}
#else
int zb_simd_weighted_rows_bf16(uint16_t *dst, const uint16_t *const *src, const float *w, long tokens, long k,
                               long width, float *acc) {
    (void)dst, (void)src, (void)w, (void)tokens, (void)k, (void)width, (void)acc;
    return 0;
}
long zb_simd_sum(void *dst, const void *const *srcs, long n, long m, int dtype, int avg, float divisor, int stream) {
    (void)dst, (void)srcs, (void)n, (void)m, (void)dtype, (void)avg, (void)divisor, (void)stream;
    return 0;
}
#endif
