/* zbccl native reductions and copies over raw addresses (see reduce.c). */
#ifndef ZBCCL_REDUCE_H
#define ZBCCL_REDUCE_H

/* dtype codes: must match zbccl/ops/dtypes.py */
enum { ZB_DT_F32 = 0, ZB_DT_BF16 = 1, ZB_DT_F16 = 2, ZB_DT_F64 = 3, ZB_DT_I8 = 4, ZB_DT_U8 = 5,
       ZB_DT_I16 = 6, ZB_DT_I32 = 7, ZB_DT_I64 = 8, ZB_DT_BOOL = 9 };
/* reduce-op codes: must match zbccl/ops/dtypes.py */
enum { ZB_OP_SUM = 0, ZB_OP_PROD = 1, ZB_OP_MAX = 2, ZB_OP_MIN = 3, ZB_OP_AVG = 4 };

/* 1 if the (dtype, op) pair is supported. */
int zb_reduce_valid(int dtype, int op);
/* dst[i] = op over srcs[0..n-1][i] for i < count (elements); AVG divides by divisor. dst may alias a source. */
void zb_reduce_n(void *dst, const void *const *srcs, long n, long count, int dtype, int op, double divisor,
                 int nthreads);
/* memcpy split over nthreads for large sizes. */
void zb_copy(void *dst, const void *src, long nbytes, int nthreads);
/* The same with non-temporal stores and a closing store fence (large writes into lines peers hold). */
void zb_copy_stream(void *dst, const void *src, long nbytes, int nthreads);

#endif
