"""The cuda transport on a machine without a GPU: establish fails on every rank together, clearly."""

from __future__ import annotations

import pytest
import torch

from tests.spawn import run_world
from tests.transports.world import open_transport

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU (tests/gpu covers it)")


def _establish(ctx):
    from zbccl.errors import ZbcclError

    try:
        open_transport(ctx, "cuda", timeout=30)
    except ZbcclError as exc:
        return type(exc).__name__, str(exc), exc.ranks
    return "no error", "", ()


def test_cuda_establish_without_a_gpu_fails_on_every_rank():
    out = run_world(_establish, 2, timeout=120)
    for rank, (kind, msg, ranks) in enumerate(out):
        assert kind in ("ZbcclSystemError", "ZbcclRemoteError"), (rank, kind, msg)
        assert "needs a GPU, expected torch.cuda.is_available(), got False" in msg, msg
        assert ranks, (rank, msg)
