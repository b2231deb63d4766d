"""dtype and reduce-op codes shared with the native kernels (``csrc/reduce.h``)."""

from __future__ import annotations

import torch

from ..errors import ZbcclInvalidUsageError

__all__ = ["DTYPE_CODES", "CODE_DTYPES", "REDUCE_OPS", "dtype_code", "reduce_op_code", "op_name",
           "SUM", "PROD", "MAX", "MIN", "AVG"]

DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float64: 3, torch.int8: 4,
    torch.uint8: 5, torch.int16: 6, torch.int32: 7, torch.int64: 8, torch.bool: 9,
}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}

SUM, PROD, MAX, MIN, AVG = 0, 1, 2, 3, 4
REDUCE_OPS: dict[str, int] = {"sum": SUM, "prod": PROD, "product": PROD, "max": MAX, "min": MIN,
                              "avg": AVG, "mean": AVG}
_NAMES = {SUM: "sum", PROD: "product", MAX: "max", MIN: "min", AVG: "avg"}
_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def dtype_code(dtype: torch.dtype, *, op: str) -> int:
    code = DTYPE_CODES.get(dtype)
    if code is None:  # the hot path is the single dict lookup above
        raise ZbcclInvalidUsageError(
            f"{op}: unsupported dtype, expected one of {[str(d) for d in DTYPE_CODES]}, got {dtype}")
    return code


def reduce_op_code(red, dtype: torch.dtype, *, op: str) -> int:
    """Code of a reduce op given as a string or a ``torch.distributed.ReduceOp``."""
    if red == "sum":  # the common case, before any normalisation
        return SUM
    if isinstance(red, str):
        code = REDUCE_OPS.get(red.lower())
    else:
        name = getattr(red, "name", None) or str(red).rsplit(".", 1)[-1]
        code = REDUCE_OPS.get(str(name).lower())
    if code is None:
        raise ZbcclInvalidUsageError(
            f"{op}: unsupported reduce op, expected sum/avg/max/min/product or a ReduceOp, got {red!r}")
    if code == AVG and dtype not in _FLOATS:
        raise ZbcclInvalidUsageError(f"{op}: avg needs a floating dtype, got {dtype}")
    return code


def op_name(code: int) -> str:
    return _NAMES.get(code, f"op{code}")
