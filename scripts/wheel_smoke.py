"""The first use of an installed zbccl wheel, as a newcomer's program meets it (run by scripts/check_wheel.sh).

Usage: torchrun --standalone --nproc-per-node 2 scripts/wheel_smoke.py [--max-first-ms 2000]

Checks, per rank (exit 1 on any failure):
- zbccl is imported from site-packages, not from a checkout;
- ``init_process_group("zbccl")`` and the first ``all_reduce`` compile nothing: every native library is
  the wheel's prebuilt one, ZBCCL_CACHE_DIR holds no build, and the first all_reduce takes less than
  ``--max-first-ms`` (it printed 17 s when the hot entry was built inside it);
- explicit heap tensors (``zbccl.empty``, ``export``, a peer's view written directly) and ``heap_scope``
  (0 staged bytes for a collective on tensors allocated inside it).
The collectives one by one and zbccl.ep are covered by examples/torch_distributed.py and
examples/ep_dispatch_combine.py, which the check runs after this.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import zbccl
from zbccl import native


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--max-first-ms", type=float, default=2000.0)
    args = p.parse_args()
    problems: list[str] = []
    if "site-packages" not in zbccl.__file__:
        problems.append(f"zbccl imported from {zbccl.__file__}, expected the installed wheel")

    t0 = time.perf_counter()
    dist.init_process_group("zbccl")
    init_ms = (time.perf_counter() - t0) * 1e3
    rank, n = dist.get_rank(), dist.get_world_size()
    x = torch.full((1024,), float(rank + 1))
    t0 = time.perf_counter()
    dist.all_reduce(x)
    first_ms = (time.perf_counter() - t0) * 1e3
    if not torch.equal(x, torch.full((1024,), float(n * (n + 1) // 2))):
        problems.append("first all_reduce: wrong sum")
    if first_ms > args.max_first_ms:
        problems.append(f"first all_reduce took {first_ms:.0f} ms, expected < {args.max_first_ms:.0f} ms")

    status = native.status()
    for name, row in status.items():
        if row.get("origin") != "prebuilt (wheel)" or not row.get("loaded"):
            problems.append(f"native {name}: expected the wheel's prebuilt library, loaded; got {row}")
    cache = Path(os.environ.get("ZBCCL_CACHE_DIR", "~/.cache/zbccl")).expanduser() / "native"
    if cache.exists() and any(cache.iterdir()):
        problems.append(f"something was compiled into {cache}: {sorted(q.name for q in cache.iterdir())}")

    comm = zbccl.get_default()  # the communicator the backend started
    t = zbccl.zeros(8)
    handles = comm.all_gather_object(zbccl.export(t))
    peer = (rank + 1) % n
    comm.peer_tensor(peer, handles[peer]).fill_(float(rank))  # a store straight into the next rank's heap
    comm.barrier()
    if not torch.equal(t, torch.full((8,), float((rank - 1) % n))):
        problems.append(f"heap tensor: expected the previous rank's value, got {t.tolist()}")

    before = zbccl.memory_stats()["staged_bytes"]
    with zbccl.heap_scope():
        y = torch.full((4096,), float(rank))
        dist.all_reduce(y)
    if not torch.equal(y, torch.full((4096,), float(n * (n - 1) // 2))):
        problems.append("heap_scope all_reduce: wrong sum")
    if zbccl.memory_stats()["staged_bytes"] != before:
        problems.append("heap_scope all_reduce staged its input, expected 0 staged bytes")
    dist.destroy_process_group()

    origins = ", ".join(f"{k}: {v.get('origin')}" for k, v in status.items())
    print(f"rank {rank}: zbccl {zbccl.__version__} from {Path(zbccl.__file__).parent}; init {init_ms:.0f} ms, "
          f"first all_reduce {first_ms:.1f} ms; native {origins}; {'OK' if not problems else 'FAILED'}", flush=True)
    for problem in problems:
        print(f"rank {rank}: {problem}", file=sys.stderr, flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
