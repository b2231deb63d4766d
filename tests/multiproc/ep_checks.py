"""DeepEP's test helpers, rewritten for the EP tests: diff metric, fp8 casts, reference layout."""

from __future__ import annotations

import torch


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double() + 1, y.double() + 1
    denom = (x * x + y * y).sum()
    return (1 - 2 * (x * y).sum() / denom).item()


def per_token_cast_to_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepEP's test cast, as it computes on CUDA: there torch divides by the scalar 448 as a multiply by
    the float 1/448 (as DeepEP's kernels do, ``amax * kFP8AmaxInv``); on the CPU torch divides exactly,
    one ulp away, so the scales are written as that multiply."""
    m, n = x.shape
    v = x.view(m, n // 128, 128)
    amax = v.abs().float().amax(2).view(m, n // 128).clamp(1e-4)
    return (v * (448.0 / amax.unsqueeze(2))).to(torch.float8_e4m3fn).view(m, n), (amax * (1.0 / 448.0)).view(m, n // 128)


def per_token_cast_back(x_fp8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    if x_fp8.numel() == 0:
        return x_fp8.to(torch.bfloat16)
    if scales.dtype == torch.int:
        scales = scales.view(dtype=torch.uint8).to(torch.int) << 23
        scales = scales.view(dtype=torch.float)
    m = x_fp8.size(0)
    x = x_fp8.float().view(m, -1, 128)
    return (x * scales.view(m, -1, 1)).view(x_fp8.shape).to(torch.bfloat16)


def ref_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int):
    """DeepEP's test computation: per rank, per expert counts and token_idx_in_rank ``[T, R]``."""
    L = num_experts // num_ranks
    T = topk_idx.size(0)
    rank_idx = (topk_idx // L).long().masked_fill(topk_idx == -1, -1)
    per_expert = torch.tensor([(topk_idx == i).sum() for i in range(num_experts)], dtype=torch.int)
    per_rank = torch.empty(num_ranks, dtype=torch.int)
    token_idx_in_rank = torch.full((num_ranks, T), -1, dtype=torch.long)
    for i in range(num_ranks):
        sel = (rank_idx == i).any(dim=-1)
        per_rank[i] = int(sel.sum())
        toks = sel.nonzero().flatten()
        token_idx_in_rank[i][toks] = torch.arange(toks.numel())
    token_idx_in_rank = token_idx_in_rank.T.contiguous().to(torch.int)
    return per_rank, per_expert, token_idx_in_rank >= 0


def check_data(check_x: torch.Tensor, rank_prefix_matrix: torch.Tensor, rank: int, num_ranks: int) -> None:
    """Rows constant, and block i (by rank_prefix_matrix) holds value i."""
    assert torch.allclose(check_x.amin(dim=1), check_x.amax(dim=1))
    start = 0
    for i in range(num_ranks):
        end = rank_prefix_matrix[i][rank].item()
        assert (check_x[start:end, :].int() - i).sum().item() == 0, f"block of rank {i}"
        start = end
