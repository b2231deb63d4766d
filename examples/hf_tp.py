"""Hugging Face transformers tensor parallelism on the zbccl torch.distributed backend.

Usage: torchrun --standalone --nproc-per-node 2 examples/hf_tp.py [--backend zbccl|gloo]
                [--model llama|moe|mixtral|all] [--heap-scope]

Builds a tiny model from its config with random weights (seed 0) on rank 0,
saves it to a temporary directory (nothing is downloaded) and, on every rank:

1. loads it whole and computes the reference logits and 16 greedy tokens;
2. for backend gloo and then ``--backend``: ``init_process_group(backend)``,
   ``from_pretrained(path, distributed_config=DistributedConfig(tp_plan="auto"))``,
   logits and 16 greedy tokens (KV cache), then ``destroy_process_group``;
3. with ``--heap-scope`` (zbccl only): the same forward and generation inside
   ``zbccl.heap_scope()``, reporting ``memory_stats()["staged_bytes"]`` per
   forward and per generated token.

Checks (printed, non-zero exit on failure): TP logits within atol 1e-5 /
rtol 1e-4 of the single process (fp32), zbccl logits bitwise equal to gloo's
at 2 ranks, identical greedy tokens, and under ``heap_scope`` 0 staged bytes.
Needs the ``hf`` extra: ``pip install -e ".[hf]"``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from datetime import timedelta

import torch.distributed as dist

import zbccl  # registers the "zbccl" backend
from zbccl.bench import hf


def _store(rank: int, world_size: int) -> dist.Store:
    """torchrun's store (the elastic agent hosts it; rank 0 hosts it when the agent does not)."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                         is_master=rank == 0 and not agent, timeout=timedelta(seconds=120))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="zbccl", choices=["zbccl", "gloo"])
    p.add_argument("--model", default="all", choices=[*hf.MODELS, "all"])
    p.add_argument("--heap-scope", action="store_true", help="also run inside zbccl.heap_scope()")
    args = p.parse_args(argv)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = _store(rank, world_size)
    names = list(hf.MODELS) if args.model == "all" else [args.model]
    if rank == 0:
        root = tempfile.mkdtemp(prefix="zbccl-hf-tp-")
        for name in names:
            hf.build_checkpoint(name, os.path.join(root, name))
        store.set("hf_tp/root", root)
    root = store.get("hf_tp/root").decode()
    backends = ["gloo"] if args.backend == "gloo" else ["gloo", args.backend]
    try:
        results = hf.rank_check(rank=rank, world_size=world_size, store=store,
                                paths={n: os.path.join(root, n) for n in names}, backends=backends,
                                scope=args.heap_scope)
        lines, bad = hf.compare(results, world_size=world_size)
    finally:
        store.set(f"hf_tp/done/{rank}", "1")
        if rank == 0:
            store.wait([f"hf_tp/done/{r}" for r in range(world_size)], timedelta(seconds=120))
            shutil.rmtree(root, ignore_errors=True)
    if rank == 0 or bad:
        print("\n".join(f"[rank {rank}] {line}" for line in lines), flush=True)
    for problem in bad:
        print(f"[rank {rank}] FAIL {problem}", file=sys.stderr, flush=True)
    zbccl.finalize()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
