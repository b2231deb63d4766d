"""The routed transport: shm within a host, mooncake between hosts, chosen by the topology.

Two "hosts" of two ranks each on one machine, made by ``ZBCCL_HOST_ID`` (the same network namespace,
so shm works within a host and Mooncake runs over loopback between them): no root needed.
Skips without Mooncake.
"""

from __future__ import annotations

import json
import os
import uuid

import pytest
import torch

from tests.spawn import run_world
from zbccl.bootstrap.store import StoreBootstrap
from zbccl.bootstrap.topology import HostInfo, Topology, local_host_info
from zbccl.heap import transports

from .world import DATA, line, payload

N = 256


@pytest.fixture(autouse=True)
def _needs_mooncake():
    from zbccl.heap.transports.mooncake import missing_reason

    reason = missing_reason()
    if reason:
        pytest.skip(reason)


def _open_routed(ctx):
    """``(transport, bootstrap, topology)``: the transport ``select`` picks for 2 hosts x 2 ranks, established."""
    boot = StoreBootstrap(ctx.store(), ctx.rank, ctx.world_size, prefix="routed")
    me, W = ctx.rank, ctx.world_size
    hello = {"host": local_host_info().to_dict(), "job": uuid.uuid4().hex[:12]}
    got = [json.loads(b) for b in boot.all_gather(json.dumps(hello).encode(), timeout=60, tag="hello")]
    topo = Topology(me, tuple(HostInfo.from_dict(g["host"]) for g in got))
    assert topo.hosts == ((0, 1), (2, 3))
    cls = transports.select(topo, "cpu")
    assert cls.name == "routed", cls
    t = cls(device="cpu")
    t.establish(boot, topo, data_bytes=[DATA] * W, reserve_bytes=[2 * DATA] * W, job_id=got[0]["job"], timeout=60)
    t.topology = topo
    return t, boot


def _routed(ctx, *, fake_hosts: bool = True):
    """2 hosts x 2 ranks: hosts made by ``ZBCCL_HOST_ID`` (``fake_hosts``) or real (namespace hosts)."""
    if fake_hosts:
        os.environ["ZBCCL_HOST_ID"] = f"fake-host-{ctx.rank // 2}"
    t, boot = _open_routed(ctx)
    topo, me, W = t.topology, ctx.rank, ctx.world_size
    local, remote = [r for r in topo.local_ranks if r != me], [r for r in range(W) if not topo.is_local(r)]
    try:
        assert all(t.viewable(p) for p in local) and not any(t.viewable(p) for p in remote)
        assert all(t.reachable(p) for p in range(W))
        # push into every peer (shm or mooncake), then a signal into its pad; wait on this rank's own words
        for p in range(W):
            if p != me:
                t.put(p, 8 * N * me, payload(me, N, 1))
                t.signal(p, line(me), 1)
        t.wait_until([(me, line(p)) for p in range(W) if p != me], 1, timeout=60, op="push")
        for p in range(W):
            if p != me:
                assert torch.equal(t.view(me, 8 * N * p, (N,), torch.int64), payload(p, N, 1)), p
        # pull: one wait over local and remote words at once, then read every peer's data
        t.view(me, 8 * N * (W + 1), (N,), torch.int64).copy_(payload(me, N, 2))
        t.signal(me, line(W), 1)
        t.wait_until([(p, line(W)) for p in range(W) if p != me], 1, timeout=60, op="pull")
        for p in range(W):
            if p != me:
                got_p = torch.empty(N, dtype=torch.int64)
                t.get_into(p, 8 * N * (W + 1), got_p)
                assert torch.equal(got_p, payload(p, N, 2)), p
        # fetch_add on rank 0's word from its host (shm atomics) and the other (its atomic server): exact
        for _ in range(5):
            t.fetch_add(0, line(W + 1), me + 1)
        t.signal(me, line(W + 2), 1)
        t.wait_until([(p, line(W + 2)) for p in range(W)], 1, timeout=60, op="fetch_add")
        assert t.load(0, line(W + 1)) == 5 * W * (W + 1) // 2
        # growth of rank 3: its local peer (shm) and a remote rank (mooncake) write into the new range
        if me == 3:
            t.grow(2 * DATA)
            t.signal(3, line(W + 3), 1)
        else:
            t.wait_until([(3, line(W + 3))], 1, timeout=60, op="growth")
            assert t.size(3) == 2 * DATA
            if me in (0, 2):
                t.put(3, DATA + 8 * N * me, payload(me, N, 3))
                t.signal(3, line(W + 4 + me), 1)
        if me == 3:
            t.wait_until([(3, line(W + 4)), (3, line(W + 6))], 1, timeout=60, op="growth")
            for p in (0, 2):
                assert torch.equal(t.view(3, DATA + 8 * N * p, (N,), torch.int64), payload(p, N, 3)), p
        boot.barrier(timeout=60)
        return t.describe()["remote"]["transport"]
    finally:
        t.close(unmap=False)


def test_routed_shm_within_a_host_mooncake_between():
    assert run_world(_routed, 4, timeout=240) == ["tcp"] * 4


def _init_across_hosts(ctx, *, cookie: str):
    """zbccl.init over two hosts (by ZBCCL_HOST_ID): the routed transport; the job cookie authenticates the store."""
    from zbccl.errors import ZbcclInvalidUsageError

    os.environ["ZBCCL_HOST_ID"] = f"fake-host-{ctx.rank}"
    if cookie:
        os.environ["ZBCCL_JOB_COOKIE"] = cookie
    import zbccl

    comm = ctx.init(heap_size=1 << 20)
    try:
        assert type(comm._ctx.heap.transport).__name__ == "RoutedTransport"
        assert not comm._ctx.heap.reachable(1 - ctx.rank)  # not mapped: the ops treat it as out of reach
        comm.barrier()
        sub = comm.new_group([0, 1])  # a group spanning the hosts: made, and its barrier works
        sub.barrier()
        if cookie:
            return comm.all_gather_object({"rank": ctx.rank})
        with pytest.raises(ZbcclInvalidUsageError, match="ZBCCL_JOB_COOKIE"):
            comm.all_gather_object(ctx.rank)
        return "refused"
    finally:
        zbccl.finalize()


def test_init_across_hosts_with_and_without_the_job_cookie():
    assert run_world(_init_across_hosts, 2, cookie="k" * 24, timeout=120) == [[{"rank": 0}, {"rank": 1}]] * 2
    assert run_world(_init_across_hosts, 2, cookie="", timeout=120) == ["refused"] * 2
