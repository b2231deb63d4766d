"""The native hot entry of all_reduce (``OpChannel.hot``, ``native/csrc/py/hot.cpp``).

A repeated sum all_reduce of a heap tensor zbccl already made a plan for runs in one native
call from the tensor object. These tests check that it serves exactly those calls (bit-exact
against the reference, payloads encoding rank and step), that everything else falls back to
the Python path with its checks, and that it respects the channel's lifecycle: threads,
finalize, fork and a broken communicator.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.multiproc.test_ops import payload
from tests.spawn import run_world
from tests.threads import run_threads

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _needs_hot_entry():
    from zbccl import native

    if native.hot() is None:  # no C++ compiler or torch headers: the Python path serves everything
        pytest.skip("the native hot entry cannot be built here")


def _start(ctx, heap_size: int):
    """Init, and the world's channel with its Python-path native calls counted."""
    from zbccl.ops.channel import channel_of

    comm = ctx.init(heap_size=heap_size)
    ch = channel_of(comm)
    assert ch.hot is not None and ch.hot_gather is not None
    return comm, ch, _counting(ch)


def _counting(ch):
    """Count the Python path's native calls on ``ch`` (``submit``'s: ``hot_submit`` where the channel has a
    hot table, as here; the hot entry does not go through it)."""
    calls = [0]
    real = ch._hot_submit

    def counted(*args):
        calls[0] += 1
        return real(*args)

    ch._hot_submit = counted
    return calls


def _served(ctx):
    import zbccl
    from zbccl.ops.reference import all_reduce_ref

    comm, ch, calls = _start(ctx, 16 * MiB)
    try:
        W, me = comm.world_size, comm.rank
        # more tensors than the table's 32 slots: entries are replaced, never confused
        shapes = [(n, dt) for n in (1, 300, 2048, 4099) for dt in
                  (torch.float32, torch.bfloat16, torch.float16, torch.int32)] * 3
        tensors = [(zbccl.empty(n, dtype=dt), dt) for n, dt in shapes]
        for step in range(3):
            for i, (t, dt) in enumerate(tensors):
                t.copy_(payload(me + 7 * step + i, t.numel(), dt))
                zbccl.all_reduce(t)
                ref = all_reduce_ref([payload(r + 7 * step + i, t.numel(), dt) for r in range(W)], 0)
                assert torch.equal(t, ref), f"step {step} tensor {i} {dt}"
        python_calls = calls[0]
        # the first round made the plans; later rounds of the same tensors in a working set the table
        # holds run hot
        hot_set = tensors[:8]
        for t, _ in hot_set:  # registered again (the table's slots went to later tensors)
            zbccl.all_reduce(t)
        calls[0] = 0
        for step in range(5):
            for i, (t, dt) in enumerate(hot_set):
                t.copy_(payload(me + step + i, t.numel(), dt))
                zbccl.all_reduce(t)
                assert torch.equal(t, all_reduce_ref([payload(r + step + i, t.numel(), dt) for r in range(W)], 0))
        assert calls[0] == 0, f"{calls[0]} calls took the Python path"
        # not served: a non-contiguous view, another dtype at the same address, a private tensor, max
        base = zbccl.empty(64, dtype=torch.float32)
        base.copy_(payload(me, 64, torch.float32))
        zbccl.all_reduce(base)
        calls[0] = 0
        view = base.view(8, 8).t()
        view.copy_(payload(me, 64, torch.float32).view(8, 8).t())
        zbccl.all_reduce(view)
        assert torch.equal(view, all_reduce_ref([payload(r, 64, torch.float32).view(8, 8).t() for r in range(W)], 0))
        as_int = base.view(torch.int32)
        as_int.copy_(payload(me, 64, torch.int32))
        zbccl.all_reduce(as_int)
        assert torch.equal(as_int, all_reduce_ref([payload(r, 64, torch.int32) for r in range(W)], 0))
        private = payload(me, 64, torch.float32)
        zbccl.all_reduce(private)
        assert torch.equal(private, all_reduce_ref([payload(r, 64, torch.float32) for r in range(W)], 0))
        base.copy_(payload(me, 64, torch.float32))
        zbccl.all_reduce(base, "max")
        assert torch.equal(base, all_reduce_ref([payload(r, 64, torch.float32) for r in range(W)], 2))
        assert calls[0] >= 4, calls[0]
        # the profiler sees every call: the Python path records it
        calls[0] = 0
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            zbccl.all_reduce(base)
        assert calls[0] == 1 and any("all_reduce" in e.name for e in prof.events())
        return python_calls
    finally:
        zbccl.finalize()


@pytest.mark.parametrize("world_size", [2, 3])
def test_hot_entry_serves_registered_tensors_only(world_size):
    out = run_world(_served, world_size, timeout=180)
    assert all(n > 0 for n in out)


def _gather(ctx):
    """all_gather_into_tensor through the hot entry: the registered (output, input) pair only, bit-exact;
    another output, another dtype or a wrong-sized output take the Python path and its checks."""
    import zbccl

    comm, ch, calls = _start(ctx, 16 * MiB)
    try:
        W, me = comm.world_size, comm.rank
        pairs = [(zbccl.empty(n, dtype=dt), torch.empty(W * n, dtype=dt), dt) for n in (1, 513, 4096)
                 for dt in (torch.float32, torch.bfloat16)]
        for step in range(4):
            calls[0] = 0
            for i, (x, out, dt) in enumerate(pairs):
                x.copy_(payload(me + step + i, x.numel(), dt))
                out.fill_(-1)
                zbccl.all_gather_into_tensor(out, x)
                want = torch.cat([payload(r + step + i, x.numel(), dt) for r in range(W)])
                assert torch.equal(out, want), f"step {step} pair {i}"
            if step:
                assert calls[0] == 0, f"{calls[0]} gathers took the Python path"
        x, out, dt = pairs[1]
        other = torch.empty_like(out)
        zbccl.all_gather_into_tensor(other, x)  # a new output: a new plan, through Python
        assert calls[0] == 1 and torch.equal(other, out)
        with pytest.raises(zbccl.ZbcclInvalidUsageError):
            zbccl.all_gather_into_tensor(torch.empty(W * x.numel() + 1, dtype=dt), x)
        return True
    finally:
        zbccl.finalize()


@pytest.mark.parametrize("world_size", [2, 3])
def test_hot_entry_gathers_registered_pairs_only(world_size):
    assert run_world(_gather, world_size, timeout=120) == [True] * world_size


def _gather_dim(ctx):
    """all_gather_into_tensor(dim=-1) through the hot entry (vLLM's logits): served after the first call,
    bit-exact; an output of the same storage and size but another shape, or another dim, is not the
    registered gather: the Python path checks it (and refuses the wrong shape on every rank)."""
    import zbccl

    comm, ch, calls = _start(ctx, 16 * MiB)
    try:
        W, me = comm.world_size, comm.rank
        for shape in ((1, 1000), (8, 1000), (2, 3, 50)):
            x = zbccl.empty(shape, dtype=torch.bfloat16)
            out = zbccl.empty(shape[:-1] + (W * shape[-1],), dtype=torch.bfloat16)
            for step in range(4):
                calls[0] = 0
                x.copy_(payload(me + 3 * step, x.numel(), torch.bfloat16).view(shape))
                zbccl.all_gather_into_tensor(out, x, dim=-1)
                want = torch.cat([payload(r + 3 * step, x.numel(), torch.bfloat16).view(shape) for r in range(W)],
                                 dim=-1)
                assert torch.equal(out, want), f"{shape} step {step}"
                assert calls[0] == (1 if step == 0 else 0), f"{shape} step {step}: {calls[0]} Python-path calls"
        x = zbccl.empty(8, 1000, dtype=torch.bfloat16)
        out = zbccl.empty(8, 1000 * W, dtype=torch.bfloat16)
        x.copy_(payload(me, 8000, torch.bfloat16).view(8, 1000))
        zbccl.all_gather_into_tensor(out, x, dim=1)
        calls[0] = 0
        wrong = out.view(4, 2000 * W)  # same storage and numel, not a gather along dim 1 of x
        with pytest.raises(zbccl.ZbcclInvalidUsageError, match="wrong output shape"):
            zbccl.all_gather_into_tensor(wrong, x, dim=1)
        assert calls[0] == 1  # the handshake that failed the op on every rank
        zbccl.all_gather_into_tensor(out, x, dim=1)  # still in step
        assert torch.equal(out, torch.cat([payload(r, 8000, torch.bfloat16).view(8, 1000) for r in range(W)], 1))
        return True
    finally:
        zbccl.finalize()


@pytest.mark.parametrize("world_size", [2, 3])
def test_hot_entry_gathers_along_a_dimension(world_size):
    assert run_world(_gather_dim, world_size, timeout=120) == [True] * world_size


def _threads(ctx):
    """Two threads of each rank, each on its own communicator over the same ranks, both hot; and one
    communicator used by two threads in turn (the channel's native lock passes between them)."""
    import zbccl
    from zbccl.ops.reference import all_reduce_ref

    comm = ctx.init(heap_size=16 * MiB)
    other = comm.new_group([0, 1])
    W, me = comm.world_size, comm.rank

    def loop(c, salt):
        t = zbccl.empty(1000, dtype=torch.float32)
        for step in range(300):
            t.copy_(payload(me + salt + step, 1000, torch.float32))
            zbccl.all_reduce(t, comm=c)
            want = all_reduce_ref([payload(r + salt + step, 1000, torch.float32) for r in range(W)], 0)
            assert torch.equal(t, want), f"salt {salt} step {step}"

    errors = run_threads([lambda: loop(comm, 0), lambda: loop(other, 100)])
    assert not errors, errors
    # one communicator, two threads one after the other
    for salt in (200, 300):
        errors += run_threads([lambda salt=salt: loop(comm, salt)])
    assert not errors, errors
    other.destroy()
    zbccl.finalize()
    return True


def test_hot_entry_under_threads():
    assert run_world(_threads, 2, timeout=180) == [True, True]


def _lifecycle(ctx):
    """A hot entry held past finalize serves nothing (and does not touch the unmapped heap); in a forked
    child it serves nothing either; a communicator broken by a timeout refuses hot calls too."""
    import zbccl
    from zbccl.ops.channel import channel_of

    comm = ctx.init(heap_size=4 * MiB, timeout=60)  # a slow rank on a loaded machine still joins
    # The channel (made at the first op) takes the communicator's timeout as the hot entry's: short, so
    # that the hot call that must time out below does so quickly; the ranks meet on an event first.
    comm._ctx.timeout = 5.0
    store = ctx.store()
    store.set(f"hot/ready/{ctx.rank}", b"1")
    store.wait([f"hot/ready/{r}" for r in range(comm.world_size)])
    t = zbccl.empty(512, dtype=torch.float32).fill_(1)
    zbccl.all_reduce(t)
    zbccl.all_reduce(t)
    ch = channel_of(comm)
    hot = ch.hot
    assert hot(t) == 0  # served, both ranks in step
    pid = os.fork()
    if pid == 0:  # the child: the parent's channel is not ours
        os._exit(0 if hot(t) == -1 else 1)
    _, status = os.waitpid(pid, 0)
    # waitstatus_to_exitcode: a child killed by a signal is negative (WEXITSTATUS would say 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"a forked child's hot call was served or crashed: {status}"
    if ctx.rank == 1:  # skips the next op: rank 0's hot call times out and breaks the channel
        store.wait(["hot/timed-out"])
    else:
        with pytest.raises(zbccl.ZbcclTimeoutError, match="rank 1 never arrived"):
            ch.run_hot(hot, t, op="all_reduce")
        assert hot(t) == -1  # broken: the Python path refuses with the reason
        with pytest.raises(zbccl.ZbcclInvalidUsageError, match="broken"):
            zbccl.all_reduce(t)
        store.set("hot/timed-out", b"1")
    zbccl.finalize()
    assert hot(t) == -1
    with pytest.raises(zbccl.ZbcclInvalidUsageError):
        zbccl.all_reduce(t)
    return True


def test_hot_entry_lifecycle():
    assert run_world(_lifecycle, 2, timeout=120) == [True, True]


def _bound(ctx):
    """``zbccl.ops.bind_all_reduce`` (vLLM's communicator's all_reduce): a heap tensor with a plan runs in the hot
    entry, anything else takes all_reduce's one door; every result is the reference's."""
    import zbccl
    from zbccl.ops.reference import all_reduce_ref

    comm, ch, calls = _start(ctx, 16 * MiB)
    try:
        W, me = comm.world_size, comm.rank
        bound = zbccl.ops.bind_all_reduce(comm)
        heap, private = zbccl.empty(1000, dtype=torch.bfloat16), torch.empty(1000, dtype=torch.bfloat16)
        for step in range(4):
            for i, t in enumerate((heap, private)):
                t.copy_(payload(me + 5 * step + i, t.numel(), t.dtype))
                assert bound(t) is t
                ref = all_reduce_ref([payload(r + 5 * step + i, t.numel(), t.dtype) for r in range(W)], 0)
                assert torch.equal(t, ref), f"step {step} tensor {i}"
        # the heap tensor: a plan on its first call, hot afterwards; the private one: staged every time
        assert calls[0] == 1 + 4, calls[0]
    finally:
        zbccl.finalize()
    return True


@pytest.mark.parametrize("world_size", [2, 3])
def test_bound_all_reduce_offers_the_hot_entry_first(world_size):
    assert all(run_world(_bound, world_size, timeout=120))
