"""One liveness rule for every wait (issue 20): a rank that leaves any op half-way is named by its peers
in the next op they enter, whatever that op is, within about a liveness interval.

Rank 1 is the victim: it enters an op alone (rank 0 stays out, so the op blocks), is interrupted
there (SIGINT, as Ctrl-C), catches the ``KeyboardInterrupt`` and stays alive and idle (no death to
detect). Rank 0 then enters the next op and must raise ``ZbcclRemoteError`` naming rank 1. The
liveness interval is small and the timeout large, so an error that comes from the timeout is
caught by the bound: ``BOUND`` is a generous multiple of the interval for a loaded 2-core machine
and well under ``TIMEOUT`` (a correctness bound, not a performance assertion).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch

from tests.spawn import run_world

MiB = 1 << 20
LIVENESS = 0.05  # seconds (ZBCCL_LIVENESS_INTERVAL in the ranks)
TIMEOUT = 60.0  # seconds: the communicators' timeout, also generous init time under load
BOUND = 12.0  # seconds: 240 liveness intervals, a fifth of the timeout
ENV = {"ZBCCL_LIVENESS_INTERVAL": str(LIVENESS)}
T, H, K, E = 8, 128, 2, 4


def _inside(thread_id: int, names: set[str]) -> bool:
    """Whether the thread's Python stack is inside a function named in ``names``."""
    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        if frame.f_code.co_name in names:
            return True
        frame = frame.f_back
    return False


def _interrupt_inside(names: set[str]) -> None:
    """Send this process SIGINT (Ctrl-C) once its main thread is inside one of ``names`` (a condition
    polled with back-off, from a daemon thread)."""
    main = threading.main_thread().ident

    def run() -> None:
        delay, deadline = 0.001, time.monotonic() + TIMEOUT
        while not _inside(main, names):
            if time.monotonic() > deadline:
                return
            time.sleep(delay)
            delay = min(2 * delay, 0.02)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=run, daemon=True).start()


def _timed(exc_type, fn, *patterns):
    """Run ``fn``: it must raise ``exc_type`` within BOUND seconds with every pattern in its message."""
    t0 = time.monotonic()
    with pytest.raises(exc_type) as info:
        fn()
    elapsed = time.monotonic() - t0
    assert elapsed < BOUND, f"took {elapsed:.1f}s (timeout {TIMEOUT:.0f}s): {info.value}"
    for p in patterns:
        assert p in str(info.value), f"{p!r} not in {info.value}"
    return info.value, elapsed


def _ep_inputs(rank: int):
    torch.manual_seed(rank)
    x = torch.ones(T, H, dtype=torch.bfloat16) * (rank + 1)
    topk_idx = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    return x, topk_idx, torch.ones(T, K, dtype=torch.float32)


def _dispatch(buffer, rank: int):
    x, topk_idx, w = _ep_inputs(rank)
    ntpr, _, ntpe, in_rank, _ = buffer.get_dispatch_layout(topk_idx, E)
    return buffer.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe,
                           topk_idx=topk_idx, topk_weights=w)


def _left_then_next(ctx, where: str, then: str):
    """Rank 1 leaves an op ``where`` half-way (Ctrl-C); rank 0 then enters ``then`` and names it."""
    import zbccl
    import zbccl.ep as deep_ep

    torch.set_num_threads(1)
    comm = ctx.init(heap_size=16 * MiB, timeout=TIMEOUT)
    store = ctx.store()
    t = zbccl.zeros(1 << 10)
    buffer = deep_ep.Buffer(comm) if "ep" in (where, then) else None
    try:
        if where != "first_op":
            zbccl.all_reduce(t)  # op #1 everywhere (the communicator's first op read the tuning table)
        if comm.rank == 1:
            victim = {"collective": lambda: zbccl.all_reduce(t), "first_op": lambda: zbccl.all_reduce(t),
                      "barrier": lambda: comm.barrier(), "ep": lambda: _dispatch(buffer, 1),
                      "store": lambda: comm.all_gather_object(1), "new_group": lambda: comm.new_group([0, 1])}[where]
            # first_op: the tuner's store read, where rank 1 waits for rank 0's table before posting anything;
            # store ops: the store wait (rank 0 never joins)
            inside = {"_wait_keys"} if where in ("first_op", "store", "new_group") else {"all_reduce", "barrier",
                                                                                          "dispatch"}
            _interrupt_inside(inside)
            with pytest.raises(KeyboardInterrupt):
                victim()
            store.set("liveness/left", b"1")
            # this rank refuses every later op, on every communicator, at once; its memory stays usable
            for refused in (lambda: zbccl.all_reduce(t), lambda: comm.barrier(), lambda: comm.new_group([0, 1])):
                _timed(zbccl.ZbcclInvalidUsageError, refused, "broken", "KeyboardInterrupt")
            assert zbccl.zeros(4).sum().item() == 0
            store.wait(["liveness/seen"], timedelta(seconds=TIMEOUT + BOUND))  # stay alive and idle
            return "left"
        store.wait(["liveness/left"], timedelta(seconds=TIMEOUT))
        nxt = {"collective": lambda: zbccl.all_reduce(t), "barrier": lambda: comm.barrier(),
               "ep": lambda: _dispatch(buffer, 0), "store": lambda: comm.all_gather_object(0),
               "new_group": lambda: comm.new_group([0, 1])}[then]
        err, elapsed = _timed(zbccl.ZbcclRemoteError, nxt, "rank 1 was interrupted")
        assert err.ranks == (1,), err.ranks
        return elapsed
    finally:
        if comm.rank == 0:
            store.set("liveness/seen", b"1")
        zbccl.finalize()


@pytest.mark.parametrize("where,then", [
    ("collective", "collective"),  # worked before issue 20: the op channel's own ABORT
    ("collective", "store"),
    ("barrier", "collective"),
    ("first_op", "collective"),
    ("ep", "ep"),
    ("ep", "collective"),
    ("collective", "ep"),
    ("barrier", "barrier"),
    ("barrier", "ep"),
    ("ep", "barrier"),
    ("store", "collective"),
    ("store", "barrier"),
    ("new_group", "ep"),
    ("collective", "new_group"),
])
def test_a_rank_that_left_an_op_is_named_in_the_next_op(where, then):
    out = run_world(_left_then_next, 2, where=where, then=then, env=ENV, timeout=3 * TIMEOUT)
    assert out[1] == "left" and out[0] < BOUND


def _left_while_peer_waits(ctx):
    """Rank 0 waits inside an EP dispatch (its publish barrier) while rank 1 leaves another op (a world
    barrier) half-way: the EP wait reads every peer's ABORT, not only the ABORT of the op it is in."""
    import zbccl
    import zbccl.ep as deep_ep

    torch.set_num_threads(1)
    comm = ctx.init(heap_size=16 * MiB, timeout=TIMEOUT)
    store = ctx.store()
    buffer = deep_ep.Buffer(comm)
    try:
        if comm.rank == 1:
            store.wait(["liveness/waiting"], timedelta(seconds=TIMEOUT))
            _interrupt_inside({"barrier"})
            with pytest.raises(KeyboardInterrupt):
                comm.barrier()  # rank 0 is in the EP op, not here
            store.wait(["liveness/seen"], timedelta(seconds=TIMEOUT + BOUND))
            return "left"
        me = threading.main_thread().ident

        def tell() -> None:  # once rank 0's dispatch waits in its publish barrier
            delay = 0.001
            while not _inside(me, {"run_barrier"}):
                time.sleep(delay)
                delay = min(2 * delay, 0.02)
            store.set("liveness/waiting", b"1")

        threading.Thread(target=tell, daemon=True).start()
        err, elapsed = _timed(zbccl.ZbcclRemoteError, lambda: _dispatch(buffer, 0), "rank 1 was interrupted")
        assert err.ranks == (1,), err.ranks
        return elapsed
    finally:
        if comm.rank == 0:
            store.set("liveness/seen", b"1")
        zbccl.finalize()


def test_a_wait_reads_every_peers_abort():
    out = run_world(_left_while_peer_waits, 2, env=ENV, timeout=3 * TIMEOUT)
    assert out[1] == "left" and out[0] < BOUND


def _left_then_recv(ctx):
    """p2p waits read the same ABORT lines: rank 1 leaves a barrier of the zbccl process group half-way,
    rank 0's receive from it raises naming it."""
    import torch.distributed as dist

    import zbccl  # noqa: F401 - registers the backend

    dist.init_process_group("zbccl", store=ctx.store(), rank=ctx.rank, world_size=ctx.world_size,
                            timeout=timedelta(seconds=TIMEOUT))
    store = ctx.store()
    try:
        dist.barrier()
        if ctx.rank == 1:
            _interrupt_inside({"barrier"})
            with pytest.raises(KeyboardInterrupt):
                dist.barrier()
            store.set("liveness/left", b"1")
            with pytest.raises(zbccl.ZbcclInvalidUsageError, match="broken"):
                dist.send(torch.ones(4), 0)
            store.wait(["liveness/seen"], timedelta(seconds=TIMEOUT + BOUND))
            return "left"
        store.wait(["liveness/left"], timedelta(seconds=TIMEOUT))
        err, elapsed = _timed(zbccl.ZbcclRemoteError, lambda: dist.recv(torch.zeros(4), 1), "rank 1 was interrupted")
        assert err.ranks == (1,), err.ranks
        return elapsed
    finally:
        if ctx.rank == 0:
            store.set("liveness/seen", b"1")
        dist.destroy_process_group()


def test_a_receive_names_a_rank_that_left():
    out = run_world(_left_then_recv, 2, env=ENV, timeout=3 * TIMEOUT)
    assert out[1] == "left" and out[0] < BOUND


def _dies_then_next(ctx, then: str):
    """Rank 1 dies (SIGKILL, between ops) as rank 0 enters ``then``: rank 0 names it (pidfd), whatever the
    op's protocol, instead of waiting out the timeout."""
    import zbccl
    import zbccl.ep as deep_ep

    torch.set_num_threads(1)
    comm = ctx.init(heap_size=16 * MiB, timeout=TIMEOUT)
    store = ctx.store()
    t = zbccl.zeros(1 << 10)
    buffer = deep_ep.Buffer(comm) if then == "ep" else None
    zbccl.all_reduce(t)
    if comm.rank == 1:
        store.set("liveness/dying", b"1")
        os.kill(os.getpid(), signal.SIGKILL)
    store.wait(["liveness/dying"], timedelta(seconds=TIMEOUT))
    nxt = {"collective": lambda: zbccl.all_reduce(t), "barrier": lambda: comm.barrier(),
           "ep": lambda: _dispatch(buffer, 0), "store": lambda: comm.all_gather_object({"rank": 0}),
           "new_group": lambda: comm.new_group([0, 1])}[then]
    try:
        err, elapsed = _timed(zbccl.ZbcclRemoteError, nxt, "rank 1 died")
        assert err.ranks == (1,), err.ranks
        return elapsed
    finally:
        zbccl.finalize()


@pytest.mark.parametrize("then", ["collective", "barrier", "ep", "store", "new_group"])
def test_a_dead_peer_is_named_in_any_op(then):
    out = run_world(_dies_then_next, 2, then=then, env=ENV, expect_exit={1: -9}, timeout=3 * TIMEOUT)
    assert out[0] < BOUND


def _p2p_left_or_died(ctx, how: str):
    """p2p: rank 1 leaves a receive half-way (Ctrl-C) or dies; rank 0's receive from it and (after a
    Ctrl-C) its next barrier name it, within about a liveness interval."""
    import torch.distributed as dist

    import zbccl  # noqa: F401 - registers the backend

    dist.init_process_group("zbccl", store=ctx.store(), rank=ctx.rank, world_size=ctx.world_size,
                            timeout=timedelta(seconds=TIMEOUT))
    store = ctx.store()
    try:
        dist.barrier()
        if ctx.rank == 1:
            if how == "died":
                store.set("liveness/left", b"1")
                os.kill(os.getpid(), signal.SIGKILL)
            _interrupt_inside({"_wait_recv"})
            with pytest.raises(KeyboardInterrupt):
                dist.recv(torch.zeros(4), 0)  # rank 0 never sends
            store.set("liveness/left", b"1")
            store.wait(["liveness/seen"], timedelta(seconds=TIMEOUT + BOUND))
            return "left"
        store.wait(["liveness/left"], timedelta(seconds=TIMEOUT))
        what = "rank 1 died" if how == "died" else "rank 1 was interrupted"
        err, elapsed = _timed(zbccl.ZbcclRemoteError, lambda: dist.recv(torch.zeros(4), 1), what)
        assert err.ranks == (1,), err.ranks
        if how == "interrupted":
            err, _ = _timed(zbccl.ZbcclRemoteError, lambda: dist.barrier(), what, "in the middle of a send/recv")
            assert err.ranks == (1,), err.ranks
        return elapsed
    finally:
        if ctx.rank == 0:
            store.set("liveness/seen", b"1")
            dist.destroy_process_group()


@pytest.mark.parametrize("how", ["interrupted", "died"])
def test_a_p2p_peer_that_left_or_died_is_named(how):
    out = run_world(_p2p_left_or_died, 2, how=how, env=ENV, expect_exit={1: -9} if how == "died" else None,
                    timeout=3 * TIMEOUT)
    assert out[0] < BOUND


def _left_init(ctx, how: str):
    """Rank 1 leaves init half-way (Ctrl-C) or dies in it, after the hello exchange (so its pid is known),
    or is interrupted in the hello exchange itself, while rank 0 is held back: rank 0's init then names it
    within about a liveness interval, not at the init timeout."""
    import zbccl
    from zbccl.runtime import state

    store = ctx.store()
    if ctx.rank == 1:
        if how == "died":
            def die(*args, **kwargs):  # rank 1 posted nothing for this step: rank 0 waits for it
                store.set("liveness/go", b"1")
                os.kill(os.getpid(), signal.SIGKILL)

            state._agree = die
            ctx.init(heap_size=4 * MiB, timeout=TIMEOUT)
        _interrupt_inside({"_hello"} if how == "interrupted_in_hello" else {"_agree"})
        with pytest.raises(KeyboardInterrupt):
            ctx.init(heap_size=4 * MiB, timeout=TIMEOUT)  # waits in the hello or capacity exchange for rank 0
        store.set("liveness/go", b"1")
        store.wait(["liveness/seen"], timedelta(seconds=TIMEOUT + BOUND))
        return "left"
    step = "_hello" if how == "interrupted_in_hello" else "_agree"
    real, went = getattr(state, step), []

    def held(*args, **kwargs):  # rank 0 enters that exchange only once rank 1 left
        store.wait(["liveness/go"], timedelta(seconds=TIMEOUT))
        went.append(time.monotonic())
        return real(*args, **kwargs)

    setattr(state, step, held)
    what = "rank 1 died" if how == "died" else "rank 1 was interrupted"
    try:
        with pytest.raises(zbccl.ZbcclRemoteError) as info:
            ctx.init(heap_size=4 * MiB, timeout=TIMEOUT)
        elapsed = time.monotonic() - went[0]
        assert elapsed < BOUND, f"took {elapsed:.1f}s (timeout {TIMEOUT:.0f}s): {info.value}"
        assert what in str(info.value) and "init" in str(info.value), str(info.value)
        assert info.value.ranks == (1,), info.value.ranks
        return elapsed
    finally:
        setattr(state, step, real)
        store.set("liveness/seen", b"1")


@pytest.mark.parametrize("how", ["interrupted", "died", "interrupted_in_hello"])
def test_a_rank_that_leaves_init_is_named(how):
    out = run_world(_left_init, 2, how=how, env=ENV, expect_exit={1: -9} if how == "died" else None,
                    timeout=3 * TIMEOUT)
    assert out[0] < BOUND


def _finalize_during_store_op(ctx):
    """finalize() from another thread while this rank's op waits on the store: the op leaves promptly
    with ZbcclInvalidUsageError, and finalize returns."""
    import zbccl

    comm = ctx.init(heap_size=4 * MiB, timeout=TIMEOUT)
    store = ctx.store()
    comm.barrier()
    if comm.rank == 1:  # never joins the all_gather_object
        store.wait(["liveness/done"], timedelta(seconds=TIMEOUT + BOUND))
        zbccl.finalize()
        return "idle"
    got: list = []

    def waiter() -> None:
        try:
            comm.all_gather_object("x")
            got.append(None)
        except BaseException as exc:  # noqa: BLE001 - checked below
            got.append(exc)

    th = threading.Thread(target=waiter)
    th.start()
    try:
        delay = 0.001
        while not _inside(th.ident, {"_wait_keys"}):
            time.sleep(delay)
            delay = min(2 * delay, 0.02)
        t0 = time.monotonic()
        zbccl.finalize()
        th.join(BOUND)
        elapsed = time.monotonic() - t0
        assert not th.is_alive(), "the store wait did not notice finalize()"
        assert isinstance(got[0], zbccl.ZbcclInvalidUsageError), got
        assert "finalize() was called on this rank" in str(got[0]), str(got[0])
        assert elapsed < BOUND, elapsed
        return elapsed
    finally:
        store.set("liveness/done", b"1")


def test_finalize_interrupts_a_store_wait():
    out = run_world(_finalize_during_store_op, 2, env=ENV, timeout=3 * TIMEOUT)
    assert out[1] == "idle" and out[0] < BOUND


def _cause_named_before_followers(ctx):
    """World 3: rank 2 leaves a store op (all_gather_object) half-way while ranks 0 and 1 wait in an all_reduce
    (another protocol: a barrier would be an op of the same channel, where ranks 0 and 1 would find the ops
    out of step). Whichever of them notices first also leaves (``ABORT_PEER``); both must name rank 2, the
    cause, not each other."""
    import zbccl

    comm = ctx.init(heap_size=4 * MiB, timeout=TIMEOUT)
    store = ctx.store()
    t = zbccl.zeros(256)
    try:
        zbccl.all_reduce(t)
        if comm.rank == 2:
            _interrupt_inside({"_wait_keys"})
            with pytest.raises(KeyboardInterrupt):
                comm.all_gather_object(2)
            store.wait(["liveness/seen0", "liveness/seen1"], timedelta(seconds=TIMEOUT + BOUND))
            return "left"
        err, elapsed = _timed(zbccl.ZbcclRemoteError, lambda: zbccl.all_reduce(t), "rank 2 was interrupted")
        assert err.ranks == (2,), err.ranks
        # the next op too: rank 2 is still named, whichever peer followed it first
        _timed(zbccl.ZbcclRemoteError, lambda: comm.barrier(), "rank 2 was interrupted")
        return elapsed
    finally:
        if comm.rank != 2:
            store.set(f"liveness/seen{comm.rank}", b"1")
        zbccl.finalize()


def test_the_cause_is_named_before_its_followers():
    out = run_world(_cause_named_before_followers, 3, env=ENV, timeout=3 * TIMEOUT)
    assert out[2] == "left" and max(out[:2]) < BOUND


def _barrier_timeout_is_reported(ctx):
    """A timeout in a barrier (an op of the channel) leaves it like a collective's: the late rank hears
    "rank 0 timed out" in the op it enters next (another op than rank 0's at that sequence number: the
    ABORT is still what it reports) instead of waiting out its own timeout."""
    import zbccl

    comm = ctx.init(heap_size=4 * MiB, timeout=TIMEOUT)
    store = ctx.store()
    t = zbccl.zeros(256)
    try:
        zbccl.all_reduce(t)
        if comm.rank == 0:
            _timed(zbccl.ZbcclTimeoutError, lambda: comm.barrier(timeout=1), "timed out after 1.0s")
            store.set("liveness/left", b"1")
            _timed(zbccl.ZbcclInvalidUsageError, lambda: zbccl.all_reduce(t), "broken", "barrier: timed out")
            store.wait(["liveness/seen"], timedelta(seconds=TIMEOUT + BOUND))
            return "timed out"
        store.wait(["liveness/left"], timedelta(seconds=TIMEOUT))
        err, elapsed = _timed(zbccl.ZbcclRemoteError, lambda: zbccl.all_reduce(t), "rank 0 timed out",
                              "in the middle of a barrier")
        assert err.ranks == (0,), err.ranks
        return elapsed
    finally:
        if comm.rank == 1:
            store.set("liveness/seen", b"1")
        zbccl.finalize()


def test_a_barrier_timeout_is_reported_to_the_late_rank():
    out = run_world(_barrier_timeout_is_reported, 2, env=ENV, timeout=3 * TIMEOUT)
    assert out[0] == "timed out" and out[1] < BOUND


def _chain_names_the_first_cause(ctx):
    """World 3, a chain: rank 1 times out in a world all_reduce waiting for rank 0 (alive, idle: as a
    stopped rank looks), while rank 2 waits for rank 1 only, in an all_reduce of the group {1, 2} (another op,
    which rank 0 is not in). Rank 2 must name rank 0, the first cause, and the chain, not only rank 1; and
    the ABORT line rank 2 leaves with records the chain, so a later op on rank 0 hears why."""
    import zbccl

    comm = ctx.init(heap_size=4 * MiB, timeout=TIMEOUT)
    store = ctx.store()
    pair = comm.new_group([1, 2])
    t = zbccl.zeros(256)
    try:
        zbccl.all_reduce(t)
        if pair:  # the group's first op reads the store: the one below runs on the native channel
            zbccl.all_reduce(t, comm=pair)
        if comm.rank == 0:  # the first cause: never enters the all_reduce ranks 1 waits in
            store.wait(["liveness/seen2"], timedelta(seconds=TIMEOUT + BOUND))
            err, _ = _timed(zbccl.ZbcclRemoteError, lambda: zbccl.all_reduce(t), "rank 1 timed out")
            return str(err)
        if comm.rank == 1:
            _timed(zbccl.ZbcclTimeoutError, lambda: zbccl.all_reduce(t, timeout=1), "rank 0")
            store.wait(["liveness/seen2"], timedelta(seconds=TIMEOUT + BOUND))
            return "timed out"
        err, elapsed = _timed(zbccl.ZbcclRemoteError, lambda: zbccl.all_reduce(t, comm=pair), "timed out",
                              "the first cause: rank 0 (world), which never arrived",
                              "chain: rank 0 (world) -> rank 0")
        assert err.ranks[0] == "0 (world)", err.ranks
        # a world op next, which rank 0 is not in either: named as the rank that never came
        err, _ = _timed(zbccl.ZbcclTimeoutError, lambda: comm.barrier(), "rank 0 never arrived",
                        "rank 1 timed out waiting for them first")
        assert err.ranks == (0,), err.ranks
        return elapsed
    finally:
        if comm.rank == 2:
            store.set("liveness/seen2", b"1")
        zbccl.finalize()


def test_a_chain_names_the_first_cause():
    out = run_world(_chain_names_the_first_cause, 3, env=ENV, timeout=3 * TIMEOUT)
    assert out[1] == "timed out" and out[2] < BOUND, out
    assert "the first cause: this rank" in out[0] and "chain: rank 0 -> rank 1" in out[0], out[0]


def _p2p_chain(ctx, how: str):
    """World 3, a chain of p2p waits: rank 1 receives from rank 0, which never sends (alive, idle: as a
    stopped rank looks), and rank 2 receives from rank 1. A p2p timeout leaves no ABORT line, so rank 2
    learns the chain from rank 1's WAIT line: rank 1 still waits for rank 0 (``waiting``: rank 2's own
    receive times out), or rank 1 timed out on rank 0 and called finalize (``finalized``)."""
    import torch.distributed as dist

    import zbccl

    dist.init_process_group("zbccl", store=ctx.store(), rank=ctx.rank, world_size=ctx.world_size,
                            timeout=timedelta(seconds=TIMEOUT))
    store = ctx.store()
    t = torch.zeros(4)
    try:
        dist.barrier()
        if ctx.rank == 0:  # the first cause: sends to rank 1 only once rank 2 has seen the chain
            store.wait(["liveness/seen2"], timedelta(seconds=TIMEOUT + BOUND))
            if how == "waiting":
                dist.send(torch.ones(4), 1)
            return "idle"
        if ctx.rank == 1:
            if how == "finalized":
                with pytest.raises(zbccl.ZbcclTimeoutError):
                    dist.irecv(t, 0).wait(timedelta(seconds=1))
                dist.destroy_process_group()
                store.set("liveness/left1", b"1")
                return "finalized"
            main = threading.main_thread().ident

            def tell() -> None:  # rank 2 starts its receive once this rank waits in its own
                delay = 0.001
                while not _inside(main, {"_wait_recv_until"}):
                    time.sleep(delay)
                    delay = min(2 * delay, 0.02)
                store.set("liveness/left1", b"1")

            threading.Thread(target=tell, daemon=True).start()
            dist.irecv(t, 0).wait()
            assert torch.equal(t, torch.ones(4))
            return "received"
        store.wait(["liveness/left1"], timedelta(seconds=TIMEOUT))
        if how == "waiting":
            err, _ = _timed(zbccl.ZbcclTimeoutError, lambda: dist.irecv(t, 1).wait(timedelta(seconds=1)),
                            "rank 1 itself waits for rank 0 in a send/recv, which never arrived",
                            "chain of waits: rank 1 -> rank 0")
        else:
            err, _ = _timed(zbccl.ZbcclRemoteError, lambda: dist.irecv(t, 1).wait(), "rank 1 called finalize",
                            "rank 1 timed out waiting for rank 0 in a send/recv, which never arrived")
        assert err.ranks == ((1, 0) if how == "waiting" else (0, 1)), err.ranks
        return str(err)
    finally:
        if ctx.rank == 2:
            store.set("liveness/seen2", b"1")
        if not (ctx.rank == 1 and how == "finalized"):
            dist.destroy_process_group()


@pytest.mark.parametrize("how", ["waiting", "finalized"])
def test_a_chain_of_p2p_waits_names_its_last_rank(how):
    out = run_world(_p2p_chain, 3, how=how, env=ENV, timeout=3 * TIMEOUT)
    assert out[:2] == ["idle", "received" if how == "waiting" else "finalized"], out


def _store_chain(ctx):
    """World 3, a chain through store ops: rank 1 times out creating the group {0, 1} (rank 0 never comes),
    while rank 2 waits for rank 1 creating the group {1, 2}. Rank 2 names rank 0, the first cause."""
    import zbccl

    comm = ctx.init(heap_size=4 * MiB, timeout=TIMEOUT)
    store = ctx.store()
    try:
        zbccl.barrier()
        if comm.rank == 0:
            store.wait(["liveness/seen2"], timedelta(seconds=TIMEOUT + BOUND))
            return "idle"
        if comm.rank == 1:
            _timed(zbccl.ZbcclTimeoutError, lambda: comm.new_group([0, 1], timeout=1), "ranks [0]")
            store.wait(["liveness/seen2"], timedelta(seconds=TIMEOUT + BOUND))
            return "timed out"
        err, _ = _timed(zbccl.ZbcclRemoteError, lambda: comm.new_group([1, 2]), "rank 1 timed out",
                        "the first cause: rank 0, which never arrived", "chain: rank 0 -> rank 1")
        assert err.ranks == (0, 1), err.ranks
        return str(err)
    finally:
        if comm.rank == 2:
            store.set("liveness/seen2", b"1")
        zbccl.finalize()


def test_a_chain_through_store_ops_names_the_first_cause():
    out = run_world(_store_chain, 3, env=ENV, timeout=3 * TIMEOUT)
    assert out[:2] == ["idle", "timed out"], out


def _init_chain(ctx):
    """World 3, a chain in init: rank 0 dies in init after the hello exchange; rank 2 notices (its pid) and
    leaves init because of it; rank 1, held back until then, reads rank 2's "left init" record first and
    must name rank 0, the first cause, not only rank 2."""
    import zbccl
    from zbccl.runtime import state

    store = ctx.store()
    real = state._agree
    if ctx.rank == 0:
        def die(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)

        state._agree = die
        ctx.init(heap_size=4 * MiB, timeout=TIMEOUT)
    if ctx.rank == 1:
        def held(*args, **kwargs):  # rank 1 enters the exchange once rank 2 left init
            store.wait(["liveness/left2"], timedelta(seconds=TIMEOUT))
            return real(*args, **kwargs)

        state._agree = held
    try:
        with pytest.raises(zbccl.ZbcclRemoteError) as info:
            ctx.init(heap_size=4 * MiB, timeout=TIMEOUT)
        if ctx.rank == 2:
            store.set("liveness/left2", b"1")
            assert "rank 0 died" in str(info.value), str(info.value)
            return "left"
        assert "rank 0" in str(info.value) and 0 in info.value.ranks, (str(info.value), info.value.ranks)
        return str(info.value)
    finally:
        state._agree = real


def test_a_chain_in_init_names_the_first_cause():
    out = run_world(_init_chain, 3, env=ENV, expect_exit={0: -9}, timeout=3 * TIMEOUT)
    assert out[2] == "left", out
    assert "rank 2 lost a peer" not in out[1] or "the first cause: rank 0, which died" in out[1], out[1]


def _p2p_follower_of_a_death(ctx):
    """World 3 (found by the world-4 fault trials): rank 0 dies; rank 1's receive from it raises, and rank 1
    stays alive (it neither finalizes nor exits); rank 2 receives from rank 1. Rank 1 left its receive
    because of a lost peer, so it marks its ABORT line (a p2p timeout alone is cancelled cleanly, a lost peer
    is not), and rank 2 names it and rank 0 within about a liveness interval, not at its timeout."""
    import torch.distributed as dist

    import zbccl

    dist.init_process_group("zbccl", store=ctx.store(), rank=ctx.rank, world_size=ctx.world_size,
                            timeout=timedelta(seconds=TIMEOUT))
    store = ctx.store()
    t = torch.zeros(4)
    try:
        dist.barrier()
        if ctx.rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        if ctx.rank == 1:
            _timed(zbccl.ZbcclRemoteError, lambda: dist.irecv(t, 0).wait(), "rank 0 died")
            store.set("liveness/left1", b"1")
            store.wait(["liveness/seen2"], timedelta(seconds=TIMEOUT + BOUND))
            return "lost rank 0"
        store.wait(["liveness/left1"], timedelta(seconds=TIMEOUT))
        err, elapsed = _timed(zbccl.ZbcclRemoteError, lambda: dist.irecv(t, 1).wait(), "rank 1 lost a peer",
                              "the first cause: rank 0, which died")
        assert err.ranks == (0, 1), err.ranks
        return elapsed
    finally:
        if ctx.rank == 2:
            store.set("liveness/seen2", b"1")
        dist.destroy_process_group()


def test_a_p2p_wait_that_lost_its_peer_leaves():
    out = run_world(_p2p_follower_of_a_death, 3, env=ENV, expect_exit={0: -9}, timeout=3 * TIMEOUT)
    assert out[1] == "lost rank 0" and out[2] < BOUND, out
