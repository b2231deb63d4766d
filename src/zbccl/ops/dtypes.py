"""torch dtypes and reduce ops onto the native kernels' codes (defined once, in ``native/abi.py``)."""

from __future__ import annotations

import torch

from ..errors import ZbcclInvalidUsageError
from ..native.abi import DTYPES, REDUCE_ALIASES, REDUCE_NAMES
from ..native.abi import REDUCE_OPS as _OPS

__all__ = ["CODES", "DTYPE_CODES", "CODE_DTYPES", "REDUCE_OPS", "dtype_code", "reduce_op_code", "op_name",
           "SUM", "PROD", "MAX", "MIN", "AVG"]

#: The one map of torch dtypes onto the native dtype codes (``abi.DTYPES``), every user's (the
#: collectives, EP's headers and kernels).
CODES: dict[torch.dtype, int] = {
    torch.float32: DTYPES["F32"], torch.bfloat16: DTYPES["BF16"], torch.float16: DTYPES["F16"],
    torch.float64: DTYPES["F64"], torch.int8: DTYPES["I8"], torch.uint8: DTYPES["U8"], torch.int16: DTYPES["I16"],
    torch.int32: DTYPES["I32"], torch.int64: DTYPES["I64"], torch.bool: DTYPES["BOOL"],
    torch.float8_e4m3fn: DTYPES["F8_E4M3"],
}
CODE_DTYPES = {v: k for k, v in CODES.items()}
#: The dtypes the collectives (the reduction kernels) serve: :data:`CODES` but fp8, which only EP moves.
DTYPE_CODES: dict[torch.dtype, int] = {d: c for d, c in CODES.items() if d != torch.float8_e4m3fn}

SUM, PROD, MAX, MIN, AVG = _OPS["SUM"], _OPS["PROD"], _OPS["MAX"], _OPS["MIN"], _OPS["AVG"]
#: Every spelling of a reduce op the ops accept -> its code (``abi.REDUCE_ALIASES``).
REDUCE_OPS: dict[str, int] = dict(REDUCE_ALIASES)
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
    return REDUCE_NAMES.get(code, f"op{code}")
