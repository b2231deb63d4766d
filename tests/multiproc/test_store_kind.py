"""all_reduce's store kind (native policy, ``chan_ops.c`` "Store kind"): both kinds give the reference's
bits at every size and alignment; group rank 0 measures both per size bucket, cached first, and
re-measures the other kind once its sample is stale; the environment fixes it."""

from __future__ import annotations

import ctypes
import time

import pytest
import torch

from tests.multiproc.test_ops import MiB, payload
from tests.spawn import run_world

STALE_S = 0.2  # KIND_STALE_NS in chan_ops.c


def _kinds(ch) -> dict[int, tuple]:
    """log2 bucket -> (cached ns/B, streaming ns/B, cached samples, streaming samples)."""
    return {b: tuple(rest) for b, *rest in ch.prims.chan_kinds(ch.handle)}


def _used_kind(comm) -> int:
    """The store kind of group rank 0's latest all_reduce, from its op header: what every rank used
    (the others read it there). Read on rank 0, or on any rank once no op is in flight."""
    from zbccl.heap import layout
    from zbccl.native.abi import HEADER, SLOT_LINES

    line = layout.slot_line(comm.slot, SLOT_LINES["HEADER"])
    return ctypes.c_int64.from_address(comm.heap.ctrl_addr(comm.ranks[0], line) + 8 * HEADER.index("KIND")).value


def _both_kinds_exact(ctx):
    import zbccl
    from zbccl.ops.channel import channel_of
    from zbccl.ops.reference import all_reduce_ref

    comm = ctx.init(heap_size=32 * MiB)
    try:
        W, me = comm.world_size, comm.rank
        ch = channel_of(comm)
        for mode in (0, 1):
            ch.prims.chan_configure(ch.handle, mode)
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                for n in (1, 33, 1031, 4099, 70001, 600_001):
                    for skew in (0, 1):  # an operand that starts off a vector boundary too
                        block = zbccl.empty(n + skew, dtype=dtype)
                        t = block[skew:]
                        t.copy_(payload(me, n, dtype))
                        zbccl.all_reduce(t)
                        ref = all_reduce_ref([payload(r, n, dtype) for r in range(W)], 0)
                        assert torch.equal(t, ref), f"mode {mode} {dtype} n={n} skew={skew}"
        return True
    finally:
        zbccl.finalize()


@pytest.mark.parametrize("world_size", [2, 3])
def test_both_store_kinds_are_bit_exact(world_size):
    assert run_world(_both_kinds_exact, world_size, timeout=120) == [True] * world_size


def _auto_policy(ctx):
    import zbccl
    from zbccl.ops.channel import channel_of

    comm = ctx.init(heap_size=16 * MiB)
    try:
        ch = channel_of(comm)
        lead = comm.rank == 0  # group rank 0 measures and chooses for everyone; the others keep no stats
        t = zbccl.zeros(32 * 1024, dtype=torch.bfloat16)  # 64 KiB: bucket 16
        ch.configure_stores()  # cached stores are measured first
        zbccl.all_reduce(t)  # the first op of a kind is not a sample (it reads what the other kind wrote)
        zbccl.all_reduce(t)
        assert not lead or _kinds(ch)[16][2:] == (1, 0), _kinds(ch)
        for _ in range(10):
            zbccl.all_reduce(t)
        settled = _kinds(ch).get(16)
        assert not lead or (settled[2] >= 2 and settled[3] >= 2 and settled[0] > 0 and settled[1] > 0), settled
        # ops below 2 KiB are all handshake: cached, not measured
        zbccl.all_reduce(zbccl.zeros(16))
        assert 4 not in _kinds(ch)
        # the kind not in use is re-measured once its last sample is stale, whatever the op rate
        comm.all_gather_object(None)  # a sync off the channel: rank 0's header still holds its last all_reduce
        before, in_use = _kinds(ch).get(16), _used_kind(comm)  # the kind the last op used, as observed
        time.sleep(STALE_S * 1.5)  # lets a sample age past KIND_STALE_NS; no rank waits on another here
        used = []
        for _ in range(4):  # a run of the other kind: one op switches (not a sample), then samples
            zbccl.all_reduce(t)
            if lead:
                used.append(_used_kind(comm))
        after = _kinds(ch).get(16)
        if lead:
            other = 1 - in_use
            assert other in used, (in_use, used)
            assert after[2 + other] > before[2 + other], (in_use, used, before, after)
        else:
            assert _kinds(ch) == {}
        return True
    finally:
        zbccl.finalize()


def test_auto_store_kind_measures_both_and_follows():
    assert run_world(_auto_policy, 2, timeout=60) == [True, True]


def _fixed(ctx):
    import zbccl
    from zbccl.ops.channel import channel_of

    comm = ctx.init(heap_size=8 * MiB)
    try:
        ch = channel_of(comm)
        used = []
        for n in (32 * 1024, 4096, 256 * 1024):  # several size buckets
            t = zbccl.zeros(n, dtype=torch.bfloat16)
            for _ in range(6):
                zbccl.all_reduce(t)
                if comm.rank == 0:
                    used.append(_used_kind(comm))
        # no op in flight: every rank reads what rank 0 posted for the last one (a store sync: a barrier is an
        # op of the channel and would post its own header)
        comm.all_gather_object(None)
        return _kinds(ch), used, _used_kind(comm)
    finally:
        zbccl.finalize()


@pytest.mark.parametrize("setting,kind", [("on", 1), ("off", 0)])
def test_environment_fixes_the_kind(setting, kind):
    # twoshot (the algorithm whose pushes the kind governs) at every size; every rank sets the variable
    env = {"ZBCCL_STREAM_STORES": setting, "ZBCCL_ALGO": "all_reduce=twoshot"}
    (kinds0, used, last0), (kinds1, _, last1) = run_world(_fixed, 2, env=env)
    assert used and set(used) == {kind}, f"ZBCCL_STREAM_STORES={setting}: ops used kinds {used}"
    assert last0 == last1 == kind
    assert kinds0 == kinds1 == {}  # a fixed kind measures nothing


def _bad_mode(ctx):
    import zbccl

    with pytest.raises(zbccl.ZbcclInvalidUsageError, match="ZBCCL_STREAM_STORES"):
        ctx.init(heap_size=8 * MiB)
        zbccl.all_reduce(zbccl.zeros(16))
    zbccl.finalize()
    return True


def test_bad_store_kind_setting_is_refused():
    assert run_world(_bad_mode, 2, env={"ZBCCL_STREAM_STORES": "sometimes"}) == [True, True]
