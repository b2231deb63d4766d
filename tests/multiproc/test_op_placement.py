"""Placements and failures of the collectives: non-contiguous views, private operands staged or
pushed, strict mode, heaps too small to stage, chunked twoshot at huge sequence numbers, a peer
killed mid-op. Payloads and helpers as in :mod:`tests.multiproc.test_ops`.
"""

from __future__ import annotations

import pytest
import torch

from tests.multiproc.test_ops import MiB, payload
from tests.spawn import run_world

#: Non-contiguous views: name -> (base shape, view of the base).
VIEWS = {"transposed": ((4, 4), lambda b: b.t()), "sliced": ((6, 5), lambda b: b[1:5, ::2])}


def _base(rank: int, shape, make) -> torch.Tensor:
    b = make(*shape)
    b.copy_(payload(rank, shape[0] * shape[1], torch.float32).view(shape))
    return b


def _broadcast_views(ctx):
    """Issue 12: broadcast of a non-contiguous tensor must not overwrite the root's own data."""
    import zbccl

    comm = ctx.init(heap_size=8 * MiB)
    try:
        W, me = comm.world_size, comm.rank
        for src in range(W):
            for heap in (True, False):
                for name, (shape, view_of) in VIEWS.items():
                    base = _base(me, shape, zbccl.empty if heap else torch.empty)
                    before = base.clone()
                    zbccl.broadcast(view_of(base), src)
                    case = f"{name} src={src} heap={heap}"
                    expect = before.clone()
                    view_of(expect).copy_(view_of(_base(src, shape, torch.empty)))
                    assert torch.equal(base, expect), f"broadcast {case}: wrong bytes on rank {me}"
                    if me == src:
                        assert torch.equal(base, before), f"broadcast {case}: the root's tensor changed"
        return True
    finally:
        zbccl.finalize()


@pytest.mark.parametrize("world_size", [2, 3])
def test_broadcast_of_views_keeps_the_root_intact(world_size):
    assert run_world(_broadcast_views, world_size, timeout=120) == [True] * world_size
def _chunked_twoshot_and_placements(ctx):
    import zbccl
    from zbccl.ops.channel import channel_of
    from zbccl.ops.reference import all_reduce_ref
    from zbccl.ops.tuner import table_for

    comm = ctx.init(heap_size=16 * MiB)
    try:
        W, me = comm.world_size, comm.rank
        ch = channel_of(comm)
        table = table_for(ch)
        # small chunks: many pipelined twoshot steps, with ragged last chunks
        table.rules["all_reduce"] = {"*": [[-1, "twoshot", 4096]]}
        # streaming stores in the native twoshot (a policy knob: mode 1 forces them)
        ch.prims.chan_configure(ch.handle, 1)
        for dtype in (torch.bfloat16, torch.float32):
            n = 100_003
            t = zbccl.empty(n, dtype=dtype)
            t.copy_(payload(me, n, dtype))
            zbccl.all_reduce(t)
            assert torch.equal(t, all_reduce_ref([payload(r, n, dtype) for r in range(W)], 0)), "stream"
        ch.configure_stores()
        for mode in ("heap", "mixed"):  # mixed: rank 0's inputs are private (staged or pushed)
            ch.choices.clear()
            # Sequence numbers past 2^39 (every rank jumps alike): PHASE values once encoded
            # seq << 24 | step, which overflowed int64 there; they must not depend on seq at all.
            ch.seq += 1 << 40
            for dtype in (torch.bfloat16, torch.float32):
                for n in (1, 2047, 100_003):
                    t = zbccl.empty(n, dtype=dtype)
                    t.copy_(payload(me, n, dtype))
                    zbccl.all_reduce(t)
                    ref = all_reduce_ref([payload(r, n, dtype) for r in range(W)], 0)
                    assert torch.equal(t, ref), f"{mode} {dtype} n={n}"
            # the other ops on this path mix, heap and private placements
            x = zbccl.empty(300, dtype=torch.bfloat16)
            x.copy_(payload(me, 300, torch.bfloat16))
            for out in (torch.empty(W * 300, dtype=torch.bfloat16), zbccl.empty(W * 300, dtype=torch.bfloat16)):
                zbccl.all_gather_into_tensor(out, x if me or mode != "mixed" else x.clone())
                assert torch.equal(out, torch.cat([payload(r, 300, torch.bfloat16) for r in range(W)])), mode
            out = torch.empty(300 // W * W // W, dtype=torch.bfloat16)
            y = zbccl.empty(out.numel() * W, dtype=torch.bfloat16)
            y.copy_(payload(me, y.numel(), torch.bfloat16))
            zbccl.reduce_scatter_tensor(out, y)
            from zbccl.ops.reference import reduce_scatter_ref

            ref = reduce_scatter_ref([payload(r, y.numel(), torch.bfloat16) for r in range(W)], 0,
                                     [out.numel()] * W, me)
            assert torch.equal(out, ref), mode
            splits = [[(q + r) % 3 for r in range(W)] for q in range(W)]
            recv = [splits[q][me] for q in range(W)]
            inputs = [payload(q, sum(splits[q]), torch.float32) for q in range(W)]
            a = zbccl.empty(sum(splits[me]), dtype=torch.float32).copy_(inputs[me])
            b = torch.empty(sum(recv), dtype=torch.float32)
            zbccl.all_to_all_single(b, a if me or mode != "mixed" else a.clone(), recv, splits[me])
            from zbccl.ops.reference import all_to_all_ref

            assert torch.equal(b, all_to_all_ref(inputs, splits, me)), mode
            c = zbccl.empty(77, dtype=torch.int64).copy_(payload(me, 77, torch.int64))
            zbccl.broadcast(c, W - 1)
            assert torch.equal(c, payload(W - 1, 77, torch.int64)), mode
        return True
    finally:
        zbccl.finalize()


@pytest.mark.parametrize("world_size", [2, 3])
def test_chunked_twoshot_and_mixed_placements(world_size):
    assert run_world(_chunked_twoshot_and_placements, world_size, timeout=120) == [True] * world_size


def _staging_and_strict(ctx):
    import zbccl

    comm = ctx.init(heap_size=8 * MiB)
    try:
        W, me = comm.world_size, comm.rank
        st0 = zbccl.memory_stats()["staged_bytes"]
        t = payload(me, 1000, torch.float32)  # private memory: staged, still correct
        zbccl.all_reduce(t)
        assert torch.equal(t, payload(0, 1000, torch.float32) + payload(1, 1000, torch.float32))
        assert zbccl.memory_stats()["staged_bytes"] >= st0 + 2 * 4000
        # non-contiguous heap tensor: works through staging too
        m = zbccl.empty(10, 20, dtype=torch.float32)
        m.copy_(payload(me, 200, torch.float32).view(10, 20))
        col = m[:, 3]
        zbccl.all_reduce(col)
        ref = payload(0, 200, torch.float32).view(10, 20)[:, 3] + payload(1, 200, torch.float32).view(10, 20)[:, 3]
        assert torch.equal(col, ref)
        # private input and output for all_gather: staged through the heap
        out = torch.empty(W * 10)
        zbccl.all_gather_into_tensor(out, payload(me, 10, torch.float32))
        assert torch.equal(out, torch.cat([payload(r, 10, torch.float32) for r in range(W)]))
        with zbccl.strict_heap():
            with pytest.raises(zbccl.ZbcclInvalidUsageError, match="strict"):
                zbccl.all_reduce(torch.ones(5))
        # ... on every rank, and the channel stays in step afterwards
        t = zbccl.zeros(5).fill_(1)
        zbccl.all_reduce(t)
        assert t.tolist() == [2.0] * 5
        return True
    finally:
        zbccl.finalize()


def _heap_too_small_to_stage(ctx):
    import zbccl

    comm = ctx.init(heap_size=MiB, heap_max=0)  # a fixed heap, too small to stage in
    try:
        W, me = comm.world_size, comm.rank
        big = payload(me, 1 << 20, torch.float32)  # 4 MiB, private: needs staging, heap is 1 MiB
        with pytest.raises(zbccl.ZbcclOutOfMemoryError, match="cannot stage"):
            zbccl.all_reduce(big)
        with pytest.raises(zbccl.ZbcclOutOfMemoryError, match="cannot stage"):
            zbccl.broadcast(big, 1)  # the root (rank 1) cannot stage; rank 0 must fail with it
        out = torch.empty(W * (1 << 20))
        with pytest.raises(zbccl.ZbcclOutOfMemoryError, match="could not stage"):
            zbccl.all_gather_into_tensor(out, big)
        small = payload(me, 100, torch.float32)  # the group is still in step
        zbccl.all_reduce(small)
        assert torch.equal(small, sum(payload(r, 100, torch.float32) for r in range(W)))
        return True
    finally:
        zbccl.finalize()


def test_staging_that_does_not_fit_fails_on_every_rank():
    assert run_world(_heap_too_small_to_stage, 2, timeout=60) == [True, True]


def test_staging_counts_and_strict_mode():
    assert run_world(_staging_and_strict, 2) == [True, True]


def _killed_mid_op(ctx):
    import os
    import select
    import signal
    import threading
    from datetime import timedelta

    import zbccl
    from zbccl.ops.channel import L_ARRIVE, channel_of
    from zbccl.runtime.waits import FlagSet, wait_flags

    comm = ctx.init(heap_size=4 * MiB)
    store = ctx.store()
    t = zbccl.zeros(1 << 16)
    zbccl.all_reduce(t)
    if ctx.rank == 1:
        ch = channel_of(comm)
        mine = FlagSet([comm.ranks[1]], [ch.my_flags[L_ARRIVE]])

        def armed():  # once this rank posted op #2's ARRIVE: it cannot finish before rank 0 joins
            wait_flags(comm._ctx, mine, 2, timeout=30, op="test")
            store.set("ops/armed", str(os.getpid()).encode())

        threading.Thread(target=armed, daemon=True).start()
        zbccl.all_reduce(t)  # never returns: rank 0 kills this process first
        raise AssertionError("op #2 finished without rank 0")
    store.wait(["ops/armed"], timedelta(seconds=30))
    # Rank 0 kills rank 1 itself and waits until it is gone, so rank 1 cannot finish op #2 in the gap
    # between saying "armed" and dying (which a self-kill leaves open on 2 busy cores).
    pid = int(store.get("ops/armed"))
    fd = os.pidfd_open(pid)
    try:
        signal.pidfd_send_signal(fd, signal.SIGKILL)
        assert select.select([fd], [], [], 30)[0], "rank 1 did not die"
    finally:
        os.close(fd)
    with pytest.raises(zbccl.ZbcclRemoteError, match="died"):
        zbccl.all_reduce(t)
    zbccl.finalize()
    return comm.job_id


def test_peer_killed_in_the_middle_of_an_op():
    from tests.leaks import processes_mapping

    jobs = run_world(_killed_mid_op, 2, expect_exit={1: -9}, timeout=45)
    assert processes_mapping(jobs[0]) == []


def _live_heap_size(ctx):
    """Issue 11 item 6: operands are checked against each rank's heap size as published now (heaps may
    grow during the job), not as it was when the channel was made. Rank 1 publishes a smaller size for
    one op (a stand-in for a size that changes): the op fails on every rank; restored, it runs."""
    import zbccl
    from zbccl.heap import layout

    comm = ctx.init(heap_size=4 * MiB, timeout=60)
    try:
        W, me = comm.world_size, comm.rank
        t = zbccl.empty(1024)
        t.fill_(me + 1)
        zbccl.all_reduce(t)
        heap = comm.heap
        word = heap.ctrl_addr(comm.global_rank, layout.H_HEAP_BYTES)
        size = heap.prims.load_acquire(word)
        off = t.data_ptr() - comm.heap_base
        if me == 1:
            heap.prims.signal(word, off)  # the tensor now ends past rank 1's published heap
        comm.barrier()
        with pytest.raises(zbccl.ZbcclInvalidUsageError, match="rank 1's operand is outside its heap"):
            zbccl.all_reduce(t)
        comm.barrier()
        if me == 1:
            heap.prims.signal(word, size)
        comm.barrier()
        t.fill_(me + 1)
        zbccl.all_reduce(t)
        assert t.tolist() == [float(sum(range(1, W + 1)))] * 1024
        return True
    finally:
        zbccl.finalize()


def test_operands_are_checked_against_the_published_heap_size():
    assert run_world(_live_heap_size, 2, timeout=60) == [True, True]
