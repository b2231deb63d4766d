"""The soak's EP case: ``zbccl.ep.Buffer`` normal-mode dispatch and combine of a random routing.

Every rank rebuilds every rank's inputs from the drawn seed, so it knows which rows it must
receive (by source rank, then token), their local top-k ids and weights, the aligned per-expert
list, and what combine returns for identity experts (``x`` summed in fp32 once per rank the token
went to, in rank order). dtypes: bf16, fp32, and fp8 with per-token scales (column-major, as
DeepEP's test passes them).
"""

from __future__ import annotations

import torch

__all__ = ["check_case"]


def _to_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    m, n = x.shape
    v = x.view(m, n // 128, 128)
    amax = v.abs().float().amax(2).view(m, n // 128).clamp(1e-4)
    q = (v * (448.0 / amax.unsqueeze(2))).to(torch.float8_e4m3fn).view(m, n)
    return q, (amax / 448.0).view(m, n // 128)


def _from_fp8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    if q.numel() == 0:
        return q.to(torch.bfloat16)
    m = q.size(0)
    return (q.float().view(m, -1, 128) * scales.view(m, -1, 1)).view(q.shape).to(torch.bfloat16)


def _inputs(case: dict, r: int, R: int):
    T, H, E, K = case["T"][r], case["H"], case["E"], case["K"]
    g = torch.Generator().manual_seed(case["seed"] * 1009 + r)
    scores = torch.rand(T, E, generator=g)
    if case["route"] == "hot_expert":
        scores[:, 0] += 2
    idx = torch.topk(scores, K, dim=-1).indices
    if case["route"] == "masked" and T:
        idx = idx.masked_fill(torch.rand(T, K, generator=g) < 0.3, -1)
    w = torch.rand(T, K, generator=g) + 0.5
    x = torch.randn(T, H, generator=g)
    if case["dtype"] == "fp8":
        q, s = _to_fp8(x.to(torch.bfloat16))
        return (q, s.T.contiguous().T), idx, w
    return x.to(torch.bfloat16 if case["dtype"] == "bf16" else torch.float32), idx, w


def _rows(x, sel):
    return (x[0][sel], x[1][sel]) if isinstance(x, tuple) else x[sel]


def _equal(a, b) -> bool:
    if isinstance(a, tuple):
        return torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1].float(), b[1].float())
    return torch.equal(a, b)


def check_case(buffer, comm, g, *, salt: int) -> str | None:
    """Draw a case from ``g`` (the shared RNG), run it, return None or what differs."""
    R, me = comm.world_size, comm.rank
    E = R * g.choice([1, 2, 4])
    case = {"seed": salt, "T": [g.choice([0, 1, 7, 33, 64]) for _ in range(R)], "H": g.choice([128, 256]),
            "E": E, "K": g.randint(1, min(E, 4)), "route": g.choice(["uniform", "hot_expert", "masked"]),
            "dtype": g.choice(["bf16", "fp32", "fp8"]), "align": g.choice([1, 4])}
    L = E // R
    ins = [_inputs(case, r, R) for r in range(R)]
    x, idx, w = ins[me]
    ntpr, _, ntpe, in_rank, _ = buffer.get_dispatch_layout(idx, E)
    sent = [((i >= me * L) & (i < (me + 1) * L)).any(1) for _, i, _ in ins]
    parts = [_rows(xi, s) for (xi, _, _), s in zip(ins, sent)]
    want_x = (torch.cat([a for a, _ in parts]), torch.cat([b for _, b in parts])) if isinstance(x, tuple) \
        else torch.cat(parts)
    raw = torch.cat([i[s] for (_, i, _), s in zip(ins, sent)])
    local = (raw >= me * L) & (raw < (me + 1) * L)
    want_idx = torch.where(local, raw - me * L, torch.full_like(raw, -1))
    want_w = torch.where(local, torch.cat([wi[s] for (_, _, wi), s in zip(ins, sent)]), torch.zeros(()))
    counts = torch.bincount(want_idx[want_idx >= 0], minlength=L).tolist()
    want_list = [-(-c // case["align"]) * case["align"] for c in counts]
    recv_x, recv_idx, recv_w, lst, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=ntpr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe, topk_idx=idx,
        topk_weights=w, expert_alignment=case["align"])
    if not _equal(recv_x, want_x):
        return f"ep dispatch rows differ ({case})"
    if not (torch.equal(recv_idx, want_idx) and torch.equal(recv_w, want_w) and lst == want_list):
        return f"ep dispatch top-k or expert list differ ({case})"
    back = _from_fp8(recv_x[0], recv_x[1].contiguous()) if isinstance(x, tuple) else recv_x
    combined, _, _ = buffer.combine(back, handle)
    mine = _from_fp8(x[0], x[1].contiguous()) if isinstance(x, tuple) else x
    acc, sent_to = torch.zeros(mine.shape), in_rank.sum(1, keepdim=True)
    for c in range(R):
        acc += torch.where(sent_to > c, mine.float(), torch.zeros(()))
    return None if torch.equal(combined, acc.to(mine.dtype)) else f"ep combine differs ({case})"
