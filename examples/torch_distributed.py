"""A plain torch.distributed program on the zbccl backend: every collective, checked against its expected value.

Usage: torchrun --standalone --nproc-per-node 2 examples/torch_distributed.py [--heap-scope]

Nothing in it is specific to zbccl except ``import zbccl`` (which registers the ``"zbccl"`` backend) and
the backend name: the same script runs with ``gloo``. Each rank fills its tensors with values that
name their source (``rank * 100 + index``), so a misplaced row shows in the check. With
``--heap-scope`` the tensors are allocated inside ``zbccl.heap_scope()`` (in the shared heap, read
in place by the peers: ``staged_bytes`` stays 0). Prints one line per op on rank 0; exits 1 on a
wrong result.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time

import torch
import torch.distributed as dist

import zbccl  # registers the "zbccl" torch.distributed backend

# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor (same op, same backend call).
all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def payload(rank: int, n: int) -> torch.Tensor:
    """``n`` values naming their rank: ``rank * 100 + index``."""
    return torch.arange(n, dtype=torch.float32) + 100 * rank


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heap-scope", action="store_true", help="allocate the tensors inside zbccl.heap_scope()")
    p.add_argument("--backend", default="zbccl", choices=["zbccl", "gloo"])
    args = p.parse_args(argv)

    dist.init_process_group(args.backend)  # torchrun's environment: RANK, WORLD_SIZE, MASTER_ADDR/PORT
    rank, n = dist.get_rank(), dist.get_world_size()
    wrong: list[str] = []

    def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        ok = torch.equal(got, want)
        if not ok:
            wrong.append(name)
        if rank == 0 or not ok or name == "send/recv":
            print(f"rank {rank}: {name:<22} {'ok' if ok else 'WRONG'}", flush=True)

    scope = zbccl.heap_scope() if args.heap_scope else contextlib.nullcontext()
    with scope:
        x = payload(rank, 8)
        t0 = time.perf_counter()
        dist.all_reduce(x)  # the first collective: no compilation here (zbccl.init prepared everything)
        first_ms = (time.perf_counter() - t0) * 1e3
        check("all_reduce", x, sum(payload(r, 8) for r in range(n)))

        out = torch.empty(8 * n)
        all_gather_single(out, payload(rank, 8))
        check("all_gather_single", out, torch.cat([payload(r, 8) for r in range(n)]))

        parts = [torch.empty(8) for _ in range(n)]
        dist.all_gather(parts, payload(rank, 8))
        check("all_gather", torch.cat(parts), torch.cat([payload(r, 8) for r in range(n)]))

        rs = torch.empty(4)
        reduce_scatter_single(rs, payload(rank, 4 * n))
        check("reduce_scatter_single", rs, sum(payload(r, 4 * n) for r in range(n))[4 * rank:4 * rank + 4])

        a2a = torch.empty(4 * n)
        dist.all_to_all_single(a2a, payload(rank, 4 * n))
        check("all_to_all_single", a2a, torch.cat([payload(r, 4 * n)[4 * rank:4 * rank + 4] for r in range(n)]))

        b = payload(rank, 8)
        dist.broadcast(b, src=n - 1)
        check("broadcast", b, payload(n - 1, 8))

        r = payload(rank, 8)
        dist.reduce(r, dst=0)
        if rank == 0:
            check("reduce", r, sum(payload(q, 8) for q in range(n)))

        if rank == 0:
            dist.send(payload(0, 8), dst=n - 1)
        if rank == n - 1:
            got = torch.empty(8)
            dist.recv(got, src=0)
            check("send/recv", got, payload(0, 8))
        dist.barrier()
    if rank == 0:
        staged = zbccl.memory_stats()["staged_bytes"] if args.backend == "zbccl" else 0
        print(f"first all_reduce {first_ms:.1f} ms; staged_bytes {staged}")
    dist.destroy_process_group()
    if wrong:
        print(f"rank {rank}: wrong results: {wrong}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
