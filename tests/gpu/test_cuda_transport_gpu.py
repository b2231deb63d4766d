"""The cuda transport on a GPU, beyond the conformance suite (``tests/transports``, which runs on it too):
growth past the allocation granularity (a new chunk a peer must import) and the pointer tables a kernel uses.
"""

from __future__ import annotations

import pytest
import torch

from tests.spawn import run_world
from tests.transports.conftest import unavailable
from tests.transports.world import grow_during_op, line, open_transport, payload

_WHY = unavailable("cuda")
pytestmark = pytest.mark.skipif(_WHY is not None, reason=f"cuda unavailable here: {_WHY}")

MB = 1 << 20


def _chunks(ctx):
    from zbccl.heap.transports.cuda import kernels

    torch.cuda.set_device(0)
    t, boot = open_transport(ctx, "cuda", data=2 * MB, reserve=64 * MB)
    me, W = ctx.rank, ctx.world_size
    try:
        data, pads = t.pointer_tables(range(W))
        assert data.device == t.device and data.dtype == torch.int64 and data.shape == (W,) and pads.shape == (W,)
        assert t.native().data_addr(me) == int(data[me]) and t.native().pad_addr(me, t.KERNEL_LINE) == int(pads[me])
        t.view(me, 0, (1024,), torch.int64).copy_(payload(me, 1024).cuda())
        t.grow(24 * MB)  # past the 2 MiB granularity: new chunks, fetched by the peers on first touch
        t.view(me, 20 * MB, (1024,), torch.int64).copy_(payload(me, 1024, 1).cuda())
        t.signal(me, line(0), 1)
        t.wait_until([(p, line(0)) for p in range(W)], 1, timeout=60, op="grown")
        rows = kernels.gather_rows(data, 1024)  # a Triton kernel loading through the int64 table
        for p in range(W):
            assert t.size(p) == 24 * MB
            assert torch.equal(rows[p].cpu(), payload(p, 1024)), (p, rows[p][:4])
            assert torch.equal(t.view(p, 20 * MB, (1024,), torch.int64).cpu(), payload(p, 1024, 1))
            got = torch.frombuffer(bytearray(t.get(p, 20 * MB, 8 * 1024)), dtype=torch.int64)
            assert torch.equal(got, payload(p, 1024, 1))
        again = t.pointer_tables(range(W))
        assert again[0] is data and again[1] is pads  # cached: bases never move
        boot.barrier(timeout=60)
        return "ok"
    finally:
        t.close(unmap=False)


def test_growth_past_the_granularity_and_pointer_tables():
    assert run_world(_chunks, 2, timeout=90) == ["ok"] * 2


def _grow_mid_op(ctx):
    """``world.grow_during_op`` on the GPU: rank 0's kernel is enqueued (spinning on the device for rank 1) when
    rank 1 grows past the granularity and hands it an offset in the new chunks; a few blocks, so that both
    ranks' launches fit on one GPU together."""
    torch.cuda.set_device(0)
    return grow_during_op(ctx, "cuda", data=2 * MB, grow_to=24 * MB, offset=20 * MB, unmap=False)


def test_a_growth_during_a_peers_op_is_mapped_before_its_kernel_reads_it():
    assert run_world(_grow_mid_op, 2, timeout=120) == ["ok"] * 2
