"""Failure paths of the device collectives' kernels, under the interpreter over the shm heap.

Arguments that differ across ranks are reported on every rank (naming the rank and the field), a call
that fails its own checks on one rank is reported by its peers, and a peer that never arrives ends the
kernel's wait with a timeout naming it, instead of a hang. After a mismatch the ranks stay in step.
"""

from __future__ import annotations

import pytest
import torch

from tests.multiproc.triton_cases import ENV, device_ops, needs_triton, payload
from tests.spawn import run_world

pytestmark = needs_triton


def _expect(kind, fn, *words):
    with pytest.raises(kind) as info:
        fn()
    for w in words:
        assert w in str(info.value), (w, str(info.value))
    return info.value


def _mismatches(ctx):
    import zbccl
    from zbccl.errors import ZbcclInvalidUsageError, ZbcclRemoteError

    comm, dev = device_ops(ctx)
    W, me = comm.world_size, comm.rank
    peer = 1 - me if W == 2 else (me + 1) % W
    # The tables are each rank's data base and kernel-area base, in group order.
    native = comm._ctx.heap.transport.native()
    transport = comm._ctx.heap.transport
    assert dev.data.tolist() == [native.data_addr(r) for r in range(W)]
    assert dev.pads.tolist() == [native.pad_addr(r, transport.KERNEL_LINE) for r in range(W)]
    assert transport.pointer_tables(comm.ranks)[0] is dev.data  # cached

    # Different element counts (rank 1 has more, hence maybe more blocks): every rank names a rank that differs.
    n = 4099 + 2000 * (me == 1)
    t = zbccl.empty(n, dtype=torch.float32)
    err = _expect(ZbcclInvalidUsageError, lambda: dev.all_reduce(t), "all_reduce: arguments differ across ranks")
    assert "element count" in str(err) or "launch shape" in str(err), str(err)
    assert err.ranks and err.ranks[0] != me
    # Different dtypes.
    t = zbccl.empty(100, dtype=torch.float32 if me == 0 else torch.int32)
    _expect(ZbcclInvalidUsageError, lambda: dev.all_reduce(t), "dtype")
    # Different ops on the ranks: rank 0 all_gathers while the others all_reduce.
    t = zbccl.empty(64, dtype=torch.float32)
    out = torch.empty(W * 64)
    if me == 0:
        _expect(ZbcclInvalidUsageError, lambda: dev.all_gather(out, t), "op all_gather", "all_reduce on group rank")
    else:
        _expect(ZbcclInvalidUsageError, lambda: dev.all_reduce(t), "op all_reduce", "all_gather on group rank 0")
    # all_to_all_v splits that do not pair: rank 0 expects one row more from every peer than it is sent.
    send = [1] * W
    recv = [1] * W if me else [1] + [2] * (W - 1)
    inp = zbccl.empty(W, 3, dtype=torch.int64)
    out = torch.empty(sum(recv), 3, dtype=torch.int64)
    kind = ZbcclInvalidUsageError
    if me == 0:
        _expect(kind, lambda: dev.all_to_all_v(out, inp, recv, send), "splits do not pair", "group rank 1",
                "send 2 rows here (this rank's out_splits[1]), got 1")
    else:
        dev.all_to_all_v(out, inp, recv, send)  # nothing wrong here: rank 0 alone sees the mismatch
    # A call that fails its own checks on one rank: its peers hear of it, it raises its own error.
    bad = torch.empty(10) if me == 1 else zbccl.empty(10)
    if me == 1:
        _expect(ZbcclInvalidUsageError, lambda: dev.all_reduce(bad), "expected a tensor of this rank's cpu heap")
    else:
        _expect(ZbcclRemoteError, lambda: dev.all_reduce(bad), "group rank 1", "failed its own checks")
    # The same bad call everywhere: every rank raises its own error, and stays in step.
    _expect(ZbcclInvalidUsageError, lambda: dev.all_gather(torch.empty(3), zbccl.empty(2)), "wrong output")
    _expect(ZbcclInvalidUsageError, lambda: dev.broadcast(zbccl.empty(2), W), "src out of range")
    # In step afterwards: a correct op still works.
    x = zbccl.empty(1001, dtype=torch.bfloat16)
    x.copy_(payload(me, 1001, torch.bfloat16))
    dev.all_reduce(x)
    from zbccl.ops.reference import all_reduce_ref
    assert torch.equal(x, all_reduce_ref([payload(r, 1001, torch.bfloat16) for r in range(W)], 0))
    assert peer != me
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_mismatched_arguments_fail_on_every_rank(world):
    assert run_world(_mismatches, world, env=ENV, timeout=180) == [True] * world


def _timeout(ctx):
    from zbccl.errors import ZbcclTimeoutError

    comm, dev = device_ops(ctx, timeout_s=1.5)
    if comm.rank == 0:
        err = _expect(ZbcclTimeoutError, dev.barrier, "timed out", "group rank(s) [1]")
        assert err.ranks == (1,)
        # Out of step now: every later op says so at once (no kernel runs).
        _expect(ZbcclTimeoutError, dev.barrier, "group rank(s) [1]")
    comm.barrier()  # rank 1 never joined the device barrier: it waits here for rank 0 to be done
    return True


def test_a_peer_that_never_arrives_times_out_naming_it():
    assert run_world(_timeout, 2, env=ENV, timeout=120) == [True, True]


def _dead_peer(ctx):
    import os
    import signal

    from zbccl.errors import ZbcclRemoteError

    comm, dev = device_ops(ctx, timeout_s=1.5)
    dev.barrier()
    if comm.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    err = _expect(ZbcclRemoteError, dev.barrier, "died", "[1]")
    assert err.ranks == (1,)
    return True


def test_a_peer_that_died_is_named_as_dead():
    assert run_world(_dead_peer, 2, env=ENV, expect_exit={1: -9}, timeout=120)[0] is True


def _device_splits(ctx, ins, outs, rows_in: int, rows_out: int, dtype):
    """One all_to_all_v of ``[rows, 4]`` rows with splits the host never sees (as device tensors are on a GPU:
    the launcher is called with them directly), into an output followed by canary rows. Returns
    ``(this rank's error or None, the output rows' first column)``; fails if a canary row was written."""
    import torch

    import zbccl
    from zbccl import ZbcclInvalidUsageError
    from zbccl.native.triton import geometry as g
    from zbccl.ops.dtypes import dtype_code

    comm, dev = device_ops(ctx)
    me = comm.rank
    block = zbccl.empty(rows_in, 4, dtype=dtype)
    block.copy_((torch.arange(rows_in * 4).view(rows_in, 4) + 1000 * me).to(dtype))
    space = torch.full((rows_out + 3, 4), -7, dtype=dtype)
    out = space[:rows_out]
    kw = g.KMAX_WORLD
    splits = torch.tensor(ins + [0] * (kw - 2) + outs + [0] * (kw - 2), dtype=torch.int64)
    isz = block.element_size()
    grid, blk, warps = dev._plan(1 << 20, isz)
    dev._k.all_to_all(dev.data, dev.pads, splits, slot_off=dev.slot_off, me=me, world=2,
                      in_off=dev._heap_offset(block, "input", "all_to_all_v"), out_addr=out.data_ptr(),
                      dtype=dtype_code(dtype, op="test"), itemsize=isz, inner=4, cnt=0, numel=block.numel(),
                      out_rows=rows_out, check=0, timeout_ns=dev.timeout_ns, grid=grid, block=blk, num_warps=warps)
    assert bool((space[rows_out:] == -7).all()), "a row past the output was written"
    try:
        dev.check()
    except ZbcclInvalidUsageError as exc:
        return str(exc), out[:, 0].tolist()
    return None, out[:, 0].tolist()


def _splits_past_the_tensors(ctx):
    """The kernel bounds every pull by the rows there are, writes nothing past the output and reads nothing
    past an input, and the ranks whose splits reach past a tensor, or who would have read past one, raise
    saying so. Rank 0's in_splits [2, 5] ask for 7 rows of its 6: rank 1 pulls rows [2, 7) of it, 4 exist."""
    import torch

    me = ctx.rank
    ins, outs = ([2, 5], [2, 3]) if me == 0 else ([3, 3], [5, 3])
    return _device_splits(ctx, ins, outs, 6, sum(outs), torch.int32)


def test_device_splits_past_the_tensors_move_nothing_out_of_bounds():
    (e0, out0), (e1, out1) = run_world(_splits_past_the_tensors, 2, env=ENV, timeout=120)
    assert "splits reach past the input of group rank 0" in e0 and "at most 6 rows, got splits up to row 7" in e0
    assert "splits reach past the input of group rank 0" in e1 and "got splits up to row 7" in e1
    # rank 1's output: 4 of the 5 rows it asked rank 0 for (rows 2..5 of rank 0's input), the 5th untouched
    assert out1 == [8, 12, 16, 20, -7, 1012, 1016, 1020] and out0 == [0, 4, 1000, 1004, 1008]


def _splits_past_the_output(ctx):
    import torch

    rows_out = 6 if ctx.rank == 0 else 4  # rank 1's output holds 4 of the 6 rows its out_splits ask for
    return _device_splits(ctx, [3, 3], [3, 3], 6, rows_out, torch.int64)[0]


def test_device_out_splits_past_the_output_write_nothing_past_it():
    e0, e1 = run_world(_splits_past_the_output, 2, env=ENV, timeout=120)
    assert e0 is None
    assert "splits reach past the output, expected at most 4 rows, got splits up to row 6" in e1
