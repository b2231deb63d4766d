"""The mooncake transport between namespace hosts (``tests/hosts.py``): 2 hosts x 1 rank, nothing shared but a link.

Each case builds its own hosts and tears them down (a failed case too). Skips, with the reason, where
Mooncake is not installed or namespaces cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.hosts import HostsUnavailable, NetnsHosts, hosts_skip_reason, run_hosts
from zbccl.errors import ZbcclRemoteError, ZbcclTimeoutError

from .world import DATA, line, open_transport, payload

N = 512


def _hosts(n: int):
    from zbccl.heap.transports.mooncake import missing_reason

    reason = missing_reason() or hosts_skip_reason()
    if reason:
        pytest.skip(reason)
    try:
        with NetnsHosts(n) as hosts:
            yield hosts
    except HostsUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture
def hosts2():
    yield from _hosts(2)


@pytest.fixture
def hosts3():
    yield from _hosts(3)


def _verbs(ctx):
    """put/get/signal/wait/fetch_add between two hosts; payloads name their source."""
    import socket

    t, boot = open_transport(ctx, "mooncake", reserve=2 * DATA)
    me, peer = ctx.rank, 1 - ctx.rank
    try:
        assert t.reachable(peer) and not t.viewable(peer) and t.viewable(me)
        # push: data into the peer, then a signal into the peer's pad; the peer waits on its own word
        t.put(peer, 8 * N * me, payload(me, N, 1))
        t.signal(peer, line(0 + me), 1)
        t.wait_until([(me, line(0 + peer))], 1, timeout=60, op="push")
        assert torch.equal(t.view(me, 8 * N * peer, (N,), torch.int64), payload(peer, N, 1))
        # pull: data here, a signal here; the peer polls this rank's word and reads the data
        t.view(me, 8 * N * 4, (N,), torch.int64).copy_(payload(me, N, 2))
        t.signal(me, line(2), 1)
        t.wait_until([(peer, line(2))], 1, timeout=60, op="pull")
        got = torch.empty(N, dtype=torch.int64)
        t.get_into(peer, 8 * N * 4, got)
        assert torch.equal(got, payload(peer, N, 2)), got[:4]
        # fetch_add on rank 0's word from both hosts: exact
        for _ in range(10):
            t.fetch_add(0, line(3), me + 1)
        t.signal(me, line(4), 1)
        t.wait_until([(peer, line(4))], 1, timeout=60, op="fetch_add")
        assert t.load(0, line(3)) == 10 * (1 + 2)
        # growth: rank 1 grows, registers the step; rank 0 writes across the old end (split per registration)
        if me == 1:
            t.grow(2 * DATA)
            t.signal(1, line(5), 1)
            t.wait_until([(1, line(6))], 1, timeout=60, op="growth")
            assert torch.equal(t.view(1, DATA - 8 * (N // 2), (N,), torch.int64), payload(0, N, 3))
        else:
            t.wait_until([(1, line(5))], 1, timeout=60, op="growth")
            assert t.size(1) == 2 * DATA
            t.put(1, DATA - 8 * (N // 2), payload(0, N, 3))
            t.signal(1, line(6), 1)
        boot.barrier(timeout=60)
        return {"host": socket.gethostname(), "transport": t.describe()["transport"]}
    finally:
        t.close(unmap=False)


def test_world_2x1_verbs_across_hosts(hosts2):
    out = run_hosts(_verbs, hosts2, timeout=180)
    assert [o["host"] for o in out] == [hosts2.ns(0), hosts2.ns(1)]
    assert all(o["transport"] == "tcp" for o in out)


def _source(rank: int, shape: tuple[int, ...], dtype: torch.dtype, it: int) -> torch.Tensor:
    """A payload that names its source: rank, index and iteration (exact in every dtype used)."""
    n = 1
    for d in shape:
        n *= d
    vals = (torch.arange(n) % 97) + 100 * rank + 7 * (it % 5)
    return vals.to(dtype).view(shape)


def _collectives(ctx, *, rounds: int = 12):
    """all_gather and all_reduce across hosts through the verbs, against plain torch, many shapes and dtypes."""
    from zbccl.ops.internode import HostExchange

    t, boot = open_transport(ctx, "mooncake", data=1 << 20)
    W, me = ctx.world_size, ctx.rank
    try:
        ex = HostExchange(t, list(range(W)), me, data_offset=0, data_bytes=1 << 20, line_base=line(16), timeout=60)
        shapes = [(1,), (7,), (256,), (33, 5), (1000,), (64, 1024)]
        dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.float64]
        for it in range(rounds):
            shape, dtype = shapes[it % len(shapes)], dtypes[it % len(dtypes)]
            mine = _source(me, shape, dtype, it)
            every = [_source(r, shape, dtype, it) for r in range(W)]
            gathered = ex.all_gather(mine)
            assert torch.equal(gathered, torch.stack(every)), (it, shape, dtype)
            want = every[0].clone()
            for x in every[1:]:
                want += x
            got = ex.all_reduce(mine)
            assert got.dtype == dtype and torch.equal(got, want), (it, shape, dtype)
        boot.barrier(timeout=60)
        return ex.seq
    finally:
        t.close(unmap=False)


def test_collectives_across_hosts_2x1(hosts2):
    assert run_hosts(_collectives, hosts2, timeout=180) == [24, 24]


def test_collectives_across_3_hosts(hosts3):
    assert run_hosts(_collectives, hosts3, rounds=6, timeout=240) == [12, 12, 12]


def test_routed_2x2_shm_within_mooncake_between_hosts(hosts2):
    # Each host's two ranks share its namespaces (shm, views, pidfds); the hosts meet over the veth link only.
    from .test_routed import _routed

    assert run_hosts(_routed, hosts2, ranks_per_host=2, timeout=240, fake_hosts=False) == ["tcp"] * 4


def _host_dies(ctx):
    """2 x 2 (routed): the test kills both ranks of host 1; both survivors name ranks 2 and 3 and their host."""
    from .test_routed import _open_routed

    t, boot = _open_routed(ctx)
    me = ctx.rank
    try:
        t.signal(me, line(0), 1)
        t.wait_until([(r, line(0)) for r in range(4) if r != me], 1, timeout=60, op="ready")
        t.signal(me, line(3), 1)  # this rank saw everyone ready
        if me == 2:
            t.wait_until([(r, line(3)) for r in range(4) if r != me], 1, timeout=60, op="go")
            ctx.store().set("hosts/kill", b"1")
        if me >= 2:
            t.wait_until([(0, line(1))], 1, timeout=60, op="victim")  # never: killed meanwhile
            return None
        t0 = time.monotonic()
        try:  # one wait over the local peer (shm) and both remote ranks (mooncake)
            t.wait_until([(r, line(2)) for r in range(4) if r != me], 1, timeout=60, op="survivor", liveness=0.2)
        except ZbcclRemoteError as exc:
            return {"ranks": list(exc.ranks), "text": str(exc), "elapsed": time.monotonic() - t0}
        return {"error": None}
    finally:
        t.close(unmap=False)


def test_killing_every_rank_of_a_host_names_them_and_the_host(hosts2):
    def director(hosts, store):
        store.wait(["hosts/kill"])
        hosts.kill_host(1)

    out = run_hosts(_host_dies, hosts2, ranks_per_host=2, timeout=240, director=director, expect_exit={1: True})
    for got in out[:2]:
        assert got["ranks"] == [2, 3] and hosts2.addr(1) in got["text"], got
        assert got["elapsed"] < 10, got


def _partition_of_3(ctx):
    """3 hosts: the test cuts host 2's link; rank 0's wait over ranks 1 and 2 names host 2 only."""
    t, boot = open_transport(ctx, "mooncake")
    me = ctx.rank
    try:
        t.signal(me, line(0), 1)
        t.wait_until([(r, line(0)) for r in range(3) if r != me], 1, timeout=60, op="ready")
        t.signal(me, line(3), 1)
        if me == 2:
            t.wait_until([(0, line(3)), (1, line(3))], 1, timeout=60, op="go")
            ctx.store().set("hosts/cut", b"1")
        if me == 0:
            t0 = time.monotonic()
            try:
                t.wait_until([(1, line(1)), (2, line(1))], 1, timeout=60, op="survivor", liveness=0.2)
                out = {"error": None}
            except ZbcclTimeoutError as exc:
                out = {"error": type(exc).__name__, "ranks": list(exc.ranks), "text": str(exc),
                       "elapsed": time.monotonic() - t0}
            t.signal(0, line(2), 1)  # rank 1 may finish
            return out
        try:
            t.wait_until([(0, line(2))], 1, timeout=60, op="bystander" if me == 1 else "victim")
            return {"error": None}
        except ZbcclTimeoutError as exc:
            return {"error": type(exc).__name__, "ranks": list(exc.ranks), "text": str(exc)}
    finally:
        t.close(unmap=False)


def test_partition_of_one_host_among_3_names_that_host_only(hosts3):
    def director(hosts, store):
        store.wait(["hosts/cut"])
        hosts.cut(2)

    out = run_hosts(_partition_of_3, hosts3, timeout=240, director=director)
    assert out[0]["error"] == "ZbcclTimeoutError" and out[0]["ranks"] == [2], out[0]
    assert hosts3.addr(2) in out[0]["text"] and hosts3.addr(1) not in out[0]["text"], out[0]["text"]
    assert out[0]["elapsed"] < 30, out[0]
    assert out[1] == {"error": None}, out[1]  # the bystander on the healthy host finishes
    assert out[2]["error"] == "ZbcclTimeoutError" and out[2]["ranks"] == [0], out[2]


def _survive(ctx, *, ask: str):
    """Rank 1 asks the test to ``ask`` (kill / cut) its host; rank 0 must be told who and where, in seconds."""
    t, boot = open_transport(ctx, "mooncake")
    try:
        if ctx.rank == 1:
            t.signal(1, line(0), 1)
            t.wait_until([(0, line(3))], 1, timeout=60, op="go")  # rank 0 saw this rank alive
            ctx.store().set(f"hosts/{ask}", b"1")
            try:
                t.wait_until([(0, line(1))], 1, timeout=60, op="victim")
            except ZbcclTimeoutError as exc:  # a cut link: rank 0 is unreachable from here too
                return {"error": type(exc).__name__, "ranks": list(exc.ranks), "text": str(exc)}
            return {"error": None}
        t.wait_until([(1, line(0))], 1, timeout=60, op="ready")
        t.signal(0, line(3), 1)
        t0 = time.monotonic()
        try:
            t.wait_until([(1, line(2))], 1, timeout=60, op="survivor", liveness=0.2)
        except (ZbcclRemoteError, ZbcclTimeoutError) as exc:
            return {"error": type(exc).__name__, "ranks": list(exc.ranks), "text": str(exc),
                    "elapsed": time.monotonic() - t0, "dead": t.dead_peers()}
        return {"error": None}
    finally:
        t.close(unmap=False)


def test_killed_host_is_named_within_seconds(hosts2):
    def director(hosts, store):
        store.wait(["hosts/kill"])
        hosts.kill_host(1)

    out = run_hosts(_survive, hosts2, timeout=180, director=director, expect_exit={1: True}, ask="kill")
    got = out[0]
    assert got["error"] == "ZbcclRemoteError" and got["ranks"] == [1], got
    assert hosts2.addr(1) in got["text"] and "died" in got["text"], got["text"]
    assert got["dead"] == [1]
    assert got["elapsed"] < 10, f"the host's death took {got['elapsed']:.1f}s to notice"


def test_cut_link_is_a_timeout_naming_the_host(hosts2):
    def director(hosts, store):
        store.wait(["hosts/cut"])
        hosts.cut(1)

    out = run_hosts(_survive, hosts2, timeout=180, director=director, ask="cut")
    got = out[0]
    assert got["error"] == "ZbcclTimeoutError" and got["ranks"] == [1], got
    assert hosts2.addr(1) in got["text"] and "unreachable" in got["text"], got["text"]
    assert got["elapsed"] < 30, f"the partition took {got['elapsed']:.1f}s to report"
    assert out[1]["error"] == "ZbcclTimeoutError" and out[1]["ranks"] == [0], out[1]
    assert hosts2.addr(0) in out[1]["text"]


# ----------------------------------------------------------------- hostile and careless cases across namespace hosts
# (the single-host suite's cases, run where a peer is reached only through Mooncake: each found a bug)
def _store_host_exits(ctx, *, addr0: str, call: str):
    """Rank 0 hosts the job's store on its host (as under torchrun) and exits; rank 1, on the other host, must be
    told at once that rank 0 is gone, by its next store wait (``call`` "object") or its next collective ("op")."""
    import os
    from datetime import timedelta

    import torch.distributed as dist

    import zbccl

    spawn = ctx.store()
    if ctx.rank == 0:
        own = dist.TCPStore(addr0, 0, 2, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
        spawn.set("hosts/store-port", str(own.port))
    else:
        own = dist.TCPStore(addr0, int(spawn.get("hosts/store-port")), 2, is_master=False,
                            timeout=timedelta(seconds=60))
    comm = zbccl.init(store=own, rank=ctx.rank, world_size=2, heap_size=8 << 20, timeout=60)
    x = torch.full((256,), float(ctx.rank + 1))
    zbccl.all_reduce(x)
    assert comm.all_gather_object(ctx.rank * 10) == [0, 10] and bool((x == 3).all())
    if ctx.rank == 0:
        spawn.get("hosts/store-ready")
        os._exit(0)  # the store goes with it
    spawn.set("hosts/store-ready", b"1")
    t0 = time.monotonic()
    try:
        for i in range(100_000):  # rank 0 may still answer the first ones
            if call == "object":
                comm.all_gather_object(i)
            else:
                zbccl.all_reduce(x)
    except ZbcclRemoteError as exc:
        got = {"ranks": list(exc.ranks), "text": str(exc), "elapsed": time.monotonic() - t0}
    else:
        got = {"ranks": None}
    zbccl.finalize()
    return got


@pytest.mark.parametrize("call", ["object", "op"])
def test_a_store_host_that_exits_is_named_as_on_one_host(hosts2, call):
    """As on one host (``tests/multiproc/test_failures.py``): a remote error naming rank 0 (and, for a store wait,
    the store; for a collective, its host) within seconds, however the survivor next meets it."""
    out = run_hosts(_store_host_exits, hosts2, timeout=120, expect_exit={0: True}, addr0=hosts2.addr(0), call=call,
                    env={"ZBCCL_JOB_COOKIE": "store-host-exits-" + "x" * 16})
    got = out[1]
    assert got["ranks"] == [0], got
    assert ("store" in got["text"]) if call == "object" else (hosts2.addr(0) in got["text"]), got["text"]
    assert "\n" not in got["text"] and "frame #" not in got["text"], got["text"]
    assert got["elapsed"] < 10, got


def _killed_in_init(ctx):
    """Rank 1 is killed in the middle of init, after the hello exchange and before the transports meet (no pidfd
    sees it from the other host, no Mooncake engine watches it yet); rank 0 must name it and its host by the
    heartbeat, long before init's timeout."""
    import os
    import signal

    import torch.distributed as dist

    import zbccl
    from zbccl.runtime import state

    if ctx.rank == 1:
        state._exchange_max = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        zbccl.init(store=dist.PrefixStore("z", ctx.store()), rank=ctx.rank, world_size=2, heap_size=8 << 20,
                   timeout=120)
    except ZbcclTimeoutError as exc:
        return {"ranks": list(exc.ranks), "text": str(exc), "elapsed": time.monotonic() - t0}
    zbccl.finalize()
    return {"ranks": None}


def test_a_rank_killed_in_init_across_hosts_is_named_by_its_heartbeat(hosts2):
    out = run_hosts(_killed_in_init, hosts2, timeout=180, expect_exit={1: True})
    got = out[0]
    assert got["ranks"] == [1], got
    assert "rank 1 on host" in got["text"] and "stopped answering" in got["text"], got["text"]
    assert got["elapsed"] < 60, f"named after {got['elapsed']:.1f}s, init's timeout is 120 s"


def test_fork_after_init_across_hosts_disowns_the_child_and_keeps_the_parent_intact(hosts2):
    """``tests/multiproc/test_fork.py``'s case at 2 x 2 namespace hosts (shm within a host, Mooncake between): the
    child's ops refuse, its exit calls nothing of the inherited engine (whose threads are not there: the call
    crashed the child), and the parents go on bit-exact."""
    from tests.multiproc.test_fork import _fork_after_init

    assert run_hosts(_fork_after_init, hosts2, ranks_per_host=2, timeout=180) == [True] * 4


def test_a_forked_child_does_not_hide_its_parents_death_across_hosts(hosts2):
    """Rank 1 forks a child that outlives it (holding every inherited descriptor, the engine's sockets too), then is
    killed: rank 0, on the other host, still names it as dead at its next op."""
    from tests.multiproc.test_fork import _parent_killed_with_a_forked_child

    out = run_hosts(_parent_killed_with_a_forked_child, hosts2, timeout=120, expect_exit={1: True})
    assert out[0] < 20, f"the death was noticed after {out[0]:.1f}s (timeout 60 s)"


_COOKIE = {"ZBCCL_JOB_COOKIE": "lifecycle-across-hosts-" + "x" * 16}  # (the store's values are sealed across hosts)


def test_threads_issuing_different_ops_across_hosts_fail_together_or_succeed(hosts2):
    """``tests/multiproc/test_lifecycle.py``'s case across hosts: a pairing of different ops is refused on both
    ranks with the same words as on one host ("disagree"), like ops are exact, and the group stays in step."""
    from tests.multiproc.test_lifecycle import N_ITERS, _different_ops_two_threads

    out = run_hosts(_different_ops_two_threads, hosts2, timeout=240, env=_COOKIE)
    for o in out:
        assert o["all_reduce"][0] + o["all_reduce"][1] == N_ITERS and o["all_gather"][0] + o["all_gather"][1] == N_ITERS
    assert out[0]["all_reduce"][1] + out[0]["all_gather"][1] == out[1]["all_reduce"][1] + out[1]["all_gather"][1]


@pytest.mark.parametrize("op", ["barrier", "all_reduce"])
def test_finalize_while_another_thread_waits_across_hosts(hosts2, op):
    """``tests/multiproc/test_lifecycle.py``'s case across hosts: the waiting thread leaves, the heap is unmapped
    (the host ops' regions are freed once the ops left: they kept it mapped), and rank 1, waiting in a store op
    on the other host, is told at once that rank 0 is gone (it waited for its timeout)."""
    from tests.multiproc.test_lifecycle import _finalize_while_waiting

    out = run_hosts(_finalize_while_waiting, hosts2, timeout=180, env=_COOKIE, op=op)
    assert out[0] < 15, out


def _store_wait_cut(ctx):
    """Rank 1 waits in a store op for rank 0, whose host the test then cuts off: a timeout naming the host, at the
    transport's stall bound, not at the op's own timeout (rank 0, in an op, names rank 1's host the same way).
    Then finalize: it does not wait for the liveness monitor, stuck in a probe of the other host."""
    import zbccl

    comm = ctx.init(heap_size=8 << 20, timeout=40)
    zbccl.all_reduce(torch.ones(16))  # the mooncake monitor knows rank 0's host answers
    store = ctx.store()
    t0 = time.monotonic()
    try:
        if ctx.rank == 0:  # cut off: its own op (never met by rank 1) names the other host the same way
            store.set("hosts/cut", b"1")
            zbccl.all_reduce(torch.ones(16))
        else:
            comm.all_gather_object(1)
        got = {"error": None}
    except ZbcclTimeoutError as exc:
        got = {"ranks": list(exc.ranks), "text": str(exc), "elapsed": time.monotonic() - t0}
    t1 = time.monotonic()
    zbccl.finalize()
    got["fin"] = time.monotonic() - t1
    return got


def test_a_store_wait_names_a_cut_off_host_at_the_stall_bound(hosts2):
    def director(hosts, store):
        store.wait(["hosts/cut"])
        hosts.cut(0)

    out = run_hosts(_store_wait_cut, hosts2, timeout=120, env=_COOKIE, director=director)
    for me, got in enumerate(out):
        other = 1 - me
        assert got.get("ranks") == [other] and "unreachable" in got["text"] and hosts2.addr(other) in got["text"], got
        assert got["elapsed"] < 20, got
        assert got["fin"] < 10, got  # finalize does not wait for the monitor's probe of the cut-off host (15 s)


def _sigint_handler(ctx) -> str:
    import signal

    return "default" if signal.getsignal(signal.SIGINT) is signal.default_int_handler else str(signal.getsignal(
        signal.SIGINT))


def test_the_ranks_of_namespace_hosts_get_ctrl_c_as_a_launchers_ranks_do(hosts2):
    """A host's ranks are background jobs of its shell, which start with SIGINT ignored: run_hosts gives them
    Python's handler back, so that a Ctrl-C case (KeyboardInterrupt mid-op) can run across namespace hosts."""
    assert run_hosts(_sigint_handler, hosts2, timeout=60) == ["default", "default"]


def test_a_subgroups_errors_across_hosts_name_group_ranks(hosts3):
    """``tests/multiproc/test_failures.py``'s case over 3 namespace hosts: the death of global rank 2, seen by a
    failed write or read of the sub-communicator [1, 2], names rank 1 of that communicator (it named rank 2)."""
    from tests.multiproc.test_failures import _subgroup_peer_killed

    assert run_hosts(_subgroup_peer_killed, hosts3, timeout=120, expect_exit={2: True})[1] is True


def _local_phase_fails(ctx):
    """2 x 2, a hierarchical all_reduce: rank 3 fails inside the phase among its host's ranks (its reduce_scatter
    within host 1); rank 2, waiting there, must be told in the all_reduce's words and this communicator's numbering
    (the phase's own op and host numbering named it "rank 1" of "reduce_scatter_v")."""
    import zbccl
    from zbccl.ops import reduce_scatter

    comm = ctx.init(heap_size=16 << 20, timeout=60)
    x = torch.ones(1 << 18)  # 1 MiB: the hierarchical algorithm, by segments (reduce_scatter_v within each host)
    zbccl.all_reduce(x)
    if comm.rank == 3:
        def fail(*args, **kwargs):
            raise RuntimeError("injected in the host phase")
        reduce_scatter.reduce_scatter_v = fail
    try:
        zbccl.all_reduce(x)
    except Exception as exc:  # noqa: BLE001 - reported
        got = {"type": type(exc).__name__, "ranks": list(getattr(exc, "ranks", ())), "text": str(exc)}
    else:
        got = {"type": None}
    zbccl.finalize()
    return got


def test_an_error_in_a_phase_within_a_host_names_the_op_and_this_communicators_ranks(hosts2):
    out = run_hosts(_local_phase_fails, hosts2, ranks_per_host=2, timeout=180)
    assert out[3]["type"] == "RuntimeError", out[3]
    got = out[2]
    assert got["type"] == "ZbcclRemoteError" and got["ranks"] == [3], got
    assert got["text"].startswith("all_reduce: in its phase among this host's ranks [2, 3]"), got["text"]
    for r in (0, 1):  # host 0 learns it across hosts (the mesh), in this numbering
        assert out[r]["type"] in ("ZbcclRemoteError", "ZbcclTimeoutError") and set(out[r]["ranks"]) & {2, 3}, out[r]


# ----------------------------------------------------------------- the collectives across namespace hosts
def _ops_2x2(ctx, *, fault: str):
    """2 x 2 over real namespace hosts: the collectives work (flat and hierarchical); then host 1 is killed or cut
    off while ranks 0 and 1 wait inside an all_reduce, and both survivors name ranks 2 and 3 and the host."""
    import threading

    import zbccl

    comm = ctx.init(heap_size=8 << 20, timeout=60)
    me, W = comm.rank, comm.world_size
    try:
        for n in (5, 100_000):  # flat, then hierarchical (a regular topology)
            x = torch.arange(n, dtype=torch.float32) * (me + 1)
            zbccl.all_reduce(x)
            assert torch.equal(x, torch.arange(n, dtype=torch.float32) * sum(range(1, W + 1))), n
            out = torch.empty(W * n, dtype=torch.int64)
            zbccl.all_gather_into_tensor(out, torch.arange(n) + 1000 * me)
            assert torch.equal(out, torch.cat([torch.arange(n) + 1000 * r for r in range(W)])), n
        far = comm.new_group([1, 2, 3])  # ranks 2 and 3 wait in its barrier, for rank 1 (on host 0)
        if far:
            zbccl.barrier(comm=far)  # its setup (regions, through the store) before the fault
        zbccl.barrier()
        store = ctx.store()
        if me >= 2:  # host 1: waiting for rank 1, which never comes (it waits in the world's op)
            t0 = time.monotonic()
            try:
                zbccl.barrier(comm=far)
            except (ZbcclRemoteError, ZbcclTimeoutError) as exc:
                return {"error": type(exc).__name__, "ranks": list(exc.ranks), "text": str(exc),
                        "elapsed": time.monotonic() - t0}
            return {"error": None}
        if me == 0:  # the fault lands while ranks 0 and 1 wait inside the op (or just before: same verdict)
            threading.Timer(0.5, lambda: store.set(f"hosts/{fault}", b"1")).start()
        t0 = time.monotonic()
        try:
            zbccl.all_reduce(torch.ones(64))
        except (ZbcclRemoteError, ZbcclTimeoutError) as exc:
            got = {"error": type(exc).__name__, "ranks": list(exc.ranks), "text": str(exc),
                   "elapsed": time.monotonic() - t0}
        else:
            return {"error": None}
        # What this rank's local peer recorded on leaving (its ABORT line's CAUSE and VIA): the far rank it lost,
        # so that a rank meeting only that peer (a wait among this host's ranks) names the first cause.
        from zbccl.runtime.chain import ABORT_LINE, words

        store.set(f"hosts/left/{me}", b"1")
        store.wait([f"hosts/left/{1 - me}"])
        got["peer_line"] = words(comm._ctx.heap.transport, 1 - me, ABORT_LINE)
        return got
    finally:
        zbccl.finalize()


def test_ops_2x2_host_killed_mid_op(hosts2):
    def director(hosts, store):
        store.wait(["hosts/kill"])
        hosts.kill_host(1)

    out = run_hosts(_ops_2x2, hosts2, ranks_per_host=2, timeout=180, director=director, expect_exit={1: True},
                    fault="kill")
    for got in out[:2]:
        assert got["error"] == "ZbcclRemoteError" and got["ranks"] == [2, 3], got
        assert hosts2.addr(1) in got["text"] and "died" in got["text"], got["text"]
        assert got["elapsed"] < 10, got
        assert got["peer_line"] is not None and set(got["peer_line"]) <= {2, 3}, got  # (cause, via): a far rank


def test_ops_2x2_link_cut_mid_op(hosts2):
    def director(hosts, store):
        store.wait(["hosts/cut"])
        hosts.cut(1)

    out = run_hosts(_ops_2x2, hosts2, ranks_per_host=2, timeout=180, director=director, fault="cut")
    for got in out[:2]:
        assert got["error"] == "ZbcclTimeoutError" and got["ranks"] == [2, 3], got
        assert hosts2.addr(1) in got["text"] and "unreachable" in got["text"], got["text"]
        assert got["elapsed"] < 30, got
        assert got["peer_line"] is not None and set(got["peer_line"]) <= {2, 3}, got
    for got in out[2:]:  # the cut-off ranks name rank 1 of their group (global rank 1) and host 0
        assert got["error"] == "ZbcclTimeoutError" and got["ranks"] == [0], got
        assert hosts2.addr(0) in got["text"], got["text"]


def test_the_soak_over_namespace_hosts_is_bit_exact_and_leaks_nothing():
    """``zbccl soak --hosts 2 --netns`` at 2 x 2: the random op mix (EP included) between real namespace hosts,
    every result checked bit for bit, no growth of memory, descriptors or heap past the soak's limits."""
    import json
    import os
    import subprocess
    import sys

    from zbccl.heap.transports.mooncake import missing_reason

    reason = missing_reason() or hosts_skip_reason()
    if reason:
        pytest.skip(reason)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in ["src", os.environ.get("PYTHONPATH", "")] if p))
    out = subprocess.run([sys.executable, "-m", "zbccl", "soak", "--world", "4", "--hosts", "2", "--netns", "--ops",
                          "800", "--check-every", "32", "--seed", "11", "--json"], capture_output=True, text=True,
                         timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-4000:] + out.stdout[-4000:]
    doc = json.loads(out.stdout)
    assert doc["ok"] and doc["netns"] and doc["hosts"] == 2 and doc["ops"] == 800, doc
    assert doc["wrong"] == 0 and doc["errors"] == 0, doc
    bad = subprocess.run([sys.executable, "-m", "zbccl", "soak", "--world", "4", "--hosts", "3", "--netns", "--ops",
                          "8"], capture_output=True, text=True, timeout=60, env=env)
    assert bad.returncode == 2 and "--netns" in bad.stderr, bad.stderr[-2000:]
