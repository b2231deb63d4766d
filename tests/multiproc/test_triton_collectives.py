"""The device collectives' Triton kernels, under the interpreter over the real shm heap, at worlds 2 and 3.

Every result is compared bit for bit with ``zbccl.ops.reference`` (reduced in rank order, floats in
float32/float64 as the kernels do) and must be identical on every rank. One spawned world per world size
runs every sub-case.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from tests.multiproc.triton_cases import DTYPES, ENV, FLOATS, device_ops, needs_triton, payload
from tests.spawn import run_world

pytestmark = needs_triton


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _all_reduce_cases(dev, W: int, me: int, dtypes) -> list[str]:
    import zbccl
    from zbccl.ops.dtypes import REDUCE_OPS
    from zbccl.ops.reference import all_reduce_ref

    digests = []
    k = 0
    for dtype in dtypes:
        ops = ["sum", "sum", "max", "min", "product"] + (["avg"] if dtype.is_floating_point else [])
        for opname, n in zip(ops, [1, 4099, 1000, 1000, 1000, 1000]):
            inplace = k % 2 == 1  # alternate, so every dtype and op meets both forms across the dtypes
            k += 1
            t = zbccl.empty(n, dtype=dtype)
            t.copy_(payload(me, n, dtype))
            out = t if inplace else torch.empty(n, dtype=dtype)
            dev.all_reduce(t, opname, out=None if inplace else out, algo="one_shot")
            ref = all_reduce_ref([payload(r, n, dtype) for r in range(W)], REDUCE_OPS[opname])
            assert torch.equal(out, ref), f"one_shot {dtype} {opname} n={n} inplace={inplace}"
            if not inplace:
                assert torch.equal(t, payload(me, n, dtype)), "the input changed"
            digests.append(_digest(out))
    # A 2-d tensor, more elements than one block's tile (several tiles per block), in place.
    t = zbccl.empty(70, 131, dtype=torch.float32)
    t.copy_(payload(me, 70 * 131, torch.float32).view(70, 131))
    dev.all_reduce(t, "sum", algo="one_shot")
    assert torch.equal(t, all_reduce_ref([payload(r, 70 * 131, torch.float32).view(70, 131) for r in range(W)], 0))
    digests.append(_digest(t))
    return digests


def _replay_cases(dev, W: int, me: int) -> None:
    """The same launch many times in a row (what a graph replay does): the epochs stay in step."""
    import zbccl
    from zbccl.ops.reference import all_reduce_ref

    t = zbccl.empty(300, dtype=torch.bfloat16)
    out = torch.empty(300, dtype=torch.bfloat16)
    gathered = torch.empty(W * 300, dtype=torch.bfloat16)
    for i in range(10):
        t.copy_(payload(me, 300, torch.bfloat16, salt=i))
        dev.all_reduce(t, "sum", out=out)
        dev.all_gather(gathered, t)
        dev.barrier()
        assert torch.equal(out, all_reduce_ref([payload(r, 300, torch.bfloat16, salt=i) for r in range(W)], 0)), i
        assert torch.equal(gathered, torch.cat([payload(r, 300, torch.bfloat16, salt=i) for r in range(W)])), i


def _gather_cases(dev, W: int, me: int) -> None:
    import zbccl

    for dtype, n in ((torch.float32, 4099), (torch.bfloat16, 7), (torch.int64, 1), (torch.uint8, 1001),
                     (torch.bool, 33)):
        inp = zbccl.empty(n, dtype=dtype)
        inp.copy_(payload(me, n, dtype))
        out = torch.empty(W * n, dtype=dtype)
        dev.all_gather(out, inp)
        assert torch.equal(out, torch.cat([payload(r, n, dtype) for r in range(W)])), (dtype, n)
    # In place: the input is this rank's part of a heap output.
    out = zbccl.empty(W * 1001, dtype=torch.float16)
    mine = out[me * 1001:(me + 1) * 1001]
    mine.copy_(payload(me, 1001, torch.float16))
    dev.all_gather(out, mine)
    assert torch.equal(out, torch.cat([payload(r, 1001, torch.float16) for r in range(W)]))
    # Along inner dims (strided parts), odd shapes.
    for shape, dim in (((5, 3, 7), 1), ((5, 3, 7), 2), ((5, 3, 7), -1), ((4, 9), 0), ((2, 1, 3), 1)):
        n = torch.Size(shape).numel()
        inp = zbccl.empty(*shape, dtype=torch.float32)
        inp.copy_(payload(me, n, torch.float32).view(shape))
        want = torch.cat([payload(r, n, torch.float32).view(shape) for r in range(W)], dim)
        out = torch.empty(want.shape, dtype=torch.float32)
        dev.all_gather(out, inp, dim=dim)
        assert torch.equal(out, want), (shape, dim)
    # all_gather_v: uneven and zero sizes, along dim 0 and an inner dim.
    for sizes in ([3, 0, 5, 2][:W], [0] * (W - 1) + [4], [1000 + 7 * r for r in range(W)]):
        for dim in (0, 1):
            shape = [sizes[me], 3] if dim == 0 else [3, sizes[me]]
            inp = zbccl.empty(*shape, dtype=torch.int32)
            inp.copy_(payload(me, 3 * sizes[me], torch.int32).view(shape))
            parts = [payload(r, 3 * sizes[r], torch.int32).view([sizes[r], 3] if dim == 0 else [3, sizes[r]])
                     for r in range(W)]
            want = torch.cat(parts, dim)
            out = torch.empty(want.shape, dtype=torch.int32)
            dev.all_gather_v(out, inp, sizes, dim=dim)
            assert torch.equal(out, want), (sizes, dim)


def _two_shot_cases(dev, W: int, me: int) -> None:
    import zbccl
    from zbccl.ops.dtypes import REDUCE_OPS
    from zbccl.ops.reference import all_reduce_ref

    for dtype, opname, n in ((torch.float32, "sum", 4099), (torch.bfloat16, "avg", 1001), (torch.int64, "max", 7),
                             (torch.float16, "sum", 1), (torch.int8, "product", 2 * W + 1)):
        ref = all_reduce_ref([payload(r, n, dtype) for r in range(W)], REDUCE_OPS[opname])
        t = zbccl.empty(n, dtype=dtype)
        t.copy_(payload(me, n, dtype))
        out = zbccl.empty(n, dtype=dtype)
        dev.all_reduce(t, opname, out=out, algo="two_shot")
        assert torch.equal(out, ref), f"two_shot {dtype} {opname} n={n}"
        dev.all_reduce(t, opname, algo="two_shot")
        assert torch.equal(t, ref), f"two_shot in place {dtype} {opname} n={n}"


def _big_tile_cases(dev, W: int, me: int) -> None:
    """The GPU's launch shapes (``gpu_plan``) with the big tiles of large copies (``device_args.BIG_FROM``,
    lowered here so that a few thousand elements take them): several tiles per block, a masked tail, an
    all_gather out of place and in place; the all_reduces keep the small tiles, also at that size."""
    import zbccl
    from zbccl.ops import device_args
    from zbccl.ops.reference import all_reduce_ref

    saved = dev.gpu_plan, device_args.BIG_FROM, device_args.BIG_TILE_BYTES
    dev.gpu_plan, device_args.BIG_FROM, device_args.BIG_TILE_BYTES = True, 4096, 16384
    try:
        assert device_args.plan(5000, 4, False)[1] == 4096  # big tiles: 16 KiB of fp32 here
        assert device_args.plan(5000, 4, False, copy=False)[1] == device_args.TILE_BYTES // 4
        n = 3 * 2048 * W + 77
        for algo in ("one_shot", "two_shot"):
            t = zbccl.empty(n, dtype=torch.float32)
            t.copy_(payload(me, n, torch.float32))
            dev.all_reduce(t, "sum", algo=algo)
            assert torch.equal(t, all_reduce_ref([payload(r, n, torch.float32) for r in range(W)], 0)), algo
        m = 5 * 8192 + 3
        out = zbccl.empty(W * m, dtype=torch.bfloat16)
        want = torch.cat([payload(r, m, torch.bfloat16) for r in range(W)])
        inp = zbccl.empty(m, dtype=torch.bfloat16)
        inp.copy_(payload(me, m, torch.bfloat16))
        dev.all_gather(out, inp)
        assert torch.equal(out, want), "all_gather, big tiles"
        out.zero_()
        out[me * m:(me + 1) * m].copy_(payload(me, m, torch.bfloat16))
        dev.all_gather(out, out[me * m:(me + 1) * m])
        assert torch.equal(out, want), "all_gather in place, big tiles"
    finally:
        dev.gpu_plan, device_args.BIG_FROM, device_args.BIG_TILE_BYTES = saved


def _scatter_cases(dev, W: int, me: int) -> None:
    import zbccl
    from zbccl.ops.dtypes import REDUCE_OPS
    from zbccl.ops.reference import reduce_ref

    for dtype, opname, n in ((torch.float32, "sum", 1000), (torch.bfloat16, "sum", 7), (torch.int32, "min", 1),
                             (torch.float64, "avg", 33)):
        full = [payload(r, W * n, dtype) for r in range(W)]
        want = reduce_ref([x[me * n:(me + 1) * n] for x in full], REDUCE_OPS[opname])
        inp = zbccl.empty(W * n, dtype=dtype)
        inp.copy_(full[me])
        out = torch.empty(n, dtype=dtype)
        dev.reduce_scatter(out, inp, opname)
        assert torch.equal(out, want), (dtype, opname, n)
        dev.reduce_scatter(inp[me * n:(me + 1) * n], inp, opname)  # in place: this rank's part of the input
        assert torch.equal(inp[me * n:(me + 1) * n], want), (dtype, opname, n, "in place")
    # Along an inner dim, and per-rank sizes (uneven, zero) along dim 0 and 1.
    shape = (3, 2 * W, 5)
    full = [payload(r, 30 * W, torch.float16).view(shape) for r in range(W)]
    inp = zbccl.empty(*shape, dtype=torch.float16)
    inp.copy_(full[me])
    out = torch.empty(3, 2, 5, dtype=torch.float16)
    dev.reduce_scatter(out, inp, "sum", dim=1)
    assert torch.equal(out, reduce_ref([x[:, 2 * me:2 * me + 2] for x in full], 0))
    for sizes in ([2, 0, 3][:W] + [1] * (W - 3), [0] * (W - 1) + [5]):
        T = sum(sizes)
        pre = sum(sizes[:me])
        for dim in (0, 1):
            shp = (T, 4) if dim == 0 else (4, T)
            full = [payload(r, 4 * T, torch.int16).view(shp) for r in range(W)]
            inp = zbccl.empty(*shp, dtype=torch.int16)
            inp.copy_(full[me])
            parts = [x.narrow(dim, pre, sizes[me]) for x in full]
            out = torch.empty(parts[me].shape, dtype=torch.int16)
            dev.reduce_scatter_v(out, inp, sizes, "sum", dim=dim)
            assert torch.equal(out, reduce_ref(parts, 0)), (sizes, dim)


def _exchange_cases(dev, W: int, me: int) -> None:
    import zbccl
    from zbccl.ops.reference import all_to_all_ref

    for dtype, rows_per in ((torch.float32, 3), (torch.bfloat16, 1), (torch.uint8, 5)):
        n = W * rows_per * 7
        inp = zbccl.empty(W * rows_per, 7, dtype=dtype)
        inp.copy_(payload(me, n, dtype).view(W * rows_per, 7))
        out = torch.empty(W * rows_per, 7, dtype=dtype)
        dev.all_to_all(out, inp)
        want = all_to_all_ref([payload(r, n, dtype).view(W * rows_per, 7) for r in range(W)],
                              [[rows_per] * W for _ in range(W)], me)
        assert torch.equal(out, want.view(out.shape)), dtype
    # Uneven and zero splits: rank q sends (q + 2 * p) % 3 rows to rank p.
    send = [[(q + 2 * p) % 3 for p in range(W)] for q in range(W)]
    rows = sum(send[me])
    inp = zbccl.empty(rows, 5, dtype=torch.int64)
    inp.copy_(payload(me, rows * 5, torch.int64).view(rows, 5))
    recv = [send[q][me] for q in range(W)]
    out = torch.empty(sum(recv), 5, dtype=torch.int64)
    dev.all_to_all_v(out, inp, recv, send[me])
    want = all_to_all_ref([payload(q, sum(send[q]) * 5, torch.int64).view(-1, 5) for q in range(W)], send, me)
    assert torch.equal(out, want.view(out.shape))
    # Listed rows (what EP's dispatch sends): rank q's list names, for each destination, rows of its input in any
    # order and with repeats; each peer pulls them where they are. Input rows: 6, bf16 rows of 9 (odd bytes).
    def listed(q):
        return [(q * 5 + 3 * i) % 6 for i in range(sum(send[q]))]
    inp = zbccl.empty(6, 9, dtype=torch.bfloat16)
    inp.copy_(payload(me, 54, torch.bfloat16).view(6, 9))
    lst = zbccl.empty(sum(send[me]), dtype=torch.int64)
    lst.copy_(torch.tensor(listed(me), dtype=torch.int64))
    out = torch.empty(sum(recv), 9, dtype=torch.bfloat16)
    dev.all_to_all_v(out, inp, recv, send[me], rows=lst)
    parts = []
    for q in range(W):
        src = payload(q, 54, torch.bfloat16).view(6, 9)
        pick = listed(q)[sum(send[q][:me]):sum(send[q][:me + 1])]
        parts.append(src[pick])
    assert torch.equal(out, torch.cat(parts)), "listed rows"


def _broadcast_cases(dev, W: int, me: int) -> None:
    import zbccl

    for src in range(W):
        for dtype, n in ((torch.float32, 4099), (torch.bool, 7)):
            t = zbccl.empty(n, dtype=dtype) if me == src else torch.empty(n, dtype=dtype)
            t.copy_(payload(me, n, dtype))
            dev.broadcast(t, src)
            assert torch.equal(t, payload(src, n, dtype)), (src, dtype)


def _group_cases(comm, W: int, me: int) -> None:
    """A sub-communicator (global ranks 0 and W-1) has its own kernel slot; its ranks are global ranks."""
    import zbccl
    from zbccl.ops.device import DeviceOps
    from zbccl.ops.reference import all_reduce_ref

    members = [0, W - 1]
    group = comm.new_group(members)
    if not group:
        return
    dev = DeviceOps(group.rank, group.ranks, comm._ctx.heap.transport, slot=group.slot, timeout_s=30,
                    barrier=group.barrier)
    assert group.slot != comm.slot and dev.ranks == tuple(members)
    t = zbccl.empty(1001, dtype=torch.float32)
    t.copy_(payload(me, 1001, torch.float32))
    dev.all_reduce(t)
    assert torch.equal(t, all_reduce_ref([payload(r, 1001, torch.float32) for r in members], 0))
    out = torch.empty(2 * 33, dtype=torch.int32)
    inp = zbccl.empty(33, dtype=torch.int32)
    inp.copy_(payload(me, 33, torch.int32))
    dev.all_gather(out, inp)
    assert torch.equal(out, torch.cat([payload(r, 33, torch.int32) for r in members]))
    group.destroy()


def _collectives(ctx):
    comm, dev = device_ops(ctx)
    W, me = comm.world_size, comm.rank
    dev.barrier()
    # Every dtype at world 2; at world 3 (three interpreted ranks on the CI's cores) a subset.
    dtypes = DTYPES if W == 2 else FLOATS + [torch.int32, torch.int8, torch.bool]
    digests = _all_reduce_cases(dev, W, me, dtypes)
    _two_shot_cases(dev, W, me)
    _big_tile_cases(dev, W, me)
    _gather_cases(dev, W, me)
    _scatter_cases(dev, W, me)
    _exchange_cases(dev, W, me)
    _broadcast_cases(dev, W, me)
    _replay_cases(dev, W, me)
    if W > 2:
        _group_cases(comm, W, me)
    dev.barrier()
    return digests


@pytest.mark.parametrize("world", [2, 3])
def test_triton_collectives_match_the_reference(world):
    results = run_world(_collectives, world, env=ENV, timeout=240)
    assert all(r == results[0] for r in results), "ranks disagree on the all_reduce results"
