"""The mooncake transport's own behaviour beyond the conformance suite: ports, the protocol it got,
the job cookie, and refused remote views. Skips without Mooncake."""

from __future__ import annotations

import socket

import pytest
import torch

from tests.spawn import run_world
from zbccl.errors import ZbcclInvalidUsageError, ZbcclRemoteError

from .world import line, open_transport, payload


@pytest.fixture(autouse=True)
def _needs_mooncake():
    from zbccl.heap.transports.mooncake import missing_reason

    reason = missing_reason()
    if reason:
        pytest.skip(reason)


def _free_port() -> int:
    """A port free now below the ephemeral range (Mooncake ignores a range from 32768 up, as observed)."""
    import secrets

    for _ in range(100):
        port = 20000 + secrets.randbelow(12000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError("no free port in 20000-32000")


def _engine(ctx, ports, protocol):
    import os

    from zbccl.heap.transports.mooncake.engine import MooncakeEngine

    if ports:
        os.environ["ZBCCL_MOONCAKE_PORTS"] = ports
    e = MooncakeEngine("127.0.0.1", protocol=protocol)
    return e.rpc_port, e.transport, e.session_id


def test_handshake_port_comes_from_the_range():
    # (Mooncake takes its TCP data port from the same range: a range of one port cannot work)
    lo = _free_port()
    port, transport, sid = run_world(_engine, 1, ports=f"{lo}-{lo + 64}", protocol="tcp", timeout=60)[0]
    assert lo <= port <= lo + 64 and sid == f"127.0.0.1:{port}" and transport == "tcp"


def test_rdma_without_an_hca_reports_the_tcp_it_got():
    _, transport, _ = run_world(_engine, 1, ports="", protocol="rdma", timeout=60)[0]
    assert transport == "tcp"  # no HCA here: Mooncake fell back silently, and the transport says so


def test_bad_port_range_is_a_clear_error(monkeypatch):
    from zbccl import env

    monkeypatch.setenv("ZBCCL_MOONCAKE_PORTS", "80-90")
    with pytest.raises(ZbcclInvalidUsageError, match="ZBCCL_MOONCAKE_PORTS.*expected a port range"):
        env.MOONCAKE_PORTS.get()


def _cookie(ctx, cookies):
    import os

    os.environ["ZBCCL_JOB_COOKIE"] = cookies[ctx.rank]
    try:
        t, boot = open_transport(ctx, "mooncake")
    except ZbcclRemoteError as exc:
        return {"error": str(exc), "ranks": list(exc.ranks)}
    try:
        secret = t.job_secret("job", ctx.world_size)
        # a remote view is refused, saying what to use instead; this rank's own memory views fine
        peer = 1 - ctx.rank
        with pytest.raises(ZbcclInvalidUsageError, match="impossible.*get/get_into.*put"):
            t.view(peer, 0, (4,), torch.int64)
        with pytest.raises(ZbcclInvalidUsageError, match="impossible"):
            t.native().data_addr(peer, 0, 8)
        t.view(ctx.rank, 0, (4,), torch.int64).copy_(payload(ctx.rank, 4))
        t.signal(ctx.rank, line(0), 1)
        t.wait_until([(peer, line(0))], 1, timeout=60)
        assert torch.equal(torch.frombuffer(bytearray(t.get(peer, 0, 32)), dtype=torch.int64), payload(peer, 4))
        boot.barrier(timeout=60)
        return {"secret": secret is not None}
    finally:
        t.close(unmap=False)


def test_the_job_cookie_seals_the_records_and_gives_the_job_secret():
    same = ["c" * 20, "c" * 20]
    assert run_world(_cookie, 2, cookies=same, timeout=120) == [{"secret": True}] * 2


def test_different_cookies_fail_on_every_rank():
    out = run_world(_cookie, 2, cookies=["a" * 20, "b" * 20], timeout=120)
    for r, got in enumerate(out):
        assert "not sealed with this job's cookie" in got["error"], got
        assert got["ranks"] == [1 - r], got


def _staged(ctx):
    """Every transfer through the registered bounce buffer (RDMA's path), across its 4 MiB chunks."""
    n = (9 << 20) // 8
    t, boot = open_transport(ctx, "mooncake", data=12 << 20)
    me, peer = ctx.rank, 1 - ctx.rank
    try:
        t.engine.stage_all = True
        t.put(peer, 8 * 16, payload(me, n, 4))
        t.signal(peer, line(0), 1)
        t.wait_until([(me, line(0))], 1, timeout=60)
        assert torch.equal(t.view(me, 8 * 16, (n,), torch.int64), payload(peer, n, 4))
        back = torch.empty(n, dtype=torch.int64)
        t.get_into(peer, 8 * 16, back)
        assert torch.equal(back, payload(me, n, 4))
        boot.barrier(timeout=60)
        return "ok"
    finally:
        t.close(unmap=False)


def test_staged_transfers_as_rdma_needs_them():
    assert run_world(_staged, 2, timeout=120) == ["ok"] * 2


def test_collectives_through_the_verbs_on_one_host():
    # The same exchange as between namespace hosts (test_hosts.py), over loopback: no root needed.
    from .test_hosts import _collectives

    assert run_world(_collectives, 2, timeout=180) == [24, 24]
    assert run_world(_collectives, 3, rounds=6, timeout=180) == [12, 12, 12]


def _traffic(ctx):
    """Rank 0 writes 3 KiB and reads 1 KiB of rank 1's heap: its engine counts exactly those bytes (plus
    the 8-byte words of signals and the liveness monitor's reads, which are counted too)."""
    t, boot = open_transport(ctx, "mooncake")
    try:
        boot.barrier(timeout=60)
        before = t.traffic()
        if ctx.rank == 0:
            t.put(1, 0, payload(0, 384, 1))  # 3 KiB
            got = torch.empty(128, dtype=torch.int64)
            t.get_into(1, 0, got)  # 1 KiB
            assert torch.equal(got, payload(0, 384, 1)[:128])
        after = t.traffic()
        boot.barrier(timeout=60)
        return {k: after[k] - before[k] for k in after}
    finally:
        t.close(unmap=False)


def test_traffic_counts_the_bytes_the_verbs_moved():
    out = run_world(_traffic, 2, timeout=120)
    # the liveness monitor reads 8-byte words meanwhile: at most a few of them
    assert 3072 <= out[0]["written"] <= 3072 + 64 and 1024 <= out[0]["read"] <= 1024 + 64, out[0]
    assert out[0]["transfers"] >= 2
    assert (out[0]["data_put"], out[0]["data_got"]) == (3072, 1024), out[0]  # the data alone, exactly
    assert (out[1]["data_put"], out[1]["data_got"]) == (0, 0), out[1]
    assert out[1]["written"] <= 64 and out[1]["read"] <= 64, out[1]
