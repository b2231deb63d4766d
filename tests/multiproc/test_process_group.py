"""The ``zbccl`` torch.distributed backend: every method, sync and async, against gloo.

Each world initialises the default group with backend ``zbccl`` and builds a
gloo group over the same ranks (``dist.new_group(backend="gloo")``); every
case runs the same call on both and compares. Payloads encode their source
(``value = f(rank, index)``) so a misplaced block is caught.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from tests.spawn import run_world

MiB = 1 << 20


def payload(rank: int, n: int, dtype=torch.float32, salt: int = 0) -> torch.Tensor:
    i = torch.arange(n, dtype=torch.float64)
    if dtype.is_floating_point:
        return (i * 0.5 + rank * 100 + salt).to(dtype)
    return ((i.long() * 7 + rank * 13 + salt) % 100).to(dtype)


def init_pg(ctx, **kwargs):
    import torch.distributed as dist

    import zbccl  # noqa: F401 - registers the backend

    dist.init_process_group("zbccl", store=ctx.store(), rank=ctx.rank, world_size=ctx.world_size, **kwargs)
    return dist.group.WORLD


def _run(fn, *args, async_op: bool, ret=None, **kwargs):
    """fn(*args, async_op=..., **kwargs); checks the Work of an async call; returns ``ret``."""
    work = fn(*args, async_op=async_op, **kwargs)
    if async_op and isinstance(work, torch.futures.Future):  # all_reduce_coalesced hands out the future
        work.wait()
    elif async_op:
        assert work is not None and work.is_completed() in (True, False)
        work.wait()
        assert work.is_completed() and work.is_success() and work.exception() is None
        work.get_future().wait()
    return ret


def _collectives(ctx, gloo, async_op: bool, group=None):  # noqa: C901 - one case per method
    import torch.distributed as dist

    W = dist.get_world_size(group)
    me = dist.get_rank(group)
    glob = [dist.get_global_rank(group, r) for r in range(W)] if group is not None else list(range(W))

    def both(call):
        """call(group, clone) on zbccl and on gloo; returns both results."""
        return call(group, async_op), call(gloo, False)

    # allreduce, every ReduceOp that makes sense (AVG included), and the bitwise ones (gloo runs them)
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.PRODUCT, dist.ReduceOp.MIN, dist.ReduceOp.MAX):
        def ar(g, a, op=op):
            t = payload(me, 37, torch.float64) / 50 + 1
            if g is gloo and op == dist.ReduceOp.AVG:  # gloo has no AVG
                _run(dist.all_reduce, t, op=dist.ReduceOp.SUM, group=g, async_op=a)
                return t / W
            _run(dist.all_reduce, t, op=op, group=g, async_op=a)
            return t
        z, r = both(ar)
        torch.testing.assert_close(z, r, rtol=1e-12, atol=0, msg=f"allreduce {op}")
    for op in (dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR):
        z, r = both(lambda g, a, op=op: _run(dist.all_reduce, t := payload(me, 9, torch.int64), op=op, group=g,
                                             async_op=a, ret=t))
        assert torch.equal(z, r), op
    with pytest.raises(ValueError, match="PREMUL_SUM"):
        dist.all_reduce(torch.ones(2), op=dist._make_nccl_premul_sum(2.0), group=group)
    # allreduce_coalesced
    z, r = both(lambda g, a: _run(dist.all_reduce_coalesced, ts := [payload(me, 5), payload(me, 3, salt=1)],
                                  group=g, async_op=a, ret=ts))
    assert all(torch.equal(x, y) for x, y in zip(z, r))
    # all_gather (list form): equal and unequal sizes, adjacent views and separate tensors
    def ag(g, a, sizes):
        outs = [torch.zeros(s) for s in sizes]
        _run(dist.all_gather, outs, payload(glob[me], sizes[me]), group=g, async_op=a)
        return outs
    z, r = both(lambda g, a: ag(g, a, [6] * W))
    assert all(torch.equal(x, y) for x, y in zip(z, r))
    sizes = [3 + 2 * r for r in range(W)]  # gloo refuses unequal sizes: compare with the payloads
    z = ag(group, async_op, sizes)
    assert all(torch.equal(z[r], payload(glob[r], sizes[r])) for r in range(W))
    buf = torch.zeros(W * 4)
    _run(dist.all_gather, list(buf.chunk(W)), payload(me, 4), group=group, async_op=async_op)
    assert torch.equal(buf, torch.cat([payload(r, 4) for r in range(W)]))
    # all_gather_into_tensor (both layouts), all_gather_coalesced
    z, r = both(lambda g, a: _run(dist.all_gather_into_tensor, o := torch.zeros(W * 5, 2),
                                  payload(me, 10).view(5, 2), group=g, async_op=a, ret=o))
    assert torch.equal(z, r)
    z = torch.zeros(W, 7, dtype=torch.bfloat16)
    _run(dist.all_gather_into_tensor, z, payload(me, 7, torch.bfloat16), group=group, async_op=async_op)
    assert torch.equal(z, torch.stack([payload(r, 7, torch.bfloat16) for r in range(W)]))
    # reduce_scatter (list form, equal and unequal), reduce_scatter_tensor
    for sizes in ([4] * W, [2 + r for r in range(W)]):
        def rs(g, a, sizes=sizes):
            out = torch.zeros(sizes[me])
            _run(dist.reduce_scatter, out, [payload(me, s, salt=i) for i, s in enumerate(sizes)], group=g,
                 async_op=a)
            return out
        z, r = both(rs)
        assert torch.equal(z, r), sizes
    z, r = both(lambda g, a: _run(dist.reduce_scatter_tensor, o := torch.zeros(3), payload(me, 3 * W), group=g,
                                  async_op=a, ret=o))
    assert torch.equal(z, r)
    # all_to_all_single: equal and uneven splits; all_to_all (list form)
    z, r = both(lambda g, a: _run(dist.all_to_all_single, o := torch.zeros(W * 2, 3), payload(me, W * 6).view(-1, 3),
                                  group=g, async_op=a, ret=o))
    assert torch.equal(z, r)
    ins = [1 + (me + q) % 3 for q in range(W)]
    outs = [1 + (q + me) % 3 for q in range(W)]
    z, r = both(lambda g, a: _run(dist.all_to_all_single, o := torch.zeros(sum(outs), 2),
                                  payload(me, 2 * sum(ins)).view(-1, 2), outs, ins, group=g, async_op=a, ret=o))
    assert torch.equal(z, r)

    def a2a(g, a, ins, outs):
        o = [torch.zeros(outs[q]) for q in range(W)]
        _run(dist.all_to_all, o, [payload(glob[me], ins[q], salt=q) for q in range(W)], group=g, async_op=a)
        return o
    z, r = both(lambda g, a: a2a(g, a, [3] * W, [3] * W))
    assert all(torch.equal(x, y) for x, y in zip(z, r))
    z = a2a(group, async_op, ins, outs)  # gloo refuses uneven lists: compare with the payloads
    assert all(torch.equal(z[q], payload(glob[q], outs[q], salt=me)) for q in range(W))
    # rooted ops: broadcast, reduce, gather, scatter; the root is a global rank in torch's API
    root = glob[W - 1]
    z, r = both(lambda g, a: _run(dist.broadcast, t := payload(me, 11), src=root, group=g, async_op=a, ret=t))
    assert torch.equal(z, r)
    shapes = [(dist.ReduceOp.SUM, lambda: payload(me, 8)), (dist.ReduceOp.MAX, lambda: payload(me, 8)),
              (dist.ReduceOp.AVG, lambda: payload(me, 1)),  # fewer elements than ranks
              (dist.ReduceOp.SUM, lambda: payload(me, 12).view(3, 4).t())]  # not contiguous
    for op, make in shapes:
        def red(g, a, op=op, make=make):
            t = make()
            if g is gloo and op == dist.ReduceOp.AVG:
                _run(dist.reduce, t, dst=root, op=dist.ReduceOp.SUM, group=g, async_op=a)
                return t / W if glob[me] == root else t
            return _run(dist.reduce, t, dst=root, op=op, group=g, async_op=a, ret=t)
        z, r = both(red)
        if glob[me] == root:
            assert torch.equal(z, r), op
        else:
            assert torch.equal(z, make())  # non-roots keep their tensor

    def gat(g, a):
        lst = [torch.zeros(4) for _ in range(W)] if glob[me] == root else None
        _run(dist.gather, payload(me, 4), lst, dst=root, group=g, async_op=a)
        return lst
    z, r = both(gat)
    if glob[me] == root:
        assert all(torch.equal(x, y) for x, y in zip(z, r))

    def sca(g, a):
        out = torch.zeros(5)
        lst = [payload(me, 5, salt=q) for q in range(W)] if glob[me] == root else None
        _run(dist.scatter, out, lst, src=root, group=g, async_op=a)
        return out
    z, r = both(sca)
    assert torch.equal(z, r)
    _run(dist.barrier, group=group, async_op=async_op)
    if not async_op:  # object collectives ride on all_gather / broadcast / gather / scatter of bytes
        objs = [None] * W
        dist.all_gather_object(objs, {"rank": glob[me], "data": list(range(me + 1))}, group=group)
        assert objs == [{"rank": glob[r], "data": list(range(r + 1))} for r in range(W)]
        lst = [f"from {glob[me]}" * (me + 1), me] if glob[me] == root else [None, None]
        dist.broadcast_object_list(lst, src=root, group=group)
        assert lst == [f"from {root}" * W, W - 1]
        got = [None] * W if glob[me] == root else None
        dist.gather_object(("x", me), got, dst=root, group=group)
        assert glob[me] != root or got == [("x", r) for r in range(W)]
        out = [None]
        dist.scatter_object_list(out, [r * 10 for r in range(W)] if glob[me] == root else None, src=root, group=group)
        assert out == [me * 10]
    return True


def _complex(ctx):
    """Complex tensors in the reducing ops torch does not convert itself (reduce_scatter, reduce)."""
    import torch.distributed as dist

    import zbccl

    W, me = ctx.world_size, ctx.rank

    def c(r, n):
        return torch.complex(payload(r, n), -payload(r, n, salt=1))

    total = sum(c(r, 3 * W) for r in range(W))
    out = torch.zeros(3, dtype=torch.complex64)
    dist.reduce_scatter_tensor(out, c(me, 3 * W))
    assert torch.equal(out, total[3 * me:3 * me + 3])
    dist.reduce_scatter(out, list(c(me, 3 * W).chunk(W)), op=dist.ReduceOp.AVG)
    assert torch.allclose(out, total[3 * me:3 * me + 3] / W)
    t = c(me, 3 * W)
    dist.reduce(t, dst=W - 1)
    assert torch.equal(t, total if me == W - 1 else c(me, 3 * W))
    with pytest.raises(zbccl.ZbcclInvalidUsageError, match="complex tensor, expected SUM or AVG, got MAX"):
        dist.reduce(t, dst=0, op=dist.ReduceOp.MAX)


def _every_method(ctx, modes):
    import torch.distributed as dist

    import zbccl

    pg = init_pg(ctx)
    assert dist.get_backend() == "zbccl" and pg.group_name
    assert type(pg).__name__ == "ProcessGroupZbccl" and pg.comm is not None
    gloo = dist.new_group(backend="gloo")
    for async_op in modes:
        _collectives(ctx, gloo, async_op)
    _complex(ctx)
    # inside heap_scope every collective is zero-buffer: nothing staged
    before = zbccl.memory_stats()["staged_bytes"]
    with zbccl.heap_scope():
        t = torch.ones(1000) * ctx.rank
        dist.all_reduce(t)
        out = torch.empty(ctx.world_size * 1000)
        dist.all_gather_into_tensor(out, t)
        dist.reduce_scatter_tensor(torch.empty(1000), out)
        outs = list(torch.empty(ctx.world_size * 10).chunk(ctx.world_size))
        dist.all_gather(outs, t[:10])  # adjacent list outputs: one flat buffer, no copy
    assert zbccl.memory_stats()["staged_bytes"] == before
    # private tensors are staged and counted
    t = torch.ones(1000)
    dist.all_reduce(t)
    assert zbccl.memory_stats()["staged_bytes"] > before
    dist.destroy_process_group()
    assert not zbccl.is_initialized()
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_every_method_sync_and_async(world):
    assert run_world(_every_method, world, modes=(False, True) if world == 2 else (False,)) == [True] * world


def _point_to_point(ctx):
    import torch.distributed as dist

    import zbccl

    init_pg(ctx, timeout=timedelta(seconds=20))
    W, me = ctx.world_size, ctx.rank
    peer = 1 - me if W == 2 else (me + 1) % W
    prev = (me - 1) % W
    stats = zbccl.memory_stats
    # heap tensors on both ends: a real point-to-point path, nothing staged
    before = stats()["staged_bytes"]
    src = zbccl.empty(1000, dtype=torch.float32).copy_(payload(me, 1000))
    dst = zbccl.empty(1000, dtype=torch.float32)
    if me < 2:  # ranks 0 and 1 exchange with blocking calls
        if me == 0:
            dist.send(src, 1)
            dist.recv(dst, 1)
        else:
            dist.recv(dst, 0)
            dist.send(src, 0)
        assert torch.equal(dst, payload(1 - me, 1000))
    assert stats()["staged_bytes"] == before
    # isend/irecv posted in either order on both ranks, heap tensors: no deadlock
    for recv_first in (True, False):
        dst.zero_()
        ops = [lambda: dist.irecv(dst, prev), lambda: dist.isend(src, peer)]
        works = [f() for f in (ops if recv_first else ops[::-1])]
        for w in works:
            w.wait()
        assert torch.equal(dst, payload(prev, 1000))
    assert stats()["staged_bytes"] == before
    # private tensors: staged and counted; a blocking send returns before the recv (like gloo)
    t = payload(me, 300, torch.int64)
    out = torch.zeros(300, dtype=torch.int64)
    dist.send(t, peer)
    dist.recv(out, prev)
    assert torch.equal(out, payload(prev, 300, torch.int64))
    assert stats()["staged_bytes"] >= before + 300 * 8
    # tags: per (src, tag) in order, different tags in any order
    reqs = [dist.isend(payload(me, 10, salt=tag) + k, peer, tag=tag) for k in range(2) for tag in (5, 7)]
    got = {}
    for tag in (7, 5):
        for k in range(2):
            buf = torch.zeros(10)
            dist.recv(buf, prev, tag=tag)
            got[tag, k] = buf
    for w in reqs:
        w.wait()
    assert all(torch.equal(got[tag, k], payload(prev, 10, salt=tag) + k) for tag in (5, 7) for k in range(2))
    # recv from any source gives the sender's global rank
    if me == 0:
        senders = set()
        for _ in range(W - 1):
            buf = torch.zeros(4)
            r = dist.recv(buf, src=None, tag=3)
            assert torch.equal(buf, payload(r, 4))
            senders.add(r)
        assert senders == set(range(1, W))
    else:
        dist.send(payload(me, 4), 0, tag=3)
    # wait(timeout) on a receive nobody sends: ZbcclTimeoutError naming the peer; the receive is cancelled
    work = dist.irecv(torch.zeros(2), prev, tag=99)
    assert not work.is_completed()
    with pytest.raises(zbccl.ZbcclTimeoutError, match=f"rank\\(s\\) \\[{dist.get_group_rank(dist.group.WORLD, prev)}\\]"):
        work.wait(timeout=timedelta(seconds=0.3))
    assert work.is_completed() and isinstance(work.exception(), zbccl.ZbcclTimeoutError)
    # batch_isend_irecv around a ring
    recv_buf = zbccl.empty(64, dtype=torch.float64)
    ops = [dist.P2POp(dist.isend, zbccl.empty(64, dtype=torch.float64).copy_(payload(me, 64, torch.float64)), peer),
           dist.P2POp(dist.irecv, recv_buf, prev)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    assert torch.equal(recv_buf, payload(prev, 64, torch.float64))
    # a size mismatch fails on both ends, with the ZbcclError subclass
    if me in (0, 1) and W >= 2:
        other = 1 - me
        if me == 0:
            work = dist.isend(zbccl.empty(8), other, tag=9)
            with pytest.raises(zbccl.ZbcclInvalidUsageError, match="size"):
                work.wait()
            assert work.is_completed() and not work.is_success()
        else:
            with pytest.raises(zbccl.ZbcclInvalidUsageError, match="size mismatch"):
                dist.recv(torch.zeros(9), 0, tag=9)
    dist.barrier()
    dist.destroy_process_group()
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_send_recv(world):
    assert run_world(_point_to_point, world) == [True] * world
