"""The vector sum kernels (native/csrc/cpu/reduce_simd.c) give the scalar kernels' bits: fp32 adds in source
order, one rounding (bf16 to nearest even, NaN made quiet; fp16 by the hardware conversion)."""

from __future__ import annotations

import pytest
import torch

from zbccl.native import core
from zbccl.native.abi import DTYPES, REDUCE_OPS

CODES = {torch.float32: DTYPES["F32"], torch.bfloat16: DTYPES["BF16"], torch.float16: DTYPES["F16"]}


def _inputs(n: int, w: int, dtype: torch.dtype) -> list[torch.Tensor]:
    big = 60000.0 if dtype == torch.float16 else 3e38
    out = []
    for k in range(w):
        x = ((torch.arange(n, dtype=torch.float32) * (k + 1.37)) % 977 - 488).mul(7.3 + k).to(dtype)
        x[7::29] = float("nan")
        x[3::31] = float("inf")
        x[5::37] = -float("inf")
        x[1::11] = big  # sums overflow to inf in the narrow types
        x[2::13] = 1e-41 if dtype == torch.float32 else 1e-7  # subnormal-ish values
        out.append(x)
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.float().nan_to_num(0.0), b.float().nan_to_num(0.0))


@pytest.mark.parametrize("dtype", list(CODES))
@pytest.mark.parametrize("op", ["SUM", "AVG"])
def test_vector_sum_matches_fp32_reference(dtype, op):
    m = core()
    for n in (1, 15, 16, 31, 32, 33, 2047, 2048, 2049, 4099):
        for w in (1, 2, 3, 5):
            xs = _inputs(n, w, dtype)
            srcs = torch.tensor([x.data_ptr() for x in xs], dtype=torch.int64)
            for offset in (0, 1):  # an unaligned destination too
                dst = torch.empty(n + 1, dtype=dtype)[offset:offset + n]
                m.reduce_n(dst.data_ptr(), srcs.data_ptr(), w, n, CODES[dtype], REDUCE_OPS[op], float(w), 1)
                acc = xs[0].float()
                for x in xs[1:]:
                    acc = acc + x.float()
                if op == "AVG":
                    acc = acc / w
                assert _same(dst, acc.to(dtype)), (dtype, op, n, w, offset)
