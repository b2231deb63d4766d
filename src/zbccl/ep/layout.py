"""Pure quantisation maths of EP (no communication): the fp8, int8 and LogFMT casts the ops apply.

The routing maths (which token goes where) is :mod:`.reference`'s: the native kernels compute it.
"""

from __future__ import annotations

import torch

__all__ = ["fp8_quantize", "fp8_dequantize", "int8_quantize", "int8_dequantize", "logfmt_roundtrip", "FP8_MAX"]

FP8_MAX = 448.0


def _group_amax(x: torch.Tensor, group: int) -> torch.Tensor:
    m, n = x.shape
    return x.float().view(m, n // group, group).abs().amax(2).clamp(min=1e-4)


def fp8_quantize(x: torch.Tensor, *, round_scale: bool = False, ue8m0: bool = False):
    """Per-token, per-128-channel e4m3 cast: ``(x_fp8 [T, H], scales)``.

    ``scales`` are the dequantisation factors ``[T, H / 128]`` float32, or with ``ue8m0``
    (which implies power-of-two scales) their exponent bytes packed four per int32,
    ``[T, H / 512]``. Values saturate at +-448 as DeepEP's kernels do.
    """
    T, H = x.shape
    amax = _group_amax(x, 128)
    # amax times the float 1/448, as DeepEP's kernels compute it (and as CUDA torch computes amax / 448, by the
    # reciprocal; CPU torch divides exactly, one ulp apart): the same scales on either device
    scale_inv = amax * (1.0 / FP8_MAX)
    if round_scale or ue8m0:
        scale_inv = torch.pow(2.0, torch.ceil(torch.log2(scale_inv)))
        scale = 1.0 / scale_inv
    else:
        scale = FP8_MAX / amax
    q = (x.float().view(T, H // 128, 128) * scale.unsqueeze(2)).clamp(-FP8_MAX, FP8_MAX)
    x_fp8 = q.view(T, H).to(torch.float8_e4m3fn)
    if ue8m0:
        exps = (scale_inv.view(torch.int32) >> 23).to(torch.uint8).contiguous()
        return x_fp8, exps.view(torch.int32) if T else torch.empty(0, H // 512, dtype=torch.int32)
    return x_fp8, scale_inv


def fp8_dequantize(x_fp8: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Inverse of :func:`fp8_quantize` (accepts float or packed UE8M0 scales), rows flattened."""
    H = x_fp8.size(-1)
    x2 = x_fp8.reshape(-1, H)
    s = scales.reshape(x2.size(0), -1) if x2.size(0) else scales.reshape(0, H // 128)
    if s.dtype == torch.int32:
        s = (s.contiguous().view(torch.uint8).to(torch.int32) << 23).view(torch.float32)
    return (x2.float().view(x2.size(0), H // 128, 128) * s.unsqueeze(2)).view(x_fp8.shape).to(dtype)


def int8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token, per-128-channel symmetric int8: ``(q [T, H] int8, scales [T, H / 128] float32)``."""
    T, H = x.shape
    scale = _group_amax(x, 128) / 127.0
    q = torch.round(x.float().view(T, H // 128, 128) / scale.unsqueeze(2)).clamp(-127, 127)
    return q.view(T, H).to(torch.int8), scale


def int8_dequantize(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    T, H = q.shape
    return (q.float().view(T, H // 128, 128) * scales.view(T, H // 128, 1)).view(T, H).to(dtype)


def logfmt_roundtrip(y: torch.Tensor) -> torch.Tensor:
    """DeepEP's LogFMT-10 combine cast, encoded and decoded: ``[n, H]`` (H % 128 == 0) -> fp32.

    Per token and 128 channels (DeepEP's ``logfmt_encode``/``decode_and_accumulate``): with
    ``log_amax = log2(max|y|)`` and ``log_amin = max(log2(min|y|), log_amax - 32)``, a group is cast
    only if ``log_amax < 0`` and ``log_amin < log_amax``; then each magnitude becomes a 9-bit code
    on a log scale of 510 steps (0: zero), rounded at the linear midpoint, plus a sign bit; other
    groups stay bf16. fp32 ``log2``/``exp2`` stand in for the GPU's approximate ones.
    """
    n, H = y.shape
    v = y.float().view(n, H // 128, 128)
    a = v.abs()
    log_amax = torch.log2(a.amax(2, keepdim=True))
    log_amin = torch.maximum(torch.log2(a.amin(2, keepdim=True)), log_amax - 32)
    cast = (log_amax < 0) & (log_amin < log_amax)
    step = torch.where(cast, (log_amax - log_amin) / 510, 1.0)
    lo = torch.where(cast, log_amin, 0.0)
    rounding = 2.0 - torch.log2((1.0 + torch.exp2(step)) * 0.5) / step
    code = torch.floor((torch.log2(a) / step + rounding - lo / step).clamp(min=0))
    dec = torch.where(code == 0, 0.0, torch.exp2((code - 1) * step + lo))
    return torch.where(cast, torch.copysign(dec, v), v).view(n, H)
