/* zbccl native reductions and copies over raw addresses (see reduce.c). */
#ifndef ZBCCL_REDUCE_H
#define ZBCCL_REDUCE_H

/* dtype codes ZB_DT_* and reduce-op codes ZB_OP_*: generated from zbccl/native/abi.py */
#include <stdint.h>

#include "zb_abi.h"

/* 1 if the (dtype, op) pair is supported. */
int zb_reduce_valid(int dtype, int op);
/* dst[i] = op over srcs[0..n-1][i] for i < count (elements); AVG divides by divisor. dst may alias a source. */
void zb_reduce_n(void *dst, const void *const *srcs, long n, long count, int dtype, int op, double divisor,
                 int nthreads);
/* zb_reduce_n whose stores are non-temporal (dst's lines are not read for ownership; ends with sfence). */
void zb_reduce_n_stream(void *dst, const void *const *srcs, long n, long count, int dtype, int op, double divisor,
                        int nthreads);
/* reduce_simd.c: dst[i] = sum (or average) of srcs[k][i] for the leading elements of [0, m) it can do with
 * vector code (float32/bfloat16/float16 only); returns how many (0: none, the caller does the rest). */
long zb_simd_sum(void *dst, const void *const *srcs, long n, long m, int dtype, int avg, float divisor, int stream);
/* Weighted bf16 row sums in fp32 (EP low-latency combine): dst[t] = bf16(sum_j w[t*k+j] * src[t*k+j]), products
 * and sums rounded to fp32 in j order, null sources skipped; acc: fp32 scratch of width elements. */
void zb_weighted_rows_bf16(uint16_t *dst, const uint16_t *const *src, const float *w, long tokens, long k,
                           long width, float *acc);
/* The same with AVX-512 (bitwise equal); 0 when this CPU has no such kernel (the caller runs the scalar one). */
int zb_simd_weighted_rows_bf16(uint16_t *dst, const uint16_t *const *src, const float *w, long tokens, long k,
                               long width, float *acc);
/* memcpy split over nthreads for large sizes. */
void zb_copy(void *dst, const void *src, long nbytes, int nthreads);
/* The same with non-temporal stores and a closing store fence (large writes into lines peers hold). */
void zb_copy_stream(void *dst, const void *src, long nbytes, int nthreads);
/* rows blocks of rowbytes: row i from src + i*src_stride to dst + i*dst_stride (stream: non-temporal
 * stores and a closing fence, as zb_copy_stream); large copies split over nthreads. */
void zb_copy_rows(void *dst, long dst_stride, const void *src, long src_stride, long rows, long rowbytes,
                  int nthreads, int stream);

#endif
