"""The ``zbccl`` backend's sub-groups, fallbacks, errors and rendezvous forms."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from tests.multiproc.test_process_group import _collectives, init_pg, payload
from tests.spawn import run_world


def _sub_groups(ctx):
    import torch.distributed as dist

    import zbccl

    init_pg(ctx)
    me = ctx.rank
    sub = dist.new_group([0, 2])
    gloo = dist.new_group([0, 2], backend="gloo")
    if me in (0, 2):
        assert sub.comm is not None and sub.comm.ranks == (0, 2) and sub.comm.slot != 0
        for async_op in (False, True):
            _collectives(ctx, gloo, async_op, group=sub)
        # send/recv inside the sub-group: peers are global ranks in torch's API
        t = zbccl.empty(16).copy_(payload(me, 16))
        out = torch.zeros(16)
        reqs = [dist.isend(t, 2 - me, group=sub), dist.irecv(out, 2 - me, group=sub)]
        for w in reqs:
            w.wait()
        assert torch.equal(out, payload(2 - me, 16))
        slot = sub.comm.slot
    else:
        assert sub == dist.GroupMember.NON_GROUP_MEMBER
    # destroying a group returns its zbccl slot: the next group reuses it
    dist.destroy_process_group(sub)
    again = dist.new_group([0, 2])
    if me in (0, 2):
        assert again.comm.slot == slot
        t = torch.ones(3) * me
        dist.all_reduce(t, group=again)
        assert torch.equal(t, torch.full((3,), 2.0))
    # new_subgroups_by_enumeration: every rank lands in one group, one of them a single rank
    cur, _ = dist.new_subgroups_by_enumeration([[0, 1], [2]])
    t = torch.ones(2) * (me + 1)
    dist.all_reduce(t, group=cur)
    assert torch.equal(t, torch.full((2,), 3.0))  # 1 + 2 in [0, 1]; 3 alone in [2]
    dist.barrier(group=cur)
    cur, _ = dist.new_subgroups(group_size=1)  # single-rank zbccl groups
    t = torch.ones(2) * me
    dist.all_reduce(t, group=cur)
    assert torch.equal(t, torch.ones(2) * me)
    dist.destroy_process_group()
    assert not zbccl.is_initialized()
    return True


def test_sub_groups_three_ranks():
    assert run_world(_sub_groups, 3) == [True] * 3


class _Spy:
    """Stands in for a group's inner gloo group and records which of its methods ran."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, set()

    def __getattr__(self, name):
        self.calls.add(name)
        return getattr(self.inner, name)


def _fallback_ops(ctx):  # noqa: C901 - one world, many gloo-routed cases
    import torch.distributed as dist

    pg = init_pg(ctx)
    assert pg.comm is not None
    pg._gloo = spy = _Spy(pg._gloo)
    me, W = ctx.rank, ctx.world_size

    def done(work):  # every routed op's Work behaves like zbccl's: complete, with a future
        assert work.is_completed() and work.exception() is None
        work.get_future().wait()

    def nc(rank, salt=0):  # a non-contiguous [4, 3] view: gloo alone would read the wrong elements
        return payload(rank, 24, salt=salt).view(4, 6)[:, ::2]

    outs = [torch.zeros(4) for _ in range(W)]
    done(dist.all_gather(outs, payload(me, 4), async_op=True))
    assert all(torch.equal(outs[r], payload(r, 4)) for r in range(W)) and "allgather" in spy.calls
    outs = [torch.zeros(2 + r) for r in range(W)]  # unequal sizes (gloo alone refuses them)
    dist.all_gather(outs, payload(me, 2 + me))
    assert all(torch.equal(outs[r], payload(r, 2 + r)) for r in range(W))
    outs = [torch.zeros(3, 4).t() for _ in range(W)]
    dist.all_gather(outs, nc(me))
    assert all(torch.equal(outs[r], nc(r)) for r in range(W))
    out = torch.zeros(W, 4)  # stacked output, then a 0-dim input
    done(dist.all_gather_into_tensor(out, payload(me, 4), async_op=True))
    assert torch.equal(out, torch.stack([payload(r, 4) for r in range(W)]))
    out = torch.zeros(W)
    dist.all_gather_into_tensor(out, payload(me, 1).reshape(()))
    assert torch.equal(out, torch.cat([payload(r, 1) for r in range(W)]))
    outs = [torch.zeros(W * 4), torch.zeros(W * 2)]
    with dist._coalescing_manager(async_ops=True) as cm:
        for o in outs:
            dist.all_gather_into_tensor(o, payload(me, o.numel() // W))
    cm.wait()
    assert torch.equal(outs[1], torch.cat([payload(r, 2) for r in range(W)]))
    outs = [torch.zeros(1 + r + 2 * me) for r in range(W)]  # uneven all_to_all list form
    done(dist.all_to_all(outs, [payload(me, 1 + me + 2 * q, salt=q) for q in range(W)], async_op=True))
    assert all(torch.equal(outs[r], payload(r, 1 + r + 2 * me, salt=me)) for r in range(W))
    o = torch.zeros(W * 2)
    done(dist.all_to_all_single(o, payload(me, W * 2), async_op=True))
    assert "alltoall_base" in spy.calls
    out = torch.zeros(3)  # gloo's own reduce_scatter Work has no future
    done(dist.reduce_scatter_tensor(out, payload(me, 3 * W), async_op=True))
    assert torch.equal(out, sum(payload(r, 3 * W)[3 * me:3 * me + 3] for r in range(W)))
    out = torch.zeros(3, 4).t()
    done(dist.reduce_scatter(out, [nc(me, salt=q) for q in range(W)], async_op=True))
    assert torch.equal(out, sum(nc(r, salt=me) for r in range(W)))
    t = nc(me)
    dist.broadcast(t, src=W - 1)
    assert torch.equal(t, nc(W - 1))
    t = nc(me).long()  # a bitwise op runs on gloo whatever the list says
    done(dist.all_reduce(t, op=dist.ReduceOp.BXOR, async_op=True))
    want = nc(0).long()
    for r in range(1, W):
        want ^= nc(r).long()
    assert torch.equal(t, want) and "allreduce" in spy.calls
    r = torch.zeros(3)  # gloo's own p2p Works have no future
    works = [dist.irecv(r, (me - 1) % W, tag=4), dist.isend(payload(me, 3), (me + 1) % W, tag=4)]
    for w in works:
        w.get_future().wait()
    assert torch.equal(r, payload((me - 1) % W, 3)) and "recv" in spy.calls
    spy.calls.clear()
    t = torch.ones(3)
    dist.all_reduce(t)  # not listed: zbccl runs it
    assert torch.equal(t, torch.full((3,), float(W))) and not spy.calls
    pg._gloo = spy.inner
    dist.destroy_process_group()
    return True


def test_fallback_ops_run_on_gloo():
    env = {"ZBCCL_FALLBACK_OPS": "allgather, alltoall, reduce_scatter, broadcast, send"}
    assert run_world(_fallback_ops, 3, env=env) == [True] * 3


def _bad_fallback_name(ctx):
    import zbccl

    with pytest.raises(zbccl.ZbcclInvalidUsageError, match="_reduce_scatter_bass"):
        init_pg(ctx)
    return True


def test_unknown_fallback_op_is_an_error():
    assert run_world(_bad_fallback_name, 2, env={"ZBCCL_FALLBACK_OPS": "allgather,_reduce_scatter_bass"}) == [True] * 2


def _init_fallback(ctx, strict: bool):
    import warnings

    import torch.distributed as dist

    import zbccl

    if strict:
        with pytest.raises(zbccl.ZbcclError):
            init_pg(ctx)
        return True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pg = init_pg(ctx)
    msgs = [str(w.message) for w in caught if "gloo" in str(w.message)]
    assert len(msgs) == 1 and "could not start" in msgs[0], msgs
    assert pg.comm is None and pg.fallback_reason and not zbccl.is_initialized()
    t = payload(ctx.rank, 5)
    dist.all_reduce(t)
    assert torch.equal(t, sum(payload(r, 5) for r in range(ctx.world_size)))
    out = torch.zeros(2)
    dist.send(payload(ctx.rank, 2), 1 - ctx.rank) if ctx.rank == 0 else dist.recv(out, 0)
    dist.destroy_process_group()
    return True


@pytest.mark.parametrize("strict", [False, True])
def test_init_fallback_when_zbccl_cannot_start(strict):
    env = {"ZBCCL_HEAP_SIZE": "64T"}  # more than any /dev/shm: the capacity check refuses on every rank
    if strict:
        env["ZBCCL_STRICT"] = "1"
    assert run_world(_init_fallback, 2, env=env, strict=strict) == [True, True]


def _adopt_and_sub_fallback(ctx):
    import warnings

    import torch.distributed as dist

    import zbccl

    comm = ctx.init()  # zbccl started first: the default group adopts it and leaves it running
    for _ in range(2):  # twice over the same communicator: the second group's mailboxes are its own
        pg = init_pg(ctx)
        assert pg.comm is comm
        t = torch.ones(4)
        dist.all_reduce(t)
        assert torch.equal(t, torch.full((4,), 2.0))
        src, out = zbccl.empty(6).copy_(payload(ctx.rank, 6)), zbccl.empty(6)
        for w in [dist.isend(src, 1 - ctx.rank), dist.irecv(out, 1 - ctx.rank)]:
            w.wait()
        assert torch.equal(out, payload(1 - ctx.rank, 6))
        del src, out
        dist.destroy_process_group()
        assert zbccl.is_initialized()
    zbccl.finalize()
    # a zbccl sub-group of a gloo world: zbccl is not initialized, so the group runs on gloo
    dist.init_process_group("gloo", store=ctx.store(), rank=ctx.rank, world_size=ctx.world_size)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sub = dist.new_group([0, 1], backend="zbccl")
    assert sub.comm is None and "not initialized" in sub.fallback_reason
    assert any("runs every op" in str(w.message) for w in caught)
    t = torch.ones(4)
    dist.all_reduce(t, group=sub)
    assert torch.equal(t, torch.full((4,), 2.0))
    dist.destroy_process_group()
    for _ in range(2):  # re-initialised zbccl worlds on the same store start fresh
        pg = init_pg(ctx)
        assert pg.comm is not None
        t = torch.ones(4)
        dist.all_reduce(t)
        assert torch.equal(t, torch.full((4,), 2.0))
        dist.destroy_process_group()
    return True


def test_adopts_zbccl_init_and_falls_back_for_a_sub_group_of_gloo():
    assert run_world(_adopt_and_sub_fallback, 2) == [True, True]


def _errors(ctx):
    import torch.distributed as dist

    import zbccl

    init_pg(ctx)
    me, W = ctx.rank, ctx.world_size
    # splits that disagree across ranks: every rank gets the ZbcclError subclass
    ins = [2, 2] if me == 0 else [1, 3]
    with pytest.raises(zbccl.ZbcclInvalidUsageError, match="split sizes disagree"):
        dist.all_to_all_single(torch.zeros(4), torch.zeros(4), [2, 2], ins)
    work = dist.all_to_all_single(torch.zeros(4), torch.zeros(4), [2, 2], ins, async_op=True)
    assert work.is_completed() and not work.is_success()
    assert isinstance(work.exception(), zbccl.ZbcclInvalidUsageError)
    with pytest.raises(zbccl.ZbcclInvalidUsageError):
        work.wait()
    with pytest.raises(zbccl.ZbcclInvalidUsageError):
        work.get_future().wait()
    with pytest.raises(zbccl.ZbcclInvalidUsageError, match="PREMUL_SUM"):
        dist.all_reduce(torch.ones(2), op=dist._make_nccl_premul_sum(2.0))
    # the group still works after failing together
    t = torch.ones(2)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((2,), float(W)))
    # a dead peer is reported within seconds, as ZbcclRemoteError naming it
    dist.barrier()
    if me == 1:
        os.kill(os.getpid(), 9)
    with pytest.raises(zbccl.ZbcclRemoteError) as info:
        dist.all_reduce(torch.ones(1000))
    assert 1 in info.value.ranks
    with pytest.raises(zbccl.ZbcclRemoteError) as info:  # so is a receive from it
        dist.recv(torch.zeros(4), 1)
    assert info.value.ranks == (1,)
    dist.destroy_process_group()
    return True


def test_errors_reach_the_caller():
    assert run_world(_errors, 2, expect_exit={1: -9})[0] is True


def _reinit(ctx):
    """destroy + init again on the same store: torch reuses group names for other members."""
    import torch.distributed as dist

    for it in range(2):
        init_pg(ctx, timeout=timedelta(seconds=20))
        subs = [[0, 2], [1, 2], [0, 1, 2]] if it == 0 else [[0, 1, 2], [1, 2], [0, 2]]
        for s, g in [(s, dist.new_group(s)) for s in subs]:
            if ctx.rank in s:
                t = torch.ones(2)
                dist.all_reduce(t, group=g)
                assert torch.equal(t, torch.full((2,), float(len(s))))
        dist.destroy_process_group()
    return True


def test_reinit_with_other_groups():
    assert run_world(_reinit, 3, timeout=60) == [True] * 3


def _rendezvous(ctx, how: str):
    import torch.distributed as dist

    import zbccl  # noqa: F401

    os.environ.update(ctx.agent_store_env())
    kw = {"rank": ctx.rank, "world_size": ctx.world_size, "timeout": timedelta(seconds=30)}
    if how == "tcp":
        dist.init_process_group("zbccl", init_method=f"tcp://{ctx.host}:{ctx.port}", **kw)
    else:
        dist.init_process_group("cpu:zbccl", init_method="env://", **kw)
    assert dist.get_backend() in ("zbccl", "cpu:zbccl")
    t = payload(ctx.rank, 7)
    dist.all_reduce(t)
    assert torch.equal(t, sum(payload(r, 7) for r in range(ctx.world_size)))
    dist.destroy_process_group()
    return True


@pytest.mark.parametrize("how", ["tcp", "env"])
def test_init_method(how):
    assert run_world(_rendezvous, 2, how=how) == [True, True]


SCRIPT = Path(__file__).with_name("pg_torchrun_script.py")


def test_under_torchrun(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2] / "src") + os.pathsep +
               os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(SCRIPT)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("zbccl torchrun ok") == 2, proc.stdout
