"""Threads per rank: the ranks of a host share its cores.

By default each rank gets ``usable cores // local ranks`` threads for zbccl's
copies and reductions, and the same is set as torch's intra-op threads at
``init`` (so 2 ranks on 2 cores do not run 4 busy threads). ``ZBCCL_THREADS=N``
forces N; ``ZBCCL_THREADS=0`` leaves torch alone and follows its setting.
"""

from __future__ import annotations

import torch

from .. import env
from ..bootstrap.topology import usable_cores

__all__ = ["set_threads", "nthreads"]

_threads: int | None = None


def set_threads(local_world_size: int) -> int:
    """Apply ``ZBCCL_THREADS`` (called by ``init``); returns zbccl's threads per rank."""
    global _threads
    want = env.THREADS.get()
    if want == 0:
        _threads = torch.get_num_threads()
        return _threads
    if want < 0:
        want = max(1, usable_cores() // max(1, local_world_size))
    _threads = want
    torch.set_num_threads(want)
    return want


def nthreads() -> int:
    """Threads zbccl's native loops may use in this rank."""
    return _threads or 1
