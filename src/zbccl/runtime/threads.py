"""Threads per rank for zbccl's copies and reductions: the ranks of a host share its cores.

Decided at ``init`` from every local rank's affinity mask (exchanged in the
"hello" of the rendezvous), not from this rank's mask alone:

* default (``ZBCCL_THREADS=-1``): each of this rank's CPUs counts ``1/k`` when
  ``k`` local ranks may run on it; the sum, at least 1. Unpinned ranks on a
  shared machine get ``cores // ranks``; ranks pinned to their own cores (how
  vLLM and SGLang run on CPU: ``*_CPU_OMP_THREADS_BIND``) get all of them, so a
  rank pinned to 32 cores among 4 ranks gets 32 threads, not 8.
* ``ZBCCL_THREADS=N`` (N > 0): N threads, and torch's intra-op threads are set
  to N too (the only case where zbccl changes torch's setting).
* ``ZBCCL_THREADS=0``: follow torch's setting.

torch's thread count is left alone unless asked: the engine (or the user) owns it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import env

__all__ = ["set_threads", "nthreads", "shared_threads", "plan_threads"]

_threads: int | None = None


def shared_threads(mine: frozenset[int], masks: Sequence[frozenset[int]]) -> int:
    """This rank's share of its CPUs: each CPU counts 1/k when k of ``masks`` contain it; at least 1.

    ``masks`` are every local rank's affinity masks (this rank's included).
    """
    share = 0.0
    for cpu in mine:
        k = sum(1 for m in masks if cpu in m)
        share += 1.0 / max(1, k)
    return max(1, int(share + 1e-9))


def plan_threads(want: int, mine: frozenset[int], masks: Sequence[frozenset[int]],
                 torch_threads: int) -> tuple[int, int | None]:
    """``(zbccl threads, torch threads to set or None)`` for ``ZBCCL_THREADS=want``."""
    if want > 0:
        return want, want
    if want == 0:
        return max(1, torch_threads), None
    return shared_threads(mine, masks), None


def set_threads(mine: frozenset[int], masks: Sequence[frozenset[int]]) -> int:
    """Apply ``ZBCCL_THREADS`` (called by ``init``); returns zbccl's threads per rank."""
    global _threads
    ours, for_torch = plan_threads(env.THREADS.get(), mine, masks, torch.get_num_threads())
    if for_torch is not None:
        torch.set_num_threads(for_torch)
    _threads = ours
    return ours


def nthreads() -> int:
    """Threads zbccl's native loops may use in this rank."""
    return _threads or 1
