"""The one meaning of ABORT (runtime/liveness.py): which exceptions leave an op, what a rank that left
publishes and refuses, and that C reads the ABORT line's words from the generated header."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import zbccl
from zbccl.native import abi
from zbccl.runtime import liveness

CSRC = Path(zbccl.__file__).parent / "native" / "csrc"


@pytest.mark.parametrize("exc,why", [
    (KeyboardInterrupt(), abi.ABORT_INTERRUPT),
    (ValueError("a bug"), abi.ABORT_EXCEPTION),
    (zbccl.ZbcclTimeoutError("late"), abi.ABORT_TIMEOUT),
    (zbccl.ZbcclRemoteError("lost"), abi.ABORT_PEER),
    (zbccl.ZbcclInvalidUsageError("bad argument on every rank"), 0),
    (zbccl.ZbcclOutOfMemoryError("no room on every rank"), 0),
])
def test_which_exceptions_leave_an_op(exc, why):
    assert liveness.reason(exc) == why


def test_the_abort_words_come_from_the_abi():
    header = abi.c_header()
    for name in ("VALUE", "WHY", "WHERE"):
        assert f"#define W_{name} {abi.WORDS[name]}\n" in header
    for name, code in abi.ABORT_WHERE.items():
        assert f"#define WHERE_{name} {code}\n" in header
    chan = (CSRC / "core" / "chan.c").read_text()
    assert "W_WHY" in chan and "WHERE_COLLECTIVE" in chan
    assert not re.search(r"abort\[[^\]]+\]\[\d\]", chan), "an ABORT word index written as a literal"


def test_a_rank_that_left_publishes_it_and_refuses_its_ops(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    comm = zbccl.init(heap_size="2M")
    try:
        ctx = comm._ctx
        transport, me, line = ctx.heap.transport, ctx.rank, liveness.ABORT_LINE
        assert liveness.aborted(transport, me, line) == (0, 0)
        liveness.leave(ctx, zbccl.ZbcclInvalidUsageError("agreed"), op="all_reduce", where=abi.WHERE_COLLECTIVE)
        assert liveness.aborted(transport, me, line) == (0, 0) and ctx.left is None  # errors raised together
        liveness.leave(ctx, KeyboardInterrupt(), op="dispatch", where=abi.WHERE_EP)
        liveness.leave(ctx, ValueError(), op="barrier", where=abi.WHERE_BARRIER)  # the first reason stays
        assert liveness.aborted(transport, me, line) == (abi.ABORT_INTERRUPT, abi.WHERE_EP)
        assert "KeyboardInterrupt" in ctx.left
        with pytest.raises(zbccl.ZbcclInvalidUsageError, match="broken on rank 0.*KeyboardInterrupt"):
            comm.barrier()
        with pytest.raises(zbccl.ZbcclInvalidUsageError, match="broken"):
            comm.all_gather_object(1)
        assert zbccl.zeros(4).sum().item() == 0  # its memory stays usable
        err = liveness.abort_error(1, abi.ABORT_INTERRUPT, op="barrier", where=abi.WHERE_EP)
        assert err.ranks == (1,) and "rank 1 was interrupted (Ctrl-C) in the middle of an EP op" in str(err)
    finally:
        zbccl.finalize()


def _two_hosts():
    from zbccl.bootstrap.topology import HostInfo, Topology

    infos = tuple(HostInfo(f"id{r}", f"node{r}", 100 + r, 1) for r in range(2))
    return Topology(0, infos)


def test_init_names_a_member_on_another_host_whose_heartbeat_stopped(monkeypatch):
    """Init's heartbeat (InitBeat, read by init_watch for members on other hosts): a beating member is never
    named, one whose counter stands still for BEAT_STALE_S is, with its host; members on this host are left
    to their pidfds."""
    import time

    import torch.distributed as dist

    from zbccl.bootstrap.store import StoreBootstrap

    monkeypatch.setattr(liveness, "BEAT_S", 0.02)
    monkeypatch.setattr(liveness, "BEAT_STALE_S", 0.3)
    store = dist.HashStore()
    me, peer = (StoreBootstrap(store, r, 2, prefix="t/1") for r in (0, 1))
    beats = [liveness.InitBeat(b) for b in (me, peer)]
    watch = liveness.init_watch(me, None, _two_hosts())
    try:
        end = time.monotonic() + 0.8
        while time.monotonic() < end:  # rank 1 beats: a wait for it goes on
            watch([1], "bootstrap hello")
            time.sleep(0.02)
        beats[1].stop()  # rank 1 stops answering
        end = time.monotonic() + 5
        with pytest.raises(zbccl.ZbcclTimeoutError) as info:
            while time.monotonic() < end:
                watch([1], "bootstrap hello")
                time.sleep(0.02)
        assert info.value.ranks == (1,) and info.value.via == 1
        assert "rank 1 on host node1 (host id id1) stopped answering" in str(info.value), str(info.value)
        watch([], "bootstrap hello")  # a member already arrived is not judged
        same_host = liveness.init_watch(me, None, None)
        same_host([1], "bootstrap hello")  # no topology (before hello) or a local member: no heartbeat verdict
    finally:
        for b in beats:
            b.stop()
    assert me.counters(["beat/0", "beat/1"]) == [int(store.add("t/1/beat/0", 0)), int(store.add("t/1/beat/1", 0))]
