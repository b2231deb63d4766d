"""MoE expert parallelism with ``zbccl.ep`` (DeepEP's ``Buffer`` API): route tokens, run experts, combine.

Usage: torchrun --standalone --nproc-per-node 2 examples/ep_dispatch_combine.py [--tokens 64] [--hidden 256]
                [--experts 8] [--topk 2]

Every rank holds ``--tokens`` tokens (bf16 rows whose values name their rank and token) and routes
each to ``--topk`` distinct experts (``--experts`` in all, ``experts / world_size`` per rank; seeded
per rank, ``-1`` never used here). ``dispatch`` sends each token to the ranks that hold its
experts; each rank's "experts" scale the rows they received by ``1 + local expert index`` (one
multiply per top-k slot); ``combine`` sums the rows sent back per token. The result is checked
against the same computation done locally in plain torch. Prints the received rows, the bytes
moved and the check per rank; exits 1 on a wrong result.
"""

from __future__ import annotations

import argparse
import sys

import torch

import zbccl
import zbccl.ep as deep_ep


def tokens(rank: int, n: int, hidden: int) -> torch.Tensor:
    """``[n, hidden]`` bf16 rows that name their source: row i of rank r holds ``r + i / 64`` (exact in bf16)."""
    rows = rank + torch.arange(n, dtype=torch.float32).unsqueeze(1) / 64
    return rows.expand(n, hidden).to(torch.bfloat16).contiguous()


def routing(rank: int, n: int, experts: int, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_idx [n, topk] int64, topk_weights [n, topk] float32)``: distinct experts per token."""
    g = torch.Generator().manual_seed(1234 + rank)
    idx = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(n)])
    return idx, torch.rand(n, topk, generator=g)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    args = p.parse_args(argv)

    comm = zbccl.init(heap_size="64M")  # torchrun's environment
    rank, world = comm.rank, comm.world_size
    per_rank = args.experts // world
    x = tokens(rank, args.tokens, args.hidden)
    topk_idx, topk_weights = routing(rank, args.tokens, args.experts, args.topk)

    buffer = deep_ep.Buffer(comm, explicitly_destroy=True)
    ntpr, _, ntpe, in_rank, _ = buffer.get_dispatch_layout(topk_idx, args.experts)
    recv_x, recv_idx, recv_w, per_expert, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=ntpr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe,
        topk_idx=topk_idx, topk_weights=topk_weights)
    # The "experts": each received row, once per top-k slot routed to this rank, times 1 + local expert index
    # (recv_idx holds local expert indices, -1 for slots routed elsewhere).
    scale = torch.where(recv_idx >= 0, recv_idx + 1, 0).sum(dim=1, dtype=torch.float32)
    y = (recv_x.float() * scale.unsqueeze(1)).to(torch.bfloat16)
    combined, _, _ = buffer.combine(y, handle)
    moved = buffer.bytes_moved
    buffer.destroy()

    # The reference, in plain torch: token t comes back as x[t] times the sum, over the ranks it went to, of
    # (1 + local index) for each of its experts on that rank (each rank rounds its product to bf16 once).
    want = torch.zeros(args.tokens, args.hidden)
    for dst in range(world):
        local = torch.where(topk_idx // per_rank == dst, topk_idx % per_rank + 1, 0).sum(dim=1, dtype=torch.float32)
        sent = local > 0
        want[sent] += (x[sent].float() * local[sent].unsqueeze(1)).to(torch.bfloat16).float()
    ok = torch.equal(combined.float(), want.to(torch.bfloat16).float())
    print(f"rank {rank}: received {recv_x.shape[0]} rows (per local expert {per_expert}), "
          f"moved {moved} bytes, combine {'ok' if ok else 'WRONG'}", flush=True)
    zbccl.finalize()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
