"""The ``zbccl`` torch.distributed backend over ranks on several hosts, against gloo in the same processes.

2 hosts x 2 ranks made by ``ZBCCL_HOST_ID`` (no root: the routed transport, shm within a host and
Mooncake between them), and once over namespace hosts (``tests/hosts.py``: nothing but a veth link between
them). Every method of ``tests/multiproc/test_process_group.py``'s sweep (sync and ``async_op``), groups
spanning hosts and within one host, send/recv between and within hosts, payloads f(rank, index). The ops
zbccl runs across hosts in this build run on zbccl (``backend.ops_across_hosts``); the others on the
group's gloo, never a hang. Skips without Mooncake (and, for namespace hosts, without root).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.hosts import HostsUnavailable, NetnsHosts, hosts_skip_reason, run_hosts
from tests.multiproc.test_process_group import _collectives, payload
from tests.spawn import run_world

COOKIE = "i21-backend-hosts-cookie-0123456789"


@pytest.fixture(autouse=True)
def _needs_mooncake():
    from zbccl.heap.transports.mooncake import missing_reason

    reason = missing_reason()
    if reason:
        pytest.skip(reason)


def _p2p(me: int, W: int, pairs: list[tuple[int, int]]) -> None:
    """send/recv (and isend/irecv) for each (src, dst) pair; the payload names the source and the pair."""
    import torch.distributed as dist

    for k, (src, dst) in enumerate(pairs):
        if me == src:
            dist.send(payload(src, 33, salt=k), dst)
            work = dist.isend(payload(src, 5, torch.int64, salt=k), dst)
            work.wait()
        elif me == dst:
            got = torch.zeros(33)
            dist.recv(got, src)
            assert torch.equal(got, payload(src, 33, salt=k)), (src, dst)
            got = torch.zeros(5, dtype=torch.int64)
            dist.irecv(got, src).wait()
            assert torch.equal(got, payload(src, 5, torch.int64, salt=k)), (src, dst)


def _backend_across_hosts(ctx, *, fake_hosts: bool = True, modes: tuple[bool, ...] = (False, True)):
    import torch.distributed as dist

    import zbccl
    from zbccl.adapters.backend import gloo_keys_across_hosts, ops_across_hosts

    if fake_hosts:
        os.environ["ZBCCL_HOST_ID"] = f"fake-host-{ctx.rank // 2}"
    os.environ["ZBCCL_JOB_COOKIE"] = COOKIE
    os.environ["ZBCCL_STRICT"] = "1"  # zbccl must start across hosts, not fall back to gloo at init
    me, W = ctx.rank, ctx.world_size
    dist.init_process_group("zbccl", store=dist.PrefixStore("pg", ctx.store()), rank=me, world_size=W)
    pg = dist.group.WORLD
    assert type(pg).__name__ == "ProcessGroupZbccl" and pg.comm is not None and not pg.comm._single_host
    assert pg.comm._ctx.heap.transport.name == "routed"
    on_gloo = sorted(gloo_keys_across_hosts(pg.comm))
    assert {"send", "recv"} <= set(on_gloo) and "barrier" not in on_gloo
    if len(ops_across_hosts()) > 1:  # the collectives across hosts are in this build: only p2p is left to gloo
        assert on_gloo == ["recv", "send"], on_gloo
    gloo = dist.new_group(backend="gloo")
    for async_op in modes:
        _collectives(ctx, gloo, async_op)
    _p2p(me, W, [(0, 2), (3, 1), (0, 1), (2, 3)])  # across hosts both ways, and within each host
    # groups: spanning hosts (ranks 1, 2) and within a host (2, 3: zbccl on shm, every op)
    across = dist.new_group([1, 2])
    within = dist.new_group([2, 3])
    gloo_across = dist.new_group([1, 2], backend="gloo")
    gloo_within = dist.new_group([2, 3], backend="gloo")
    if me in (1, 2):
        assert not across.comm._single_host
        _collectives(ctx, gloo_across, False, group=across)
    if me in (2, 3):
        assert within.comm._single_host and not gloo_keys_across_hosts(within.comm)
        _collectives(ctx, gloo_within, True, group=within)
        before = zbccl.memory_stats()["staged_bytes"]
        with zbccl.heap_scope():
            t = payload(me, 1000)
            dist.all_reduce(t, group=within)
        assert zbccl.memory_stats()["staged_bytes"] == before  # zero-buffer within the host
        assert torch.equal(t, payload(2, 1000) + payload(3, 1000))
    dist.barrier()
    dist.destroy_process_group()
    assert not zbccl.is_initialized()
    return {"on_gloo": on_gloo, "across": sorted(ops_across_hosts())}


def test_backend_2x2_by_host_id_matches_gloo():
    out = run_world(_backend_across_hosts, 4, timeout=420)
    assert all(o == out[0] for o in out), out


def test_backend_2x2_between_namespace_hosts():
    reason = hosts_skip_reason()
    if reason:
        pytest.skip(reason)
    try:
        with NetnsHosts(2) as hosts:
            out = run_hosts(_backend_across_hosts, hosts, ranks_per_host=2, timeout=420, fake_hosts=False,
                            modes=(False,))
    except HostsUnavailable as exc:
        pytest.skip(str(exc))
    assert all(o == out[0] for o in out), out
