"""Resources (issue 24): a tight descriptor limit at init and after it, shared memory or the cgroup
running out when the heap must grow mid-run, and two jobs soaking at once on the host. Each case
gets a clear error on every rank (or none), loses nothing already in the heap, and the group (or a
fresh init) runs on. Covered elsewhere, not repeated: a heap larger than /dev/shm at init
(test_failures.py::test_capacity_check_fails_clearly_on_every_rank), the cgroup limit read at init
(tests/unit/test_lifecycle_config.py), growth beyond ZBCCL_HEAP_MAX (tests/unit/test_heap_growth.py),
scratch that cannot be mapped (test_op_errors.py::test_scratch_oom_fails_on_every_rank)."""

from __future__ import annotations

import os
import resource
import threading

import pytest
import torch

from tests.spawn import run_world

MiB = 1 << 20


def _payload(rank: int, n: int) -> torch.Tensor:
    return ((torch.arange(n) * 7 + rank * 13) % 61 - 30).to(torch.float32) / 4


def _checked_all_reduce(zbccl, comm, n: int = 1000) -> bool:
    t = zbccl.empty(n)
    t.copy_(_payload(comm.rank, n))
    zbccl.all_reduce(t, comm=comm)
    return torch.equal(t, sum((_payload(r, n) for r in range(comm.world_size)), torch.zeros(n)))


def _fds_tight_at_init(ctx):
    import zbccl

    store = ctx.store()  # the store's socket first: the limit leaves room for nothing else
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if ctx.rank == 1:
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 1, hard))
    try:
        with pytest.raises(zbccl.ZbcclError) as info:
            zbccl.init(store=store, rank=ctx.rank, world_size=2, heap_size=4 * MiB, timeout=120)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert not zbccl.is_initialized()
    msg = str(info.value)
    if ctx.rank == 1:
        assert isinstance(info.value, zbccl.ZbcclSystemError), msg
        assert "out of file descriptors" in msg and "ulimit -n" in msg, msg
    else:
        assert 1 in info.value.ranks or "rank 1" in msg, msg
    comm = ctx.init(heap_size=4 * MiB)  # with the limit back, the same ranks start
    ok = _checked_all_reduce(zbccl, comm)
    zbccl.finalize()
    return ok, msg


def test_a_descriptor_limit_at_init_fails_on_every_rank_at_once():
    # init's timeout is 120 s and the world's 90 s: a pass proves nobody waited the timeout out
    out = run_world(_fds_tight_at_init, 2, timeout=90)
    assert all(ok for ok, _ in out), out


def _fds_tight_after_init(ctx):
    """Once init is done, nothing the job does next needs a new descriptor on that rank: groups,
    heap growth (peers map the grown range through the descriptor they hold), EP, p2p."""
    import zbccl
    import zbccl.ep as deep_ep
    from zbccl.adapters.p2p import PointToPoint

    comm = ctx.init(heap_size=4 * MiB, heap_max="1G")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if ctx.rank == 1:
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")), hard))
    try:
        g = comm.new_group([0, 1])
        big = zbccl.empty(4 * MiB)  # 16 MiB: past the 4 MiB heap, it grows
        big.copy_(_payload(ctx.rank, big.numel()))
        zbccl.all_reduce(big, comm=g)
        assert torch.equal(big, _payload(0, big.numel()) + _payload(1, big.numel()))
        assert zbccl.memory_stats()["grow_count"] >= 1
        g.destroy()
        buffer = deep_ep.Buffer(comm, explicitly_destroy=True)
        buffer.destroy()
        pp = PointToPoint(comm)
        got = torch.empty(64)
        if ctx.rank == 0:
            pp.send([_payload(0, 64)], 1, 0).wait(60)
        else:
            pp.recv([got], 0, 0).wait(60)
            assert torch.equal(got, _payload(0, 64))
        pp.close()
        ok = _checked_all_reduce(zbccl, comm)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    del big
    zbccl.finalize()
    return ok


def test_a_descriptor_limit_after_init_costs_nothing():
    assert run_world(_fds_tight_after_init, 2, timeout=120) == [True, True]


def _cannot_grow(ctx, limit):
    import zbccl
    import zbccl.heap.capacity as capacity

    comm = ctx.init(heap_size=4 * MiB, heap_max="1G")
    keep = zbccl.empty(1000)
    keep.copy_(_payload(ctx.rank, 1000))
    zbccl.all_reduce(zbccl.zeros(16))
    if ctx.rank == 1:  # mid-run, /dev/shm (or the cgroup) fills up on rank 1's side
        real = capacity.shm_capacity
        capacity.shm_capacity = lambda *a, **k: dict(real(*a, **k), **{limit: MiB})
    where = {"dev_shm": "free in /dev/shm", "cgroup": "left in the cgroup"}[limit]
    # a private tensor is staged through the heap: rank 1's heap must grow for it and cannot
    with pytest.raises(zbccl.ZbcclOutOfMemoryError) as info:
        zbccl.all_reduce(torch.ones(2 * MiB))
    msg = str(info.value)
    assert info.value.ranks == (1,) and "rank 1 ran out of memory" in msg and where in msg, msg
    if ctx.rank == 1:
        with pytest.raises(zbccl.ZbcclOutOfMemoryError, match="growth refused: grow: not enough shared memory"):
            zbccl.empty(4 * MiB)
        assert zbccl.memory_stats()["heap_bytes"] == 4 * MiB
    assert torch.equal(keep, _payload(ctx.rank, 1000)), "a heap tensor changed"
    ok = _checked_all_reduce(zbccl, comm)  # the group is still in step, in the heap it has
    del keep
    zbccl.finalize()
    return ok


@pytest.mark.parametrize("limit", ["dev_shm", "cgroup"])
def test_a_heap_that_cannot_grow_mid_run_fails_on_every_rank_and_loses_nothing(limit):
    assert run_world(_cannot_grow, 2, limit=limit, timeout=120) == [True, True]


def _soak(ctx, seed):
    from zbccl.tools.soak import soak_rank

    return soak_rank(rank=ctx.rank, world_size=2, store=ctx.store(), seed=seed, seconds=None, ops=150,
                     check_every=25, report_every=1e9, heap_size=16 * MiB, ep=True, to_stderr=True)


def test_two_jobs_soaking_at_once_stay_apart_and_exact():
    out: dict[int, list] = {}
    errors = []

    def job(seed):
        try:
            out[seed] = run_world(_soak, 2, seed=seed, timeout=300)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=job, args=(s,)) for s in (11, 12)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    for rows in out.values():
        for r in rows:
            assert r["errors"] == [] and r["wrong"] == [] and r["ops"] == 150, (r["errors"], r["wrong"])
    assert {r["job"] for r in out[11]}.isdisjoint({r["job"] for r in out[12]}), "two jobs share an id"
