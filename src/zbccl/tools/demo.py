"""The heap demo: N local ranks write straight into each other's tensors.

Usage: ``zbccl demo [--world-size N] [--size BYTES] [--iters K]``

Each rank allocates a heap tensor, publishes its handle, and every round
writes a payload that encodes (rank, round, index) directly into the next
rank's tensor through ``peer_tensor``; after a barrier the receiver checks
every element. It also shows ``heap_scope`` placing op outputs in the heap,
and times the heap barrier and the direct peer write against a local copy.
"""

from __future__ import annotations

import statistics
import time

import torch

__all__ = ["run_demo"]


def _median_us(fn, iters: int) -> float:
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def _rank_main(*, rank: int, world_size: int, store, nbytes: int, iters: int) -> dict:
    import zbccl

    comm = zbccl.init(store=store, rank=rank, world_size=world_size, heap_size=max(64 << 20, 4 * nbytes))
    try:
        n = nbytes // 4
        inbox = zbccl.zeros(n, dtype=torch.float32)
        handles = comm.all_gather_object(zbccl.export(inbox))
        nxt, prev = (rank + 1) % world_size, (rank - 1) % world_size
        peer = comm.peer_tensor(nxt, handles[nxt])
        base = torch.arange(n, dtype=torch.float32)
        wrong = 0
        for it in range(iters):
            peer.copy_(base + (rank * 1000 + it) * 1e4)  # direct write into rank+1's memory
            comm.barrier()
            wrong += int((inbox != base + (prev * 1000 + it) * 1e4).sum())
            comm.barrier()
        with zbccl.heap_scope():
            x = torch.randn(64, 64)
            y = x @ x
            z = torch.cat([y, y])
        in_heap = all(zbccl.is_heap_tensor(t) for t in (x, y, z))
        del x, y, z
        barrier_us = _median_us(comm.barrier, 2000)
        local = torch.empty_like(base)
        src = base + 1
        write_us = _median_us(lambda: peer.copy_(src), 50)
        local_us = _median_us(lambda: local.copy_(src), 50)
        comm.barrier()
        stats = zbccl.memory_stats()
        return {"rank": rank, "wrong": wrong, "in_heap": in_heap, "barrier_us": barrier_us,
                "write_us": write_us, "local_us": local_us, "allocated": stats["allocated_bytes"],
                "peak": stats["peak_allocated_bytes"], "job": comm.job_id}
    finally:
        zbccl.finalize()


def run_demo(*, world_size: int = 2, nbytes: int = 16 << 20, iters: int = 20) -> int:
    """Run the demo and print one row per rank; returns a process exit code."""
    from .launch import launch_local

    print(f"zbccl demo: {world_size} local ranks, {nbytes >> 10} KiB per peer write, {iters} rounds")
    t0 = time.perf_counter()
    rows = launch_local(_rank_main, world_size, nbytes=nbytes, iters=iters)
    print(f"job {rows[0]['job']} done in {time.perf_counter() - t0:.1f}s\n")
    print(f"{'rank':>4} {'#wrong':>7} {'scope→heap':>10} {'barrier_us':>10} "
          f"{'peer_write_GB/s':>15} {'local_copy_GB/s':>15} {'peak_heap_MiB':>13}")
    for r in rows:
        print(f"{r['rank']:>4} {r['wrong']:>7} {str(r['in_heap']):>10} {r['barrier_us']:>10.2f} "
              f"{nbytes / r['write_us'] / 1e3:>15.2f} {nbytes / r['local_us'] / 1e3:>15.2f} "
              f"{r['peak'] / (1 << 20):>13.1f}")
    ok = all(r["wrong"] == 0 and r["in_heap"] for r in rows)
    print("\nresult:", "OK: every element arrived from the right rank" if ok else "FAILED")
    return 0 if ok else 1
