"""Usage: PYTHONPATH=src python scripts/heap_growth_cost.py  (world 1, no launcher; prints medians of 10)

Cost of one heap growth step of 64 MiB (the SMA's minimum step): the owner's
posix_fallocate of the new range, its prefault (MADV_POPULATE_WRITE), and a
whole zbccl.empty that grows a 4 MiB heap, beside one that does not.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

import zbccl
from zbccl.heap.shm import map_fd, prefault, unmap_addr

MIB = 1 << 20
STEP = 64 * MIB
REPS = 10


def _primitives() -> tuple[list[float], list[float]]:
    fallocate, populate = [], []
    for _ in range(REPS):
        fd = os.memfd_create("zbccl-growth-bench", os.MFD_CLOEXEC)
        os.posix_fallocate(fd, 0, 4 * MIB)
        addr = map_fd(fd, 4 * MIB, populate=True, reserve=4 * MIB + STEP)
        t0 = time.perf_counter()
        os.posix_fallocate(fd, 4 * MIB, STEP)
        t1 = time.perf_counter()
        prefault(addr + 4 * MIB, STEP)
        t2 = time.perf_counter()
        fallocate.append(t1 - t0)
        populate.append(t2 - t1)
        unmap_addr(addr, 4 * MIB + STEP)
        os.close(fd)
    return fallocate, populate


def _through_empty() -> tuple[list[float], list[float]]:
    grows, plain = [], []
    for _ in range(REPS):
        zbccl.init(heap_size="4M", heap_max="1G")
        t0 = time.perf_counter()
        a = zbccl.empty(8 * MIB, dtype=torch.uint8)
        t1 = time.perf_counter()
        b = zbccl.empty(8 * MIB, dtype=torch.uint8)
        t2 = time.perf_counter()
        assert zbccl.memory_stats()["grow_count"] == 1
        grows.append(t1 - t0)
        plain.append(t2 - t1)
        del a, b
        zbccl.finalize()
    return grows, plain


def main() -> None:
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(var, None)
    fallocate, populate = _primitives()
    grows, plain = _through_empty()
    for name, xs in (("posix_fallocate 64 MiB", fallocate), ("MADV_POPULATE_WRITE 64 MiB", populate),
                     ("zbccl.empty(8 MiB) that grows 4 -> 68 MiB", grows),
                     ("zbccl.empty(8 MiB), no growth", plain)):
        print(f"{name:44s} median {statistics.median(xs) * 1e3:8.3f} ms  min {min(xs) * 1e3:8.3f} ms")


if __name__ == "__main__":
    main()
