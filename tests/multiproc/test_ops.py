"""Every collective, dtype and algorithm against the plain-torch reference.

One spawned world per world size runs all sub-cases. Payloads encode their
source: ``value = f(rank, index)``, so a misplaced row is caught. Results must
be bit-exact against :mod:`zbccl.ops.reference` and identical on every rank.
"""

from __future__ import annotations

import hashlib
import math

import pytest
import torch

from tests.spawn import run_world

MiB = 1 << 20
FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
INTS = [torch.int32, torch.int64, torch.int8, torch.uint8]
SIZES = [0, 1, 7, 1000, 4099, 70001]


def payload(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """f(rank, index): distinct per source rank and position."""
    i = torch.arange(n, dtype=torch.float64)
    if dtype.is_floating_point:
        return (torch.sin(i * 0.37 + rank * 1.3) * 50 + rank).to(dtype)
    if dtype == torch.bool:
        return ((i.long() + rank) % 3 == 0)
    hi = 100 if dtype in (torch.int8, torch.uint8) else 10_000
    return ((i.long() * 7 + rank * 13 + 1) % hi).to(dtype)


def digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def force(comm, op: str, algo: str | None) -> None:
    from zbccl.ops.tuner import force_algorithm

    force_algorithm(comm, op, algo)


def _all_reduce_cases(comm):
    import zbccl
    from zbccl.ops.dtypes import REDUCE_OPS
    from zbccl.ops.reference import all_reduce_ref

    W, me = comm.world_size, comm.rank
    digests = []
    for algo in ("oneshot", "twoshot"):
        force(comm, "all_reduce", algo)
        for dtype in FLOATS + INTS:
            for opname in ("sum", "avg", "max", "min", "product"):
                if opname == "avg" and not dtype.is_floating_point:
                    continue
                sizes = SIZES if opname == "sum" else [1000]
                for n in sizes:
                    t = zbccl.empty(n, dtype=dtype)
                    t.copy_(payload(me, n, dtype))
                    zbccl.all_reduce(t, opname)
                    ref = all_reduce_ref([payload(r, n, dtype) for r in range(W)], REDUCE_OPS[opname])
                    assert torch.equal(t, ref), f"all_reduce {algo} {dtype} {opname} n={n}"
                    digests.append(digest(t))
    # torch's ReduceOp spelling and 2-D tensors.
    t = zbccl.empty(33, 5, dtype=torch.float32)
    t.copy_(payload(me, 165, torch.float32).view(33, 5))
    zbccl.all_reduce(t, torch.distributed.ReduceOp.MAX)
    assert torch.equal(t, all_reduce_ref([payload(r, 165, torch.float32).view(33, 5) for r in range(W)], 2))
    force(comm, "all_reduce", None)
    return digests


def _gather_cases(comm):
    import zbccl

    W, me = comm.world_size, comm.rank
    st0 = zbccl.memory_stats()["staged_bytes"]
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.uint8):
        for n in (0, 1, 1000, 4099):
            full = torch.cat([payload(r, n, dtype) for r in range(W)])
            # pull: heap input, private output
            x = zbccl.empty(n, dtype=dtype)
            x.copy_(payload(me, n, dtype))
            out = torch.empty(W * n, dtype=dtype)
            zbccl.all_gather_into_tensor(out, x)
            assert torch.equal(out, full), f"all_gather pull {dtype} n={n}"
            # push: private input, heap output (2-D output, torch layout [W*n0, ...])
            out2 = zbccl.empty(W * n, dtype=dtype)
            zbccl.all_gather_into_tensor(out2, payload(me, n, dtype))
            assert torch.equal(out2, full), f"all_gather push {dtype} n={n}"
            # in place: the input is this rank's slice of the heap output
            out3 = zbccl.empty(W * n, dtype=dtype)
            out3[me * n:(me + 1) * n].copy_(payload(me, n, dtype))
            zbccl.all_gather_into_tensor(out3, out3[me * n:(me + 1) * n])
            assert torch.equal(out3, full), f"all_gather in place {dtype} n={n}"
    assert zbccl.memory_stats()["staged_bytes"] == st0, "heap operands must not be staged"
    # mixed placement: rank 0's input is private, the others' in the heap, outputs private: the
    # heap ranks start on the native path, which hands over to Python to stage rank 0's input
    x = zbccl.empty(513, dtype=torch.bfloat16)
    x.copy_(payload(me, 513, torch.bfloat16))
    out = torch.empty(W * 513, dtype=torch.bfloat16)
    zbccl.all_gather_into_tensor(out, x.clone() if me == 0 else x)
    assert torch.equal(out, torch.cat([payload(r, 513, torch.bfloat16) for r in range(W)]))
    st0 = zbccl.memory_stats()["staged_bytes"]
    # forced push with both in the heap
    force(comm, "all_gather", "push")
    x = zbccl.empty(100, dtype=torch.float32)
    x.copy_(payload(me, 100, torch.float32))
    out = zbccl.empty(W * 100, dtype=torch.float32)
    zbccl.all_gather_into_tensor(out, x)
    assert torch.equal(out, torch.cat([payload(r, 100, torch.float32) for r in range(W)]))
    force(comm, "all_gather", None)
    # all_gather_v: per-rank row counts, 2-D rows
    sizes = [(r * 3) % 5 for r in range(W)]
    rows = lambda r: payload(r, sizes[r] * 4, torch.bfloat16).view(sizes[r], 4)  # noqa: E731
    x = zbccl.empty(sizes[me], 4, dtype=torch.bfloat16)
    x.copy_(rows(me))
    out = torch.empty(sum(sizes), 4, dtype=torch.bfloat16)
    zbccl.all_gather_v(out, x, sizes)
    assert torch.equal(out, torch.cat([rows(r) for r in range(W)]))
    assert zbccl.memory_stats()["staged_bytes"] == st0
    return True


def _gather_dim_cases(comm):
    """all_gather_into_tensor(dim=d): rank r's input lands at slice r along d (torch.cat of the inputs),
    every placement, written in place into the output's columns; repeated calls (the plan, the hot entry)."""
    import zbccl

    W, me = comm.world_size, comm.rank

    def src(r, shape, dtype):
        return payload(r, int(torch.tensor(shape).prod()), dtype).view(shape)

    st0 = zbccl.memory_stats()["staged_bytes"]
    for dtype in (torch.float32, torch.bfloat16, torch.uint8):
        for shape, dim in (((5, 7), 1), ((5, 7), -1), ((3, 4, 6), 1), ((3, 4, 6), 2), ((1, 9), -1), ((2, 0, 3), 1)):
            d = dim % len(shape)
            full = torch.cat([src(r, shape, dtype) for r in range(W)], dim=d)
            oshape = full.shape
            for _ in range(3):  # the first call checks and plans; the others take the hot entry or the plan
                x = zbccl.empty(shape, dtype=dtype)  # pull: heap input, private output
                x.copy_(src(me, shape, dtype))
                out = torch.full(oshape, 7, dtype=dtype)
                zbccl.all_gather_into_tensor(out, x, dim=dim)
                assert torch.equal(out, full), f"gather dim={dim} pull {dtype} {shape}"
            outh = zbccl.empty(oshape, dtype=dtype)  # push: private input, heap output
            zbccl.all_gather_into_tensor(outh, src(me, shape, dtype), dim=dim)
            assert torch.equal(outh, full), f"gather dim={dim} push {dtype} {shape}"
    assert zbccl.memory_stats()["staged_bytes"] == st0, "heap operands must not be staged"
    # the same heap pair served again and again (vLLM's logits): the hot entry, bit-exact each time
    x, out = zbccl.empty(8, 100, dtype=torch.bfloat16), zbccl.empty(8, 100 * W, dtype=torch.bfloat16)
    for k in range(5):
        x.copy_(src(me, (8, 100), torch.bfloat16) + k)
        zbccl.all_gather_into_tensor(out, x, dim=-1)
        assert torch.equal(out, torch.cat([src(r, (8, 100), torch.bfloat16) + k for r in range(W)], dim=1))
    # the same tensors gathered along dim 0 must not take dim -1's plan (nor the reverse)
    out0 = zbccl.empty(8 * W, 100, dtype=torch.bfloat16)
    zbccl.all_gather_into_tensor(out0, x)
    assert torch.equal(out0, torch.cat([src(r, (8, 100), torch.bfloat16) + 4 for r in range(W)]))
    flat = out.view(8 * W, 100)  # dim 0 into dim -1's output storage, then dim -1 again
    zbccl.all_gather_into_tensor(flat, x)
    assert torch.equal(flat, out0)
    zbccl.all_gather_into_tensor(out, x, dim=1)
    assert torch.equal(out, torch.cat([src(r, (8, 100), torch.bfloat16) + 4 for r in range(W)], dim=1))
    # forced push with both in the heap; neither in the heap (staged); a non-contiguous output
    force(comm, "all_gather", "push")
    zbccl.all_gather_into_tensor(out, x, dim=1)
    assert torch.equal(out, torch.cat([src(r, (8, 100), torch.bfloat16) + 4 for r in range(W)], dim=1))
    force(comm, "all_gather", None)
    p = src(me, (6, 33), torch.float32)
    o = torch.empty(6, 33 * W)
    zbccl.all_gather_into_tensor(o, p, dim=1)
    assert torch.equal(o, torch.cat([src(r, (6, 33), torch.float32) for r in range(W)], dim=1))
    # all_gather_v along an inner dimension: per-rank sizes (one rank sends nothing), heap and private
    sizes = [(r * 2 + 1) % 4 for r in range(W)]  # 1, 3, 1, ...: W=2 [1, 3], W=3 [1, 3, 1]
    sizes[-1] = 0 if W > 2 else sizes[-1]
    for dim in (1, -1, 2):
        d = 1 if dim in (1, -2) else 2
        shape = lambda r, d=d: (3, sizes[r], 5) if d == 1 else (3, 5, sizes[r])  # noqa: E731
        want = torch.cat([src(r, shape(r), torch.float32) for r in range(W)], dim=d)
        xv = zbccl.empty(shape(me), dtype=torch.float32)
        xv.copy_(src(me, shape(me), torch.float32))
        for inp in (xv, src(me, shape(me), torch.float32)):
            ov = torch.full(want.shape, -1.0)
            zbccl.all_gather_v(ov, inp, sizes, dim=dim)
            assert torch.equal(ov, want), f"all_gather_v dim={dim} sizes={sizes}"
    ot = torch.empty(33 * W, 6, dtype=torch.bfloat16).t()  # non-contiguous output and input
    zbccl.all_gather_into_tensor(ot, x[:6, :33], dim=1)
    assert torch.equal(ot, torch.cat([(src(r, (8, 100), torch.bfloat16) + 4)[:6, :33] for r in range(W)], dim=1))
    return True


def _reduce_scatter_cases(comm):
    import zbccl
    from zbccl.ops.reference import reduce_scatter_ref

    W, me = comm.world_size, comm.rank
    st0 = zbccl.memory_stats()["staged_bytes"]
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int32):
        for n in (0, 1, 999, 4099):
            for opname, code in (("sum", 0), ("max", 2)):
                x = zbccl.empty(W * n, dtype=dtype)
                x.copy_(payload(me, W * n, dtype))
                out = torch.empty(n, dtype=dtype)
                zbccl.reduce_scatter_tensor(out, x, opname)
                ref = reduce_scatter_ref([payload(r, W * n, dtype) for r in range(W)], code, [n] * W, me)
                assert torch.equal(out, ref), f"reduce_scatter {dtype} {opname} n={n}"
    # in place: the output aliases this rank's slice of its own input
    n = 512
    x = zbccl.empty(W * n, dtype=torch.float32)
    x.copy_(payload(me, W * n, torch.float32))
    zbccl.reduce_scatter_tensor(x[me * n:(me + 1) * n], x)
    ref = reduce_scatter_ref([payload(r, W * n, torch.float32) for r in range(W)], 0, [n] * W, me)
    assert torch.equal(x[me * n:(me + 1) * n], ref)
    # reduce_scatter_v with rows of 3
    sizes = [r + 1 for r in range(W)]
    total = sum(sizes) * 3
    x = zbccl.empty(sum(sizes), 3, dtype=torch.bfloat16)
    x.copy_(payload(me, total, torch.bfloat16).view(-1, 3))
    out = torch.empty(sizes[me], 3, dtype=torch.bfloat16)
    zbccl.reduce_scatter_v(out, x, sizes, "avg")
    ref = reduce_scatter_ref([payload(r, total, torch.bfloat16) for r in range(W)], 4,
                             [s * 3 for s in sizes], me)
    assert torch.equal(out.view(-1), ref)
    assert zbccl.memory_stats()["staged_bytes"] == st0
    # along an inner dimension (even and per-rank sizes): rank r's chunk of every input's columns
    from zbccl.ops.reference import reduce_ref

    sizes_v = [3] + [0] * (W - 2) + [7]  # per-rank sizes along dim 1, a middle rank (W=3) gets none
    for dtype, opname, code in ((torch.bfloat16, "sum", 0), (torch.float32, "max", 2), (torch.int32, "sum", 0)):
        for shape, dim, sizes in (((4, 6 * W), -1, None), ((2, 3 * W, 5), 1, None), ((3, 2, 4 * W), 2, None),
                                  ((3, 10), 1, sizes_v)):
            d = dim % len(shape)
            parts = sizes if sizes is not None else [shape[d] // W] * W
            inputs = [payload(r, math.prod(shape), dtype).view(shape) for r in range(W)]
            lo = sum(parts[:me])
            want = reduce_ref([t.narrow(d, lo, parts[me]).contiguous().view(-1) for t in inputs], code)
            want = want.view(*shape[:d], parts[me], *shape[d + 1:])
            for heap in (True, False):
                x = zbccl.empty(shape, dtype=dtype) if heap else torch.empty(shape, dtype=dtype)
                x.copy_(inputs[me])
                o = torch.full(want.shape, 3, dtype=dtype)
                st = zbccl.memory_stats()["staged_bytes"]
                if sizes is None:
                    zbccl.reduce_scatter_tensor(o, x, opname, dim=dim)
                else:
                    zbccl.reduce_scatter_v(o, x, sizes, opname, dim=dim)
                assert torch.equal(o, want), f"reduce_scatter dim={dim} {shape} {dtype} {opname} sizes={sizes}"
                assert not heap or zbccl.memory_stats()["staged_bytes"] == st, "a heap input must not be staged"
    return True


def _all_to_all_cases(comm):
    import zbccl
    from zbccl.ops.reference import all_to_all_ref

    W, me = comm.world_size, comm.rank
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        # even
        x = zbccl.empty(W * 6, 2, dtype=dtype)
        x.copy_(payload(me, W * 12, dtype).view(-1, 2))
        out = torch.empty(W * 6, 2, dtype=dtype)
        zbccl.all_to_all_single(out, x)
        ref = all_to_all_ref([payload(r, W * 12, dtype).view(-1, 2) for r in range(W)], [[6] * W] * W, me)
        assert torch.equal(out, ref), f"all_to_all even {dtype}"
        # uneven, with empty blocks: rank q sends (q + 2r) % 4 rows to rank r
        splits = [[(q + 2 * r) % 4 for r in range(W)] for q in range(W)]
        recv = [splits[q][me] for q in range(W)]
        inputs = [payload(q, sum(splits[q]) * 2, dtype).view(-1, 2) for q in range(W)]
        x = zbccl.empty(sum(splits[me]), 2, dtype=dtype)
        x.copy_(inputs[me])
        for out in (torch.empty(sum(recv), 2, dtype=dtype), zbccl.empty(sum(recv), 2, dtype=dtype)):
            zbccl.all_to_all_single(out, x, recv, splits[me])
            assert torch.equal(out, all_to_all_ref(inputs, splits, me)), f"all_to_all uneven {dtype}"
        # push: private input, heap output
        force(comm, "all_to_all", "push")
        out = zbccl.empty(sum(recv), 2, dtype=dtype)
        zbccl.all_to_all_single(out, inputs[me].clone(), recv, splits[me])
        assert torch.equal(out, all_to_all_ref(inputs, splits, me))
        force(comm, "all_to_all", None)
    return True


def _broadcast_cases(comm):
    import zbccl

    W, me = comm.world_size, comm.rank
    for src in range(W):
        for dtype in (torch.float32, torch.bfloat16, torch.int8):
            t = zbccl.empty(1001, dtype=dtype) if me == src else torch.empty(1001, dtype=dtype)
            t.copy_(payload(me, 1001, dtype))
            zbccl.broadcast(t, src)
            assert torch.equal(t, payload(src, 1001, dtype)), f"broadcast src={src} {dtype}"
    zbccl.barrier()
    return True




def _suite(ctx):
    import zbccl

    comm = ctx.init(heap_size=32 * MiB)
    try:
        digests = _all_reduce_cases(comm)
        assert zbccl.memory_stats()["staged_bytes"] == 0, "heap tensors must never be staged"
        assert _gather_cases(comm) and _gather_dim_cases(comm) and _reduce_scatter_cases(comm)  # each checks staged_bytes
        assert _all_to_all_cases(comm) and _broadcast_cases(comm)
        every = comm.all_gather_object(digests)
        assert all(d == every[0] for d in every), "ranks got different bits"
        return len(digests)
    finally:
        zbccl.finalize()


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_op_against_reference(world_size):
    counts = run_world(_suite, world_size, timeout=240)
    assert counts[0] > 100


def _oversubscribed(ctx):
    import zbccl
    from zbccl.ops.reference import all_reduce_ref

    comm = ctx.init(heap_size=8 * MiB)
    try:
        W, me = comm.world_size, comm.rank
        for algo in ("oneshot", "twoshot"):
            force(comm, "all_reduce", algo)
            for n in (1, 4099, 70001):
                t = zbccl.empty(n, dtype=torch.bfloat16)
                t.copy_(payload(me, n, torch.bfloat16))
                zbccl.all_reduce(t)
                assert torch.equal(t, all_reduce_ref([payload(r, n, torch.bfloat16) for r in range(W)], 0))
        x = zbccl.empty(777, dtype=torch.float32)
        x.copy_(payload(me, 777, torch.float32))
        out = torch.empty(W * 777)
        zbccl.all_gather_into_tensor(out, x)
        assert torch.equal(out, torch.cat([payload(r, 777, torch.float32) for r in range(W)]))
        sub = comm.new_group([1, 3])
        if sub:
            t = zbccl.empty(100, dtype=torch.float32)
            t.copy_(payload(me, 100, torch.float32))
            zbccl.all_reduce(t, comm=sub)
            assert torch.equal(t, all_reduce_ref([payload(r, 100, torch.float32) for r in (1, 3)], 0))
        return True
    finally:
        zbccl.finalize()


def test_world_size_4_oversubscribed():
    assert run_world(_oversubscribed, 4, timeout=180) == [True] * 4


def _mismatch(ctx, algo):
    import zbccl

    comm = ctx.init(heap_size=8 * MiB)
    force(comm, "all_reduce", algo)
    try:
        me = comm.rank
        errors = []

        def expect(fn, pattern):
            with pytest.raises(zbccl.ZbcclInvalidUsageError, match=pattern) as info:
                fn()
            errors.append(str(info.value))

        expect(lambda: zbccl.all_reduce(zbccl.zeros(10 + me)), "disagree on input numel")
        expect(lambda: zbccl.all_reduce(zbccl.zeros(10, dtype=torch.float32 if me else torch.bfloat16)),
               "disagree on dtype")
        expect(lambda: zbccl.all_reduce(zbccl.zeros(10), "max" if me else "sum"), "disagree on reduce op")
        if me == 0:
            expect(lambda: zbccl.all_reduce(zbccl.zeros(10)), "disagree on op")
        else:
            expect(lambda: zbccl.broadcast(zbccl.zeros(10), 0), "disagree on op")
        out = torch.empty(20 + me)
        expect(lambda: zbccl.all_gather_into_tensor(out, zbccl.zeros(10)), "invalid arguments|wrong sizes")
        x = zbccl.zeros(4, 2)
        expect(lambda: zbccl.all_to_all_single(torch.empty(4, 2), x, [2, 2], [1, 3] if me else [2, 2]),
               "split sizes disagree")
        expect(lambda: zbccl.reduce_scatter_tensor(torch.empty(4), zbccl.zeros(8 + 2 * me)),
               "invalid arguments|disagree")
        # an argument only one rank gets wrong fails on every rank, it does not hang the others
        expect(lambda: zbccl.all_reduce(zbccl.zeros(10), "median" if me else "sum"), "reduce op|invalid arguments")
        expect(lambda: zbccl.broadcast(zbccl.zeros(10), 5 if me else 0), "src out of range|invalid arguments")
        expect(lambda: zbccl.reduce_scatter_tensor(torch.empty(4), zbccl.zeros(8), "median" if me else "sum"),
               "reduce op|invalid arguments")
        cplx = torch.zeros(8, dtype=torch.complex64 if me else torch.float32)
        expect(lambda: zbccl.all_gather_into_tensor(torch.empty(16, dtype=cplx.dtype), cplx),
               "unsupported dtype|invalid arguments")
        # all_gather along a dimension: ranks that gather along different dims, or a dim out of range
        x = zbccl.zeros(4, 2)
        o = torch.empty(4, 2 * comm.world_size) if me else torch.empty(4 * comm.world_size, 2)
        expect(lambda: zbccl.all_gather_into_tensor(o, x, dim=1 if me else 0), "disagree on the gathered dimension")
        expect(lambda: zbccl.all_gather_into_tensor(o, x, dim=2 if me else 0), "dim out of range|invalid arguments")
        xr = zbccl.zeros(4, 4)
        expect(lambda: zbccl.reduce_scatter_tensor(torch.empty(4, 2) if me else torch.empty(2, 4), xr, dim=me),
               "disagree on the scattered dimension")
        og = zbccl.empty(4, 2 * comm.world_size)  # dim 0's in-place slice is not rank r's strided slice
        expect(lambda: zbccl.all_gather_into_tensor(og, og.view(-1)[me * 8:(me + 1) * 8].view(4, 2), dim=1),
               "overlap")
        ov = torch.empty(4, 4)  # each rank consistent on its own, the sizes lists differ
        xv = zbccl.zeros(4, 1 + me)
        expect(lambda: zbccl.all_gather_v(ov, xv, [2, 2] if me else [1, 3], dim=1),
               r"disagree on sizes.*expected \[1, 3\]")
        # after all of that, the group is still in step
        t = zbccl.zeros(3).fill_(me + 1)
        zbccl.all_reduce(t)
        assert t.tolist() == [3.0] * 3
        return errors
    finally:
        zbccl.finalize()


@pytest.mark.parametrize("algo", ["twoshot", "oneshot"])
def test_mismatched_arguments_fail_on_every_rank(algo):
    """With oneshot, a rank that posted an error or called another op takes the common handshake while
    its peer waits on the oneshot's election word: it must release that peer with the verdict."""
    a, b = run_world(_mismatch, 2, algo=algo, timeout=60)
    assert len(a) == len(b) == 16


def _skewed_oneshot(ctx):
    """oneshot with the ranks arriving in turn late (the late one reduces for all), early, or together;
    other ops in between; payloads encode rank and index; every rank's result checked every time."""
    import zbccl
    from zbccl.ops.channel import L_ARRIVE, channel_of
    from zbccl.ops.reference import all_reduce_ref
    from zbccl.runtime.waits import wait_flags

    comm = ctx.init(heap_size=8 * MiB)
    try:
        W, me = comm.world_size, comm.rank
        force(comm, "all_reduce", "oneshot")
        zbccl.all_reduce(zbccl.zeros(1))  # the channel exists
        ch = channel_of(comm)
        ch.prims.chan_phases(ch.handle, 1)
        claimed = 0
        for i in range(60):
            n = (1, 257, 4099, 70001)[i % 4]
            dtype = (torch.float32, torch.bfloat16)[i % 2]
            t = zbccl.empty(n, dtype=dtype)
            t.copy_(payload(me + i, n, dtype))
            if i % (W + 1) == me:  # this rank arrives last: after every peer posted its ARRIVE for this op
                wait_flags(comm._ctx, ch.peer_flags[L_ARRIVE], ch.seq + 1, timeout=60, op="test")
            zbccl.all_reduce(t)
            ref = all_reduce_ref([payload(r + i, n, dtype) for r in range(W)], 0)
            assert torch.equal(t, ref), f"oneshot step {i} n={n} {dtype}"
            claimed += ch.prims.chan_phases(ch.handle, 1)[1] > 0  # only the claimant reduces
            if i % 7 == 0:
                x = zbccl.empty(33).fill_(me + i)
                out = torch.empty(33 * W)
                zbccl.all_gather_into_tensor(out, x)
                assert out.view(W, 33)[:, 0].tolist() == [float(r + i) for r in range(W)]
        return claimed
    finally:
        zbccl.finalize()


@pytest.mark.parametrize("world_size", [2, 3])
def test_oneshot_under_skew(world_size):
    claimed = run_world(_skewed_oneshot, world_size, timeout=120)
    assert sum(claimed) == 60, claimed  # exactly one claimant per op
    assert all(c >= 10 for c in claimed), claimed  # each rank claimed the ops where it came late


def _against_gloo(ctx):
    import torch.distributed as dist

    import zbccl

    dist.init_process_group("gloo", store=dist.PrefixStore("gloo", ctx.store()), rank=ctx.rank,
                            world_size=ctx.world_size)
    comm = ctx.init(heap_size=8 * MiB)
    try:
        W, me = comm.world_size, comm.rank
        for dtype in (torch.int32, torch.int64, torch.float64):
            a = zbccl.empty(5000, dtype=dtype)
            a.copy_(payload(me, 5000, dtype))
            g = a.clone()
            zbccl.all_reduce(a)
            dist.all_reduce(g)
            assert torch.equal(a, g), dtype
            o1, o2 = torch.empty(W * 5000, dtype=dtype), torch.empty(W * 5000, dtype=dtype)
            zbccl.all_gather_into_tensor(o1, a)
            dist.all_gather_into_tensor(o2, g)
            assert torch.equal(o1, o2)
            r1, r2 = torch.empty(5000, dtype=dtype), torch.empty(5000, dtype=dtype)
            zbccl.reduce_scatter_tensor(r1, zbccl.empty(W * 5000, dtype=dtype).copy_(o1))
            dist.reduce_scatter_tensor(r2, o2.clone())
            assert torch.equal(r1, r2)
        return True
    finally:
        zbccl.finalize()
        dist.destroy_process_group()


def test_matches_gloo():
    assert run_world(_against_gloo, 2) == [True, True]


def _barriers_interleaved(ctx):
    """Barriers (plain and tagged) back to back with collectives, on skewed ranks: the barrier has no DONE
    round, so a fast rank posts its next header while a slow one still reads this one (a seqlock read);
    no false "out of step" or "disagree" may come of it, and a tag that differs fails on every rank with
    the same tags, the group staying in step."""
    import random

    import zbccl
    from zbccl.ops.barrier import tagged_barrier

    comm = ctx.init(heap_size=4 * MiB, timeout=120)
    W, me = comm.world_size, comm.rank
    rng = random.Random(1234 + me)  # per-rank skew, the same sequence of ops on every rank
    t = zbccl.zeros(64)
    for i in range(300):
        if rng.random() < 0.3:  # skew: some work first, so this rank arrives later than the others now and then
            sum(range(rng.randrange(20000)))
        comm.barrier()
        assert tagged_barrier(i, comm=comm) is None
        t.fill_(me + i)
        zbccl.all_reduce(t)
        assert t[0].item() == sum(r + i for r in range(W)), (i, t[0].item())
        zbccl.barrier()
    got = tagged_barrier(100 + me, comm=comm)  # tags differ: every rank gets every rank's tag
    assert got == [100 + r for r in range(W)], got
    comm.barrier()  # still in step
    zbccl.finalize()
    return True


@pytest.mark.parametrize("world_size", [2, 3])
def test_barriers_interleaved_with_collectives(world_size):
    assert all(run_world(_barriers_interleaved, world_size, timeout=240))
