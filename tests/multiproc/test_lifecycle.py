"""Lifecycle: threads sharing a communicator, finalize while ops wait, non-members, pinning, group slots
(fork after init: test_fork.py).

Payloads encode their source (value = f(rank, index)) and every result is
compared with the plain-torch reference.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from tests.spawn import run_world

MiB = 1 << 20
N_ITERS = 60
JOIN_S = 120.0


def payload(rank: int, n: int) -> torch.Tensor:
    i = torch.arange(n, dtype=torch.float32)
    return torch.sin(i * 0.37 + rank * 1.3) * 50 + rank


def _threads(fn, n: int = 2) -> list[str]:
    """Run ``fn(i)`` on ``n`` threads; the failures as text. A thread that never ends fails the test."""
    errors: list[str] = []

    def body(i: int) -> None:
        try:
            fn(i)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            errors.append(f"thread {i}: {type(exc).__name__}: {exc}")

    ts = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(JOIN_S)
    assert not any(t.is_alive() for t in ts), "a thread never returned (hang)"
    return errors


# ------------------------------------------------------------------ item 1: two threads, one communicator
def _same_ops_two_threads(ctx):
    import zbccl
    from zbccl.ops.reference import all_reduce_ref

    comm = ctx.init(heap_size=16 * MiB)
    W, me, n = comm.world_size, comm.rank, 1000
    want_sum = all_reduce_ref([payload(r, n) for r in range(W)], 0)
    want_gather = torch.cat([payload(r, n) for r in range(W)])
    want_rs = all_reduce_ref([payload(r, n * W) for r in range(W)], 0)[me * n:(me + 1) * n]

    # Every thread of every rank passes the same f(rank, index) payloads, so any pairing of one
    # rank's ops with the peer's is correct: only a crash, a hang or a corrupted result fails.
    def all_reduce(i):
        for k in range(N_ITERS):
            t = zbccl.empty(n) if k % 2 == 0 else torch.empty(n)  # native and staged paths
            t.copy_(payload(me, n))
            zbccl.all_reduce(t)
            assert torch.equal(t, want_sum), f"all_reduce #{k} wrong"

    def all_gather(i):
        x = zbccl.empty(n)
        x.copy_(payload(me, n))
        for k in range(N_ITERS):
            out = torch.full((W * n,), -1.0)
            zbccl.all_gather_into_tensor(out, x)
            assert torch.equal(out, want_gather), f"all_gather #{k} wrong"

    def reduce_scatter(i):
        x = zbccl.empty(n * W)
        x.copy_(payload(me, n * W))
        for k in range(N_ITERS):
            out = torch.full((n,), -1.0)
            zbccl.reduce_scatter_tensor(out, x)
            assert torch.equal(out, want_rs), f"reduce_scatter #{k} wrong"

    def broadcast_and_barrier(i):
        for k in range(N_ITERS):
            t = zbccl.empty(n)
            t.copy_(payload(me, n))
            zbccl.broadcast(t, src=0)
            assert torch.equal(t, payload(0, n)), f"broadcast #{k} wrong"

    def barriers(i):
        for _ in range(N_ITERS):
            comm.barrier()
            zbccl.barrier()

    try:
        for fn in (all_reduce, all_gather, reduce_scatter, broadcast_and_barrier, barriers):
            errors = _threads(fn)
            assert not errors, errors
            comm.barrier()
        return True
    finally:
        zbccl.finalize()


def test_two_threads_hammering_one_communicator():
    assert run_world(_same_ops_two_threads, 2, timeout=240) == [True, True]


def _different_ops_two_threads(ctx):
    import zbccl

    comm = ctx.init(heap_size=8 * MiB, timeout=60)
    W, me, n = comm.world_size, comm.rank, 256
    outcomes = {"all_reduce": [0, 0], "all_gather": [0, 0]}  # [correct, refused]

    # Thread 0 all_reduces, thread 1 all_gathers: ranks may pair an all_reduce with an all_gather
    # (the lock order differs per rank). Each op must then raise ZbcclInvalidUsageError on both
    # ranks and the group stay in step; a pairing of like ops must be exact.
    def run(i):
        for _ in range(N_ITERS):
            try:
                if i == 0:
                    t = zbccl.empty(n)
                    t.fill_(me + 1)
                    zbccl.all_reduce(t)
                    assert torch.equal(t, torch.full((n,), float(W * (W + 1) // 2)))
                    outcomes["all_reduce"][0] += 1
                else:
                    x = zbccl.empty(n)
                    x.copy_(payload(me, n))
                    out = torch.empty(W * n)
                    zbccl.all_gather_into_tensor(out, x)
                    assert torch.equal(out, torch.cat([payload(r, n) for r in range(W)]))
                    outcomes["all_gather"][0] += 1
            except zbccl.ZbcclInvalidUsageError as exc:
                assert "disagree" in str(exc), str(exc)
                outcomes["all_reduce" if i == 0 else "all_gather"][1] += 1

    try:
        errors = _threads(run)
        assert not errors, errors
        comm.barrier()
        return outcomes
    finally:
        zbccl.finalize()


def test_threads_issuing_different_ops_fail_together_or_succeed():
    out = run_world(_different_ops_two_threads, 2, timeout=240)
    for o in out:
        assert o["all_reduce"][0] + o["all_reduce"][1] == N_ITERS
        assert o["all_gather"][0] + o["all_gather"][1] == N_ITERS
    # A refusal pairs one op of each rank, so both ranks refused equally often.
    refused = [o["all_reduce"][1] + o["all_gather"][1] for o in out]
    assert refused[0] == refused[1], out


# ------------------------------------------------------------------ item 2: finalize while an op waits
def _wait_until_busy(comm) -> None:
    deadline = time.monotonic() + 30
    while not comm._op_lock.busy():
        assert time.monotonic() < deadline, "the op thread never started its op"
        time.sleep(0.001)


def _finalize_while_waiting(ctx, op):
    import zbccl
    from tests.leaks import segments_of

    comm = ctx.init(heap_size=2 * MiB)
    zbccl.all_reduce(zbccl.zeros(16))  # the first op fetches rank 0's tuning table: done before
    if ctx.rank == 1:
        # The peer waits in a store op (another protocol than rank 0's op, so the two never pair: a barrier
        # and an all_reduce are both ops of the channel and would fail as out of step); it must be told
        # that rank 0 left.
        with pytest.raises(zbccl.ZbcclRemoteError, match="called finalize"):
            comm.all_gather_object(1)
        zbccl.finalize()
        return None
    got: list[BaseException] = []

    def waiter():
        try:
            if op == "barrier":
                comm.barrier()
            else:
                zbccl.all_reduce(zbccl.zeros(1 << 16))  # heap tensor: the native wait
        except BaseException as exc:  # noqa: BLE001
            got.append(exc)

    t = threading.Thread(target=waiter, daemon=True)
    t.start()
    _wait_until_busy(comm)
    t0 = time.monotonic()
    zbccl.finalize()
    took = time.monotonic() - t0
    t.join(30)
    assert not t.is_alive()
    assert took < 15, f"finalize took {took:.1f}s"
    assert len(got) == 1 and isinstance(got[0], zbccl.ZbcclError), got
    assert "finalize() was called on this rank while the op waited" in str(got[0]), str(got[0])
    got.clear()
    if op == "barrier":  # nothing of the heap is alive: it was unmapped once the op left
        assert not segments_of(os.getpid())
    return took


@pytest.mark.parametrize("op", ["barrier", "all_reduce"])
def test_finalize_while_another_thread_waits(op):
    run_world(_finalize_while_waiting, 2, op=op, timeout=120)


_ATEXIT_RANK0 = r"""
import sys, threading, time
from datetime import timedelta
import torch.distributed as dist
import zbccl

host, port, op = sys.argv[1], int(sys.argv[2]), sys.argv[3]
store = dist.TCPStore(host, port, 2, is_master=False, timeout=timedelta(seconds=60))
comm = zbccl.init(store=store, rank=0, world_size=2, heap_size=2 << 20, timeout=60)
zbccl.all_reduce(zbccl.zeros(16))

def waiter():
    if op == "barrier":
        comm.barrier()
    else:
        zbccl.all_reduce(zbccl.zeros(1 << 16))

threading.Thread(target=waiter, daemon=True).start()
deadline = time.monotonic() + 30
while not comm._op_lock.busy() and time.monotonic() < deadline:
    time.sleep(0.001)
raise RuntimeError("the main thread fails while a daemon thread is inside " + op)
"""


def _atexit_finalize(ctx, op):
    import zbccl

    if ctx.rank == 0:
        src = os.path.dirname(os.path.dirname(zbccl.__file__))
        env = dict(os.environ, PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", ""))
        t0 = time.monotonic()
        p = subprocess.run([sys.executable, "-c", _ATEXIT_RANK0, ctx.host, str(ctx.port), op], env=env,
                           capture_output=True, text=True, timeout=120)
        return p.returncode, p.stderr[-3000:], time.monotonic() - t0
    comm = ctx.init(heap_size=2 * MiB, timeout=60)
    zbccl.all_reduce(zbccl.zeros(16))
    with pytest.raises(zbccl.ZbcclRemoteError, match="called finalize"):
        comm.all_gather_object(1)  # never pairs with rank 0's op (see _finalize_while_waiting)
    zbccl.finalize()
    return None


@pytest.mark.parametrize("op", ["barrier", "all_reduce"])
def test_atexit_finalize_with_a_daemon_thread_inside_an_op(op):
    rc, err, took = run_world(_atexit_finalize, 2, op=op, timeout=150)[0]
    # The exception's status (1), not a segfault (-11), and the daemon thread was told why.
    assert rc == 1, f"exit status {rc}:\n{err}"
    assert "RuntimeError: the main thread fails" in err, err
    assert took < 60, took


# ------------------------------------------------------------------ item 4: non-members of new_group
def _non_member(ctx):
    import zbccl

    comm = ctx.init(heap_size=2 * MiB)
    g = comm.new_group([0])
    t = zbccl.empty(8)
    t.fill_(ctx.rank + 1)
    if ctx.rank == 0:
        assert g and g.is_member and g.world_size == 1
        zbccl.all_reduce(t, comm=g)
        assert torch.equal(t, torch.ones(8))
    else:
        assert not g and not g.is_member and g is not None
        refusals = [
            lambda: zbccl.all_reduce(t, comm=g),
            lambda: zbccl.broadcast(t, 0, comm=g),
            lambda: zbccl.barrier(comm=g),
            lambda: zbccl.all_gather_into_tensor(torch.empty(8), t, comm=g),
            lambda: zbccl.empty(4, comm=g),
            lambda: g.barrier(),
            lambda: g.world_size,
        ]
        for fn in refusals:
            with pytest.raises(zbccl.ZbcclInvalidUsageError, match=r"not a member of the group \[0\]"):
                fn()
        assert torch.equal(t, torch.full((8,), 2.0))  # never touched by a world collective
    comm.barrier()
    zbccl.finalize()
    return True


def test_non_member_gets_a_placeholder_that_refuses_every_op():
    assert run_world(_non_member, 2) == [True, True]


# ------------------------------------------------------------------ threads under CPU pinning
def _pinned(ctx, pins):
    import zbccl
    from zbccl.runtime.threads import nthreads

    os.environ.pop("ZBCCL_THREADS", None)
    os.environ.pop("ZBCCL_WAIT_SPIN", None)
    os.environ.pop("ZBCCL_WAIT_POLL_US", None)
    os.sched_setaffinity(0, pins[ctx.rank])
    torch.set_num_threads(3)  # the user's (or engine's) choice: zbccl must leave it
    comm = ctx.init(heap_size=2 * MiB)
    try:
        t = zbccl.empty(100)
        t.fill_(ctx.rank + 1)
        zbccl.all_reduce(t)
        assert torch.equal(t, torch.full((100,), 3.0))
        c = comm._ctx
        return {"oversubscribed": c.topology.oversubscribed, "spin": c.spin, "poll_ns": c.poll_ns,
                "threads": nthreads(), "torch": torch.get_num_threads()}
    finally:
        zbccl.finalize()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two usable cores")
@pytest.mark.parametrize("case", ["same-core", "own-cores"])
def test_pinned_ranks_decide_from_every_mask(case):
    pins = [{0}, {0}] if case == "same-core" else [{0}, {1}]
    out = run_world(_pinned, 2, pins=pins)
    for o in out:
        assert o["threads"] == 1 and o["torch"] == 3, o
        if case == "same-core":  # waits yield at once and sleep after the least polling
            assert o["oversubscribed"] and o["spin"] == 0 and o["poll_ns"] == 50_000, o
        else:  # a rank with its own core polls through a model step's skew before it sleeps
            assert not o["oversubscribed"] and o["spin"] > 0 and o["poll_ns"] == 2_000_000, o


def _poll_override(ctx):
    comm = ctx.init(heap_size=MiB)
    try:
        return comm._ctx.poll_ns
    finally:
        import zbccl

        zbccl.finalize()


def test_wait_poll_is_set_by_the_environment():
    assert run_world(_poll_override, 2, env={"ZBCCL_WAIT_POLL_US": "125"}) == [125_000, 125_000]


def _many_groups(ctx, n_groups):
    import zbccl

    comm = ctx.init(heap_size=4 * MiB)
    me = comm.rank
    slots = set()
    t = zbccl.empty(32)
    for k in range(n_groups):
        members = [0, 1] if k % 3 else [me]  # also single-member groups, built by each rank alone
        g = comm.new_group(members)
        slots.add(g.slot)
        t.copy_(payload(me, 32) + k)
        zbccl.all_reduce(t, comm=g)  # a reused slot with stale flags would pair this with an old op
        want = sum(payload(r, 32) + k for r in members)
        assert torch.equal(t, want), f"group {k} (slot {g.slot}) wrong"
        g.barrier()
        g.destroy()
        with pytest.raises(zbccl.ZbcclInvalidUsageError, match="destroyed"):
            zbccl.all_reduce(t, comm=g)
    with pytest.raises(zbccl.ZbcclInvalidUsageError, match="world communicator"):
        comm.destroy()
    comm.barrier()
    zbccl.finalize()
    return sorted(slots)


def test_300_groups_created_and_destroyed_reuse_their_slots():
    from zbccl.heap import layout

    n = 300
    assert n > layout.MAX_COMMS  # without reuse, slots run out
    for slots in run_world(_many_groups, 2, n_groups=n, timeout=240):
        assert len(slots) <= 3 and max(slots) < layout.MAX_COMMS, slots


def _longest_settings(ctx):
    import zbccl
    from zbccl.adapters.p2p import PointToPoint

    comm = ctx.init(heap_size=4 * MiB, timeout=zbccl.env.MAX_SECONDS)
    t = zbccl.empty(64)
    t.copy_(payload(comm.rank, 64))
    zbccl.all_reduce(t, timeout=zbccl.env.MAX_SECONDS)
    assert torch.equal(t, payload(0, 64) + payload(1, 64))
    g = comm.new_group([0, 1], timeout=zbccl.env.MAX_SECONDS)
    g.barrier(timeout=zbccl.env.MAX_SECONDS)
    pp = PointToPoint(comm)
    got = torch.empty(64)
    if comm.rank == 0:
        pp.send([payload(0, 64)], 1, 0).wait(timeout=1e12)  # torch's "very long" waits the longest it can
    else:
        pp.recv([got], 0, 0).wait(timeout=1e12)
        assert torch.equal(got, payload(0, 64))
    pp.close()
    g.destroy()
    del t
    zbccl.finalize()  # an interval of 1e9 s made this raise OverflowError
    return True


def test_the_longest_accepted_times_work_end_to_end():
    from zbccl import env

    huge = {"ZBCCL_LIVENESS_INTERVAL": str(env.MAX_SECONDS), "ZBCCL_TIMEOUT": str(env.MAX_SECONDS),
            "ZBCCL_WAIT_POLL_US": str(env.MAX_SECONDS * 1e6)}
    assert run_world(_longest_settings, 2, env=huge, timeout=120) == [True, True]
