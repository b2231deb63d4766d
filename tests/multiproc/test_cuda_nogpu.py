"""The CUDA heap on a machine without a GPU: set-up fails on every rank together, clearly, leaving nothing.

(On a GPU the same paths are exercised for real by ``tests/gpu/``.)
"""

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


def _init(ctx, asks):
    import zbccl

    kwargs = {"device": "cuda", "cuda_heap_size": "8M"} if asks[ctx.rank] else {}
    try:
        ctx.init(heap_size="2M", **kwargs)
    except zbccl.ZbcclError as exc:
        out = (type(exc).__name__, str(exc))
    else:
        out = ("no error", "")
    # nothing is left behind: a plain CPU job starts and ends cleanly afterwards
    ctx_again = ctx.init(heap_size="2M")
    assert zbccl.memory_stats()["heap_bytes"] >= 2 << 20 and ctx_again.world_size == ctx.world_size
    zbccl.finalize()
    return out


def test_init_with_a_cuda_heap_without_a_gpu_fails_on_every_rank():
    out = run_world(_init, 2, asks=[True, True], timeout=120)
    for kind, msg in out:
        assert kind in ("ZbcclSystemError", "ZbcclRemoteError"), msg
        assert "the cuda heap needs a GPU, expected torch.cuda.is_available(), got False" in msg, msg


def test_ranks_that_disagree_about_the_cuda_heap_are_refused_on_every_rank():
    out = run_world(_init, 3, asks=[True, False, True], timeout=120)
    for kind, msg in out:
        assert kind == "ZbcclInvalidUsageError", msg
        assert "ranks disagree about the cuda heap, expected every rank or none to ask for one" in msg, msg
        assert "got ranks [0, 2] asking and [1] not" in msg, msg
