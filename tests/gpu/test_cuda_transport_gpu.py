"""The cuda transport on a GPU, beyond the conformance suite (``tests/transports``, which runs on it too):
growth past the allocation granularity (a new chunk a peer must import) and the pointer tables a kernel uses.
"""

from __future__ import annotations

import pytest
import torch

from tests.spawn import run_world
from tests.transports.conftest import unavailable
from tests.transports.world import line, open_transport, payload

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
    """A peer grows while this rank's kernel is already enqueued (and spinning) in an all_reduce, then hands that
    kernel an offset in the new chunk. This rank's main thread maps nothing (DeviceOps directly, no lane): the
    kernel reads the chunk because the peer's ``grow`` returned only once this rank's mapper thread mapped it."""
    from zbccl.ops.device import DeviceOps

    torch.cuda.set_device(0)
    t, boot = open_transport(ctx, "cuda", data=2 * MB, reserve=64 * MB)
    me, W, n = ctx.rank, ctx.world_size, 4096  # a few blocks: both ranks' launches fit on one GPU together
    try:
        dev = DeviceOps(me, range(W), t, slot=0, timeout_s=60, barrier=lambda: boot.barrier(timeout=60))
        vals = [payload(r, n).to(torch.float64) for r in range(W)]
        if me == 0:
            x = t.view(me, 0, (n,), torch.float64)
            x.copy_(vals[0].cuda())
            dev.all_reduce(x, "sum", algo="one_shot")  # enqueued: it waits on the device for the peer
            ctx.store().set("launched", b"1")
        else:
            ctx.store().wait(["launched"])
            t.grow(24 * MB)  # new chunks: returns once rank 0's mapper mapped them
            x = t.view(me, 20 * MB, (n,), torch.float64)
            x.copy_(vals[me].cuda())
            dev.all_reduce(x, "sum", algo="one_shot")
        torch.cuda.synchronize()
        dev.check()
        assert torch.equal(x.cpu(), sum(vals[1:], vals[0])), x[:4]
        boot.barrier(timeout=60)
        return "ok"
    finally:
        t.close(unmap=False)


def test_a_growth_during_a_peers_op_is_mapped_before_its_kernel_reads_it():
    assert run_world(_grow_mid_op, 2, timeout=120) == ["ok"] * 2
