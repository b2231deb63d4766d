"""Collective failure paths: bad arguments and overlaps fail on every rank, clear messages,
Ctrl-C and scratch OOM reported to the peers, per-op timeouts.

Rank 1 is the one that misbehaves.
"""

from __future__ import annotations

import os
import resource
import signal
import threading
import time
from datetime import timedelta

import numpy as np
import pytest
import torch

from tests.spawn import run_world

MiB = 1 << 20
PROMPT = 20.0  # seconds: "promptly", against a communicator timeout of 300 s


def _expect(exc_type, fn, *patterns):
    """Run ``fn``; it must raise ``exc_type`` within PROMPT seconds with every pattern in its message."""
    t0 = time.monotonic()
    with pytest.raises(exc_type) as info:
        fn()
    elapsed = time.monotonic() - t0
    assert elapsed < PROMPT, f"took {elapsed:.1f}s: {info.value}"
    for p in patterns:
        assert p in str(info.value), f"{p!r} not in {info.value}"
    return info.value


def _bad_arguments(ctx):
    import zbccl

    comm = ctx.init(heap_size=8 * MiB, timeout=300)
    try:
        _bad_argument_cases(comm.rank)
        return True
    finally:
        zbccl.finalize()


def _bad_argument_cases(me: int) -> None:
    import zbccl

    bad = me == 1
    good = zbccl.zeros(8)
    meta = torch.empty(8, device="meta")
    sparse = torch.zeros(8).to_sparse()
    out16 = torch.empty(16)
    cases = [
        ("list", lambda: zbccl.all_reduce([1.0] * 8 if bad else good), "torch.Tensor"),
        ("meta", lambda: zbccl.all_reduce(meta if bad else good), "CPU tensor"),
        ("sparse", lambda: zbccl.all_reduce(sparse if bad else good), "strided"),
        ("bcast meta", lambda: zbccl.broadcast(meta if bad else good, 0), "CPU tensor"),
        ("bcast list", lambda: zbccl.broadcast([0] if bad else good, 0), "torch.Tensor"),
        ("bcast bool src", lambda: zbccl.broadcast(good, True if bad else 0), "src must be an integer"),
        ("gather meta", lambda: zbccl.all_gather_into_tensor(out16, meta if bad else good), "CPU tensor"),
        ("gather out meta", lambda: zbccl.all_gather_into_tensor(
            torch.empty(16, device="meta") if bad else out16, good), "CPU tensor"),
        ("gather_v sizes", lambda: zbccl.all_gather_v(out16, good, ["8", 8] if bad else [8, 8]),
         "must be integers"),
        ("rs sparse", lambda: zbccl.reduce_scatter_tensor(torch.empty(4), sparse if bad else good),
         "strided"),
        ("rs meta", lambda: zbccl.reduce_scatter_tensor(
            torch.empty(4, device="meta") if bad else torch.empty(4), good), "CPU tensor"),
        ("rs_v sizes", lambda: zbccl.reduce_scatter_v(torch.empty(4), good, [4.0, 4] if bad else [4, 4]),
         "must be integers"),
        ("a2a meta", lambda: zbccl.all_to_all_single(torch.empty(8), meta if bad else good), "CPU tensor"),
        ("a2a split type", lambda: zbccl.all_to_all_single(
            torch.empty(8), good, [4, 4], [1.5, 6.5] if bad else [4, 4]), "must be integers"),
        ("a2a split str", lambda: zbccl.all_to_all_single(
            torch.empty(8), good, "44" if bad else [4, 4], [4, 4]), "must be integers"),
        ("expanded", lambda: zbccl.all_reduce(torch.zeros(1).expand(8) if bad else good), "sharing memory"),
        ("bcast expanded", lambda: zbccl.broadcast(torch.zeros(1).expand(8) if bad else good, 0),
         "sharing memory"),
        ("gather out expanded", lambda: zbccl.all_gather_into_tensor(
            torch.zeros(1).expand(16) if bad else out16, good), "sharing memory"),
        ("timeout", lambda: zbccl.all_reduce(good, timeout=-1 if bad else None), "timeout must be"),
        ("timeout nan", lambda: zbccl.all_reduce(good, timeout=float("nan") if bad else 30), "timeout"),
    ]
    for name, fn, pattern in cases:
        err = _expect(zbccl.ZbcclInvalidUsageError, fn, pattern)
        assert 1 in err.ranks, f"{name}: {err}"
    # src may be any integral type (numpy ints included); the group is still in step
    t = zbccl.zeros(4).fill_(me + 1)
    zbccl.broadcast(t, np.int64(1))
    assert t.tolist() == [2.0] * 4
    zbccl.all_reduce(t)
    assert t.tolist() == [4.0] * 4


def test_bad_arguments_on_one_rank_fail_on_every_rank():
    assert run_world(_bad_arguments, 2, timeout=240) == [True, True]


def _overlaps(ctx):
    import zbccl

    comm = ctx.init(heap_size=8 * MiB, timeout=300)
    try:
        _overlap_cases(comm.world_size, comm.rank)
        return True
    finally:
        zbccl.finalize()


def _overlap_cases(W: int, me: int) -> None:
    import zbccl

    n = 6
    out = zbccl.zeros(W * n + 1)
    # all_gather input shifted by one element into the output: refused (rank 1 only, then both)
    for who in ((1,), (0, 1)):
        src = out[1:n + 1] if me in who else zbccl.zeros(n)
        _expect(zbccl.ZbcclInvalidUsageError,
                lambda src=src: zbccl.all_gather_into_tensor(out[: W * n], src), "overlap")
    # in-place all_to_all: refused
    x = zbccl.zeros(4 * W)
    _expect(zbccl.ZbcclInvalidUsageError, lambda: zbccl.all_to_all_single(x, x), "overlap")
    y = zbccl.zeros(4 * W)
    _expect(zbccl.ZbcclInvalidUsageError,
            lambda: zbccl.all_to_all_single(x if me == 1 else y, x), "overlap")
    # reduce_scatter output aliasing another rank's slice of the input: refused
    inp = zbccl.zeros(W * n)
    other = (me + 1) % W
    _expect(zbccl.ZbcclInvalidUsageError, lambda: zbccl.reduce_scatter_tensor(
        inp[other * n:(other + 1) * n] if me == 1 else torch.empty(n), inp), "overlap")
    # ... and partially overlapping a transposed view: refused
    base = zbccl.zeros(n, W)
    _expect(zbccl.ZbcclInvalidUsageError, lambda: zbccl.reduce_scatter_tensor(
        base.t()[0][:n] if me == 1 else torch.empty(n), base.view(-1)), "overlap")
    # legal in-place forms give the reference result
    full = zbccl.zeros(W * n)
    full[me * n:(me + 1) * n] = torch.arange(n, dtype=torch.float32) + 100 * me
    zbccl.all_gather_into_tensor(full, full[me * n:(me + 1) * n])
    expect = torch.cat([torch.arange(n, dtype=torch.float32) + 100 * r for r in range(W)])
    assert torch.equal(full, expect), "in-place all_gather"
    inp = zbccl.empty(W * n)
    inp.copy_(torch.arange(W * n, dtype=torch.float32) * (me + 1))
    zbccl.reduce_scatter_tensor(inp[me * n:(me + 1) * n], inp)
    ref = torch.arange(W * n, dtype=torch.float32) * sum(r + 1 for r in range(W))
    assert torch.equal(inp[me * n:(me + 1) * n], ref[me * n:(me + 1) * n])
    # interleaved views share a span but no element: accepted
    z = torch.zeros(2 * W * n)
    zbccl.all_gather_into_tensor(z[0::2], z[1::2][:n].fill_(me + 1))
    assert z[0::2].tolist() == sum(([float(r + 1)] * n for r in range(W)), [])


def test_overlapping_operands_are_refused_on_every_rank():
    assert run_world(_overlaps, 2, timeout=240) == [True, True]


def _size_messages(ctx):
    import zbccl

    comm = ctx.init(heap_size=8 * MiB, timeout=300)
    try:
        _size_cases(comm.rank)
        return True
    finally:
        zbccl.finalize()


def _size_cases(me: int) -> None:
    import zbccl

    sizes = [2, 3] if me == 0 else [3, 2]  # same totals: only the exact sizes differ
    inp = zbccl.zeros(sizes[me], 4)
    _expect(zbccl.ZbcclInvalidUsageError, lambda: zbccl.all_gather_v(torch.empty(5, 4), inp, sizes),
            "disagree on sizes", "[2, 3]", "[3, 2]")
    big = zbccl.zeros(5, 4)
    _expect(zbccl.ZbcclInvalidUsageError,
            lambda: zbccl.reduce_scatter_v(torch.empty(sizes[me], 4), big, sizes),
            "disagree on sizes", "[2, 3]", "[3, 2]")
    t = zbccl.zeros(3).fill_(1)
    zbccl.all_reduce(t)
    assert t.tolist() == [2.0] * 3


def test_size_mismatch_prints_the_sizes():
    assert run_world(_size_messages, 2, timeout=120) == [True, True]


def _per_op_timeout(ctx):
    import zbccl

    comm = ctx.init(heap_size=4 * MiB, timeout=300)
    store = ctx.store()
    try:
        t = zbccl.zeros(256)
        zbccl.all_reduce(t)
        if comm.rank == 1:
            store.wait(["op-errors/timed-out"], timedelta(seconds=60))  # alive, but skips the next op
            return None
        err = _expect(zbccl.ZbcclTimeoutError, lambda: zbccl.all_reduce(t, timeout=1.5),
                      "timed out after 1.5s", "rank 1 never arrived")
        assert err.ranks == (1,)
        return str(err)
    finally:
        if comm.rank == 0:
            store.set("op-errors/timed-out", b"1")
        zbccl.finalize()


def test_per_op_timeout_names_the_missing_rank():
    out = run_world(_per_op_timeout, 2, timeout=90)
    assert out[1] is None and out[0]


def _elsewhere(ctx):
    """A rank in a barrier while its peer runs an all_reduce: both are ops of the one channel, so both ranks
    fail at once naming each rank's op, and the group stays in step. A rank that does not come is named by
    the timeout; the rank that timed out leaves the group broken (its peer hears it within seconds, in a
    barrier) and refuses further ops."""
    import zbccl

    comm = ctx.init(heap_size=4 * MiB, timeout=300)
    store = ctx.store()
    t = zbccl.zeros(4096)
    try:
        zbccl.all_reduce(t)  # op #1 everywhere
        if comm.rank == 1:
            _expect(zbccl.ZbcclInvalidUsageError, lambda: comm.barrier(timeout=60), "ranks disagree on op",
                    "rank 0 all_reduce, rank 1 barrier")
            zbccl.all_reduce(t)  # in step again
            store.wait(["op-errors/0-left"], timedelta(seconds=60))  # stays out of rank 0's next op
            _expect(zbccl.ZbcclRemoteError, lambda: comm.barrier(timeout=60), "rank 0 timed out", "broken")
            store.set("op-errors/1-heard", b"1")  # rank 0 may finalize now
            return "late"
        _expect(zbccl.ZbcclInvalidUsageError, lambda: zbccl.all_reduce(t, timeout=60), "ranks disagree on op",
                "rank 0 all_reduce, rank 1 barrier")
        zbccl.all_reduce(t)
        _expect(zbccl.ZbcclTimeoutError, lambda: zbccl.all_reduce(t, timeout=2), "rank 1 never arrived")
        store.set("op-errors/0-left", b"1")
        _expect(zbccl.ZbcclInvalidUsageError, lambda: zbccl.all_reduce(t), "broken", "timed out")
        store.wait(["op-errors/1-heard"], timedelta(seconds=60))
        return "early"
    finally:
        zbccl.finalize()


def test_timeout_says_where_a_late_rank_is():
    assert run_world(_elsewhere, 2, timeout=120) == ["early", "late"]


def _same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Assert equal; otherwise say how many elements differ, where, and what they hold."""
    bad = (got != want).nonzero().flatten()
    if len(bad):
        i = bad[:4].tolist()
        raise AssertionError(f"{what}: {len(bad)} of {got.numel()} elements differ, first at {i}: "
                             f"{got[i].tolist()} where {want[i].tolist()} was expected")


def _late_writer(ctx, op):
    """twoshot all_reduce and the push exchanges write into peers' tensors. A rank that arrives after its
    peer timed out and left must not write into the peer's tensor (which the peer may reuse at once)."""
    import zbccl
    from tests.multiproc.test_ops import payload
    from zbccl.ops.tuner import force_algorithm

    comm = ctx.init(heap_size=8 * MiB, timeout=300)
    store = ctx.store()
    force_algorithm(comm, "all_reduce", "twoshot")
    force_algorithm(comm, "all_gather", "push")
    n, me = 8192, comm.rank
    t = zbccl.empty(n)
    out = zbccl.empty(2 * n)
    try:
        zbccl.all_reduce(zbccl.zeros(16))  # op #1 everywhere
        t.copy_(payload(me, n, torch.float32))
        out.fill_(-1.0)
        run = (lambda: zbccl.all_reduce(t)) if op == "all_reduce" else (lambda: zbccl.all_gather_into_tensor(out, t))
        if me == 1:
            store.wait(["op-errors/0-left"], timedelta(seconds=60))  # arrives only after rank 0 left
            _expect(zbccl.ZbcclRemoteError, run, "rank 0 timed out")
            store.set("op-errors/1-tried", b"1")
            return "late"
        _expect(zbccl.ZbcclTimeoutError, lambda: zbccl.all_reduce(t, timeout=1) if op == "all_reduce"
                else zbccl.all_gather_into_tensor(out, t, timeout=1), "never arrived")
        store.set("op-errors/0-left", b"1")
        store.wait(["op-errors/1-tried"], timedelta(seconds=60))
        _same(t, payload(0, n, torch.float32), "a late peer wrote into the tensor of a rank that left")
        _same(out, torch.full_like(out, -1.0), "a late peer pushed into the output of a rank that left")
        return "left"
    finally:
        zbccl.finalize()


@pytest.mark.parametrize("op", ["all_reduce", "all_gather"])
def test_a_late_rank_never_writes_into_a_rank_that_left(op):
    assert run_world(_late_writer, 2, op=op, timeout=120) == ["left", "late"]


def _interrupted(ctx):
    """Issue 11 item 3: after Ctrl-C in rank 1, rank 0 gets ZbcclRemoteError naming it within seconds."""
    import zbccl
    from zbccl.ops.channel import L_ARRIVE, channel_of
    from zbccl.runtime.waits import FlagSet, wait_flags

    comm = ctx.init(heap_size=4 * MiB, timeout=300)
    store = ctx.store()
    ch = channel_of(comm)
    try:
        t = zbccl.zeros(1 << 12)
        zbccl.all_reduce(t)  # op #1 on both ranks
        if comm.rank == 1:
            me = comm.ranks[1]
            mine = FlagSet([me], [ch.my_flags[L_ARRIVE]])

            def interrupt():  # once this rank is inside op #2 (its ARRIVE posted)
                wait_flags(comm._ctx, mine, 2, timeout=60, op="test")
                os.kill(os.getpid(), signal.SIGINT)

            threading.Thread(target=interrupt, daemon=True).start()
            with pytest.raises(KeyboardInterrupt):
                zbccl.all_reduce(t)  # op #2: rank 0 joins only after the interrupt
            store.set("op-errors/interrupted", b"1")
            _expect(zbccl.ZbcclInvalidUsageError, lambda: zbccl.all_reduce(t), "broken", "KeyboardInterrupt")
            store.wait(["op-errors/seen"], timedelta(seconds=60))  # stay alive: no death to detect
            return "interrupted"
        store.wait(["op-errors/interrupted"], timedelta(seconds=60))
        err = _expect(zbccl.ZbcclRemoteError, lambda: zbccl.all_reduce(t), "rank 1 was interrupted")
        assert err.ranks == (1,)
        _expect(zbccl.ZbcclRemoteError, lambda: zbccl.all_reduce(t), "rank 1 was interrupted")
        # the barrier reads the ABORT line too, instead of waiting out the 300 s timeout
        err = _expect(zbccl.ZbcclRemoteError, lambda: comm.barrier(), "barrier", "rank 1 was interrupted")
        assert err.ranks == (1,)
        _expect(zbccl.ZbcclRemoteError, lambda: zbccl.barrier(), "rank 1 was interrupted")
        return "seen"
    finally:
        if comm.rank == 0:
            store.set("op-errors/seen", b"1")
        zbccl.finalize()


def test_ctrl_c_is_reported_to_the_peers():
    assert run_world(_interrupted, 2, timeout=120) == ["seen", "interrupted"]


def _vm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmSize in /proc/self/status")


def _scratch_oom(ctx):
    """Issue 11 item 4: a oneshot whose scratch cannot be allocated fails on every rank, with the reason."""
    import zbccl
    from zbccl.ops.tuner import force_algorithm

    nbytes = 96 * MiB
    comm = ctx.init(heap_size=nbytes + 8 * MiB, timeout=300)
    force_algorithm(comm, "all_reduce", "oneshot")
    t = zbccl.zeros(nbytes // 4)
    try:
        zbccl.all_reduce(zbccl.zeros(16))  # channels and threads exist before the limit
        limit = resource.getrlimit(resource.RLIMIT_AS)
        if comm.rank == 1:  # room for small allocations, not for a 96 MiB scratch buffer
            resource.setrlimit(resource.RLIMIT_AS, (_vm_bytes() + 48 * MiB, limit[1]))
        try:
            err = _expect(zbccl.ZbcclOutOfMemoryError, lambda: zbccl.all_reduce(t), "rank 1 ran out of memory",
                          "scratch")
        finally:
            resource.setrlimit(resource.RLIMIT_AS, limit)
        assert err.ranks == (1,) and "outside its heap" not in str(err)
        small = zbccl.zeros(16).fill_(1)
        zbccl.all_reduce(small)  # the group is still in step
        assert small.tolist() == [2.0] * 16
        return True
    finally:
        zbccl.finalize()


def test_scratch_oom_fails_on_every_rank():
    assert run_world(_scratch_oom, 2, timeout=120) == [True, True]


def _error_text_race(ctx):
    """Issue 11 item 6: a peer's error text is read before DONE; right after DONE the peer may
    already have posted its next op (its split sizes) over it. Rank 0 here reads only once
    rank 1 has posted that next op, the worst case."""
    import zbccl
    from zbccl.ops.channel import L_ARRIVE, channel_of
    from zbccl.runtime.waits import wait_flags

    comm = ctx.init(heap_size=4 * MiB, timeout=300)
    ch = channel_of(comm)
    W, me = comm.world_size, comm.rank
    x = zbccl.empty(4 * W).fill_(me)
    try:
        if me == 1:
            _expect(zbccl.ZbcclInvalidUsageError, lambda: zbccl.all_reduce([1.0] * 4), "torch.Tensor")
        else:
            def peer_posted_next_op() -> None:
                wait_flags(comm._ctx, ch.peer_flags[L_ARRIVE], ch.seq + 1, timeout=30, op="test")

            real_raise = ch.raise_for

            def late_raise(rc, **kw):
                peer_posted_next_op()
                return real_raise(rc, **kw)

            ch.raise_for = late_raise
            _expect(zbccl.ZbcclInvalidUsageError, lambda: zbccl.all_reduce(x),
                    "rank 1 passed invalid arguments: all_reduce: tensor must be a torch.Tensor, got list")
            del ch.raise_for
        out = torch.empty(4 * W)
        zbccl.all_to_all_single(out, x)  # rank 1's next op, posted before rank 0 read the error
        assert out.tolist() == sum(([float(r)] * 4 for r in range(W)), [])
        return True
    finally:
        zbccl.finalize()


def test_peer_error_text_survives_the_peers_next_op():
    assert run_world(_error_text_race, 2, timeout=90) == [True, True]
