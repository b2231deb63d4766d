"""zbccl's CUDA path on a GPU: every op, graph capture, a decode step (skipped without CUDA).

The same cases ``scripts/gpu_check.sh`` runs (``zbccl/bench/gpu_cases.py``), at world 2 on GPU 0,
as pytest tests for a machine with a GPU and the time to run them (about a minute).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def _rank(*, rank, world_size, store, what):
    from zbccl.bench.gpu_cases import Rank, correctness
    from zbccl.bench.gpu_steps import decode_step, graph_cases

    rk = Rank(rank, world_size, store, heap_bytes=256 << 20, timeout=20.0)
    try:
        if what == "eager":
            return correctness(rk, quick=True)
        return graph_cases(rk) + decode_step(rk, replays=20)
    finally:
        rk.close()


def _run(what: str) -> dict:
    import os

    from zbccl.bench.gpu import summarise_cases
    from zbccl.tools.launch import launch_local

    os.environ.setdefault("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "1")
    return summarise_cases(launch_local(_rank, 2, timeout=240, threads=1, what=what))


def test_every_op_bit_exact_at_world_2():
    bad = {k: d for k, (ok, d) in _run("eager").items() if not ok}
    assert not bad, bad


def test_every_op_captured_and_a_decode_step_replayed():
    bad = {k: d for k, (ok, d) in _run("graph").items() if not ok}
    assert not bad, bad
