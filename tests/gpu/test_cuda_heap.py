"""The runtime's CUDA heap on a GPU: empty/export/peer_tensor at worlds 2 and 4 on one GPU, heap_scope, growth.

Skipped (with the reason) where no GPU, driver, cuda-bindings or triton is available. Every rank runs on
device 0: several processes share the one GPU, which is what the CUDA VMM sharing must support.
Payloads name their source (``payload``: rank, index, salt).
"""

from __future__ import annotations

import pytest
import torch

from tests.spawn import run_world
from tests.transports.conftest import unavailable
from tests.transports.world import payload

_WHY = unavailable("cuda")
pytestmark = pytest.mark.skipif(_WHY is not None, reason=f"cuda unavailable here: {_WHY}")


def _init(ctx, **kwargs):
    torch.cuda.set_device(0)
    return ctx.init(heap_size="4M", device="cuda", timeout=60, **kwargs)


def _exchange(ctx, n):
    import zbccl

    comm = _init(ctx, cuda_heap_size="64M")
    me, W = ctx.rank, ctx.world_size
    dh = comm.device_heap("cuda")
    transport, heap, sma = dh
    assert dh.device == torch.device("cuda", 0) and transport.name == "cuda" and heap.heap_bytes == 64 << 20
    t = zbccl.empty(n, dtype=torch.int64, device="cuda")
    assert t.is_cuda and zbccl.is_heap_tensor(t) and not zbccl.is_heap_tensor(t.cpu())
    t.copy_(payload(me, n).cuda())
    f = zbccl.zeros(3, 5, dtype=torch.bfloat16, device="cuda:0")
    f += me + 1
    like = zbccl.empty_like(f, device=f.device)
    assert like.is_cuda and like.dtype == torch.bfloat16 and zbccl.is_heap_tensor(like)
    inbox = zbccl.zeros(W, 64, dtype=torch.int64, device="cuda")
    mine = (zbccl.export(t), zbccl.export(f[1:]), zbccl.export(inbox))
    assert all(h.device == "cuda" for h in mine)
    handles = comm.all_gather_object(mine)
    torch.cuda.synchronize()
    comm.barrier()
    for p in range(W):
        v = comm.peer_tensor(p, handles[p][0])
        assert v.is_cuda and torch.equal(v.cpu(), payload(p, n)), (p, v[:4])
        vf = comm.peer_tensor(p, handles[p][1])
        assert vf.shape == (2, 5) and bool((vf.float().cpu() == p + 1).all()), (p, vf)
    nxt, prev = (me + 1) % W, (me - 1) % W
    comm.peer_tensor(nxt, handles[nxt][2])[me].copy_(payload(me, 64, 1).cuda())  # a write into a peer's heap
    torch.cuda.synchronize()
    comm.barrier()
    assert torch.equal(inbox[prev].cpu(), payload(prev, 64, 1)), inbox[prev][:4]
    stats = zbccl.memory_stats(device="cuda")
    assert stats["active_blocks"] == 4 and stats["heap_bytes"] == 64 << 20 and stats["staged_bytes"] == 0, stats
    assert zbccl.memory_stats()["heap_bytes"] >= 4 << 20  # the CPU heap is still there, separate
    with pytest.raises(zbccl.ZbcclInvalidUsageError, match="out of bounds"):
        bad = zbccl.HeapHandle(rank=nxt, offset=(64 << 20) - 8, shape=(4,), stride=(1,), dtype="int64", device="cuda")
        comm.peer_tensor(nxt, bad)
    del t, f, like, inbox, v, vf
    torch.cuda.synchronize()
    comm.barrier()  # every peer dropped its views of this rank's memory
    zbccl.finalize()
    return transport.segments == {} and transport.live_views() == 0  # unmapped: nothing was alive


@pytest.mark.parametrize("world", [2, 4])
def test_empty_export_peer_tensor_on_one_gpu(world):
    assert run_world(_exchange, world, n=4099, timeout=120) == [True] * world


def _scope(ctx):
    import zbccl

    comm = _init(ctx, cuda_heap_size="256M")
    me, W = ctx.rank, ctx.world_size
    with zbccl.heap_scope(device="cuda"):
        a = torch.arange(1000, device="cuda", dtype=torch.float32) + me  # op outputs
        c = a.clone()
        w = torch.full((64, 64), 0.5, device="cuda")
        b = w @ w
    outside = torch.empty(10, device="cuda")
    assert all(zbccl.is_heap_tensor(x) for x in (a, b, c, w)), [zbccl.is_heap_tensor(x) for x in (a, b, c, w)]
    assert not zbccl.is_heap_tensor(outside)
    handles = comm.all_gather_object(zbccl.export(a))
    torch.cuda.synchronize()
    comm.barrier()
    for p in range(W):
        got = comm.peer_tensor(p, handles[p]).cpu()
        assert torch.equal(got, torch.arange(1000, dtype=torch.float32) + p), (p, got[:4])
    stats = zbccl.memory_stats(device="cuda")
    assert stats["scope_segments"] >= 1 and stats["scope_fallback_segments"] == 0 and stats["staged_bytes"] == 0
    assert stats["fallback_allocs"] == 0 and stats["active_blocks"] >= 1, stats
    comm.barrier()
    zbccl.finalize()
    return "ok"


def test_heap_scope_puts_cuda_allocations_in_the_heap():
    assert run_world(_scope, 2, timeout=90) == ["ok"] * 2


def _growth(ctx):
    import zbccl

    comm = _init(ctx, cuda_heap_size="4M", cuda_heap_max="256M")
    me, W = ctx.rank, ctx.world_size
    transport = comm.device_heap("cuda").transport
    tables = transport.pointer_tables(range(W))
    big = zbccl.empty(40 << 20, dtype=torch.uint8, device="cuda")  # beyond the initial 4M: the heap grows
    words = big.view(torch.int64)
    words[:4096].copy_(payload(me, 4096, 2).cuda())
    words[-4096:].copy_(payload(me, 4096, 3).cuda())
    stats = zbccl.memory_stats(device="cuda")
    assert stats["grow_count"] >= 1 and stats["heap_bytes"] >= 40 << 20, stats
    handles = comm.all_gather_object(zbccl.export(words))
    torch.cuda.synchronize()
    comm.barrier()
    for p in range(W):  # a peer's grown range: fetched, imported and mapped on first touch
        v = comm.peer_tensor(p, handles[p])
        assert torch.equal(v[:4096].cpu(), payload(p, 4096, 2)) and torch.equal(v[-4096:].cpu(), payload(p, 4096, 3))
    same = transport.pointer_tables(range(W))
    assert all(torch.equal(x, y) for x, y in zip(tables, same)), "growth moved a base address"
    del v, big, words
    comm.barrier()
    zbccl.finalize()
    return "ok"


def test_growth_is_mapped_by_peers():
    assert run_world(_growth, 2, timeout=90) == ["ok"] * 2
