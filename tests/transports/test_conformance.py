"""Transport conformance: the one suite every transport passes (``TRANSPORTS`` in ``conftest.py``).

Each case opens the transport alone in every rank (``world.open_transport``) and checks one
guarantee of the interface (``zbccl/heap/transports/base.py``): views, put/get, signal/wait
ordering, wait timeouts, peer death, growth and bounds. Payloads name their source
(``world.payload``: rank, index, iteration). Nothing here knows how a transport is built.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from tests.spawn import run_world
from zbccl.errors import ZbcclInvalidUsageError, ZbcclOutOfMemoryError, ZbcclRemoteError, ZbcclTimeoutError

from .world import DATA, line, open_transport, payload

N = 256  # int64 values per payload


def _peer_ints(t, rank: int, offset: int, n: int) -> torch.Tensor:
    """``n`` int64 of a peer's data: through a view where the transport maps the peer (``viewable``), else
    through ``get_into``, after checking that the view is refused (a transport between hosts)."""
    if t.viewable(rank):
        return t.view(rank, offset, (n,), torch.int64).cpu()
    with pytest.raises(ZbcclInvalidUsageError, match="view"):
        t.view(rank, offset, (n,), torch.int64)
    out = torch.empty(n, dtype=torch.int64)
    t.get_into(rank, offset, out)
    return out


def _write_peer_ints(t, rank: int, offset: int, values: torch.Tensor) -> None:
    """Write int64 ``values`` into a peer's data: through a view where it is ``viewable``, else with put."""
    if t.viewable(rank):
        t.view(rank, offset, tuple(values.shape), torch.int64).copy_(values.to(t.device))
        return
    with pytest.raises(ZbcclInvalidUsageError, match="view"):
        t.view(rank, offset, tuple(values.shape), torch.int64)
    t.put(rank, offset, values.to(t.device))


def _views_and_put_get(ctx, name):
    t, boot = open_transport(ctx, name)
    me, W = ctx.rank, ctx.world_size
    peers = [r for r in range(W) if r != me]
    try:
        assert t.device == torch.device(t.device) and t.reachable(me) and all(t.reachable(p) for p in peers)
        assert t.size(me) == DATA and all(t.size(p) == DATA for p in peers)
        # 1. a write through this rank's own view is seen through every peer's view of it
        mine = t.view(me, 0, (N,), torch.int64)
        mine.copy_(payload(me, N).to(t.device))
        t.signal(me, line(0), 1)
        t.wait_until([(p, line(0)) for p in peers], 1, timeout=30, op="views")
        for p in peers:
            seen = _peer_ints(t, p, 0, N)
            assert torch.equal(seen, payload(p, N)), (p, seen[:4])
        # 2. a write through a view of a peer's memory is seen by that peer in its own view
        nxt = (me + 1) % W
        _write_peer_ints(t, nxt, 8 * N * (me + 1), payload(me, N, 1))
        t.signal(me, line(1), 1)
        prev = (me - 1) % W
        t.wait_until([(prev, line(1))], 1, timeout=30, op="views")
        got = t.view(me, 8 * N * (prev + 1), (N,), torch.int64).cpu()
        assert torch.equal(got, payload(prev, N, 1)), got[:4]
        # 3. put into every peer (tensor and bytes forms), get back from every peer
        base = 8 * N * (W + 1)
        for p in peers:
            t.put(p, base + 8 * N * me, payload(me, N, 2).to(t.device))
            t.put(p, base + 8 * N * (W + me), payload(me, N, 3).numpy().tobytes())
        many = base + 8 * N * (2 * W)  # put_many: three pieces (tensor, bytes, empty) in one call
        for p in peers:
            t.put_many(p, [(many + 8 * N * (2 * me + 1), payload(me, N, 5).to(t.device)),
                           (many + 8 * N * 2 * me, payload(me, N, 4).numpy().tobytes()),
                           (many, torch.empty(0, dtype=torch.uint8))])
        late = many + 8 * N * (2 * W)  # put_async: every peer's write in flight at once, then polled until landed
        src = payload(me, N, 6).to(t.device)
        pending = [t.put_async(p, late + 8 * N * me, src) for p in peers]
        deadline = time.monotonic() + 30
        while not all(w.done() for w in pending):
            assert time.monotonic() < deadline, "put_async never landed"
            time.sleep(1e-4)
        t.signal(me, line(2), 1)
        t.wait_until([(p, line(2)) for p in peers], 1, timeout=30, op="put")
        for p in peers:
            for k in (0, 1):
                got = t.view(me, many + 8 * N * (2 * p + k), (N,), torch.int64).cpu()
                assert torch.equal(got, payload(p, N, 4 + k)), (p, k, got[:4])
            got = t.view(me, late + 8 * N * p, (N,), torch.int64).cpu()
            assert torch.equal(got, payload(p, N, 6)), (p, got[:4])
            assert torch.equal(t.view(me, base + 8 * N * p, (N,), torch.int64).cpu(), payload(p, N, 2))
            raw = t.get(me, base + 8 * N * (W + p), 8 * N)
            assert torch.equal(torch.frombuffer(bytearray(raw), dtype=torch.int64), payload(p, N, 3))
            into = torch.empty(N, dtype=torch.int64)
            t.get_into(p, 0, into)
            assert torch.equal(into, payload(p, N))
            strided = torch.empty(2 * N, dtype=torch.int64)[::2]
            t.get_into(p, 0, strided)
            assert torch.equal(strided, payload(p, N))
        # 4. zero, and a strided view (once every peer finished reading this rank's memory)
        boot.barrier(timeout=30)
        t.zero(me, 0, 8 * 4)
        assert t.view(me, 0, (4,), torch.int64).cpu().tolist() == [0, 0, 0, 0]
        evens = t.view(me, 8 * 4, (N // 2 - 2,), torch.int64, stride=(2,)).cpu()
        assert torch.equal(evens, payload(me, N)[4::2][:N // 2 - 2])
        boot.barrier(timeout=30)
        return "ok"
    finally:
        t.close(unmap=False)


def _message_passing(ctx, name, iters):
    """Rank 0 produces, every other rank consumes: data before a signal is seen after the wait."""
    t, boot = open_transport(ctx, name)
    me, W = ctx.rank, ctx.world_size
    try:
        if me == 0:
            for i in range(1, iters + 1):
                # the consumers took message i-1 (they ack it) before it is overwritten
                t.wait_until([(p, line(4)) for p in range(1, W)], i - 1, timeout=60, op="producer")
                for p in range(1, W):
                    if i % 2:  # odd: put into the consumer's memory
                        t.put(p, 0, payload(0, N, i).to(t.device))
                    else:  # even: write here, the consumer gets it
                        t.view(0, 0, (N,), torch.int64).copy_(payload(0, N, i).to(t.device))
                t.signal(0, line(3), i)
            t.wait_until([(p, line(4)) for p in range(1, W)], iters, timeout=60, op="producer")
        else:
            for i in range(1, iters + 1):
                t.wait_until([(0, line(3))], i, timeout=60, op="consumer")
                if i % 2:
                    got = t.view(me, 0, (N,), torch.int64).cpu()
                else:
                    got = torch.frombuffer(bytearray(t.get(0, 0, 8 * N)), dtype=torch.int64)
                assert torch.equal(got, payload(0, N, i)), (i, got[:4])
                t.signal(me, line(4), i)
        # fetch_add: every rank adds its rank+1 to rank 0's counter line; the sum is exact
        old = t.fetch_add(0, line(5), me + 1)
        assert old >= 0
        t.signal(me, line(6), 1)
        t.wait_until([(r, line(6)) for r in range(W)], 1, timeout=30, op="fetch_add")
        assert t.load(0, line(5)) == W * (W + 1) // 2
        boot.barrier(timeout=30)
        return "ok"
    finally:
        t.close(unmap=False)


def _timeout_names_late(ctx, name):
    """Rank 0 waits for every peer; all but the last signal; the error names exactly the last."""
    t, boot = open_transport(ctx, name)
    me, W = ctx.rank, ctx.world_size
    late = W - 1
    try:
        if me not in (0, late):
            t.signal(me, line(7), 5)
        if me == 0:
            t0 = time.monotonic()
            with pytest.raises(ZbcclTimeoutError) as info:
                t.wait_until([(p, line(7)) for p in range(1, W)], 5, timeout=1.0, op="conformance", liveness=0.2)
            elapsed = time.monotonic() - t0
            assert info.value.ranks == (late,), info.value.ranks
            assert "rank" in str(info.value) and str(late) in str(info.value) and "conformance" in str(info.value)
            assert 0.9 < elapsed < 20, elapsed
            # labels: the message uses the caller's numbering
            with pytest.raises(ZbcclTimeoutError) as info:
                t.wait_until([(late, line(7))], 5, timeout=0.2, labels={late: 40 + late})
            assert info.value.ranks == (40 + late,)
        boot.barrier(timeout=60)
        return "ok"
    finally:
        t.close(unmap=False)


def _peer_death(ctx, name):
    t, boot = open_transport(ctx, name)
    try:
        if ctx.rank == 1:
            t.signal(1, line(8), 1)
            t.wait_until([(0, line(8))], 1, timeout=60, op="go")
            os.kill(os.getpid(), signal.SIGKILL)
        t.wait_until([(1, line(8))], 1, timeout=60, op="ready")
        assert t.dead_peers() == [] and t.unreachable_peers() == []  # alive (it waits for our go)
        assert all(isinstance(t.where(r), str) and t.where(r) for r in range(2))  # (for errors: a host, in words)
        t.signal(0, line(8), 1)
        t0 = time.monotonic()
        with pytest.raises(ZbcclRemoteError) as info:
            t.wait_until([(1, line(9))], 1, timeout=60, op="conformance", liveness=0.2)
        elapsed = time.monotonic() - t0
        assert info.value.ranks == (1,) and "rank" in str(info.value), str(info.value)
        assert elapsed < 15, f"the death of rank 1 took {elapsed:.1f}s to notice"
        assert t.dead_peers() == [1] and t.unreachable_peers() == []  # dead, not cut off
        return "ok"
    finally:
        t.close(unmap=False)


def _growth(ctx, name):
    t, boot = open_transport(ctx, name, reserve=4 * DATA)
    me = ctx.rank
    other = 1 - me
    try:
        early = t.view(me, DATA - 8 * N, (N,), torch.int64)  # a view from before the growth stays valid
        early.copy_(payload(me, N, 9).to(t.device))
        if me == 0:
            with pytest.raises(ZbcclOutOfMemoryError):
                t.grow(4 * DATA + 4096)
            assert t.size(0) == DATA
            t.wait_until([(1, line(13))], 1, timeout=30, op="growth")  # rank 1 checked the old bounds
            t.grow(2 * DATA)
            assert t.size(0) == 2 * DATA
            t.view(0, DATA, (N,), torch.int64).copy_(payload(0, N, 10).to(t.device))
            t.signal(0, line(10), 1)  # release: the size and the data before it
            t.wait_until([(1, line(11))], 1, timeout=30, op="growth")
            assert torch.equal(t.view(0, 2 * DATA - 8 * N, (N,), torch.int64).cpu(), payload(1, N, 11))
        else:
            with pytest.raises(ZbcclInvalidUsageError):  # not grown yet: out of bounds, nothing read
                t.get(0, DATA, 8)
            t.signal(1, line(13), 1)
            t.wait_until([(0, line(10))], 1, timeout=30, op="growth")
            assert t.size(0) == 2 * DATA
            assert torch.equal(torch.frombuffer(bytearray(t.get(0, DATA, 8 * N)), dtype=torch.int64),
                               payload(0, N, 10))
            t.put(0, 2 * DATA - 8 * N, payload(1, N, 11).to(t.device))
            with pytest.raises(ZbcclInvalidUsageError):
                t.put(0, 2 * DATA - 8, payload(1, 2).to(t.device))
            t.signal(1, line(11), 1)
        assert torch.equal(early.cpu(), payload(me, N, 9))
        boot.barrier(timeout=30)
        assert torch.equal(_peer_ints(t, other, DATA - 8 * N, N), payload(other, N, 9))
        boot.barrier(timeout=30)
        return "ok"
    finally:
        t.close(unmap=False)


def _bounds(ctx, name):
    t, boot = open_transport(ctx, name)
    me, W = ctx.rank, ctx.world_size
    peer = 1 - me
    try:
        t.view(me, DATA - 16, (2,), torch.int64).copy_(payload(me, 2).to(t.device))
        boot.barrier(timeout=30)
        size = DATA  # what the peer was set up with: the transport's own answer is under test
        assert t.size(peer) == size and t.size(me) == size
        bad = {
            "view past the end": lambda: t.view(peer, size - 8, (2,), torch.int64),
            "view at a negative offset": lambda: t.view(peer, -8, (1,), torch.int64),
            "misaligned view": lambda: t.view(peer, 4, (1,), torch.int64),
            "strided view past the end": lambda: t.view(peer, 0, (2,), torch.int64, stride=(size // 8,)),
            "put past the end": lambda: t.put(peer, size - 8, payload(me, 2).to(t.device)),
            "put bytes past the end": lambda: t.put(peer, size - 4, b"12345678"),
            "put_many with one piece past the end": lambda: t.put_many(
                peer, [(size - 16, b"\xff" * 8), (size - 4, b"12345678")]),
            "put_async past the end": lambda: t.put_async(peer, size - 8, payload(me, 2).to(t.device)),
            "get past the end": lambda: t.get(peer, size - 4, 8),
            "get_into past the end": lambda: t.get_into(peer, size, torch.empty(1, dtype=torch.int64)),
            "zero past the end": lambda: t.zero(peer, size - 4, 8),
            "a rank out of range": lambda: t.view(W, 0, (1,), torch.int64),
            "a signal line past the pad": lambda: t.signal(peer, t.signal_pad(peer).nbytes, 1),
            "a misaligned signal line": lambda: t.load(peer, line(12) + 4),
            "a pad view past the pad": lambda: t.pad_view(peer, t.signal_pad(peer).nbytes - 8, 16),
        }
        for what, call in bad.items():
            with pytest.raises(ZbcclInvalidUsageError) as info:
                call()
            assert "expected" in str(info.value) and "got" in str(info.value), (what, str(info.value))
        boot.barrier(timeout=30)
        # nothing was touched: the peer's last 16 bytes still hold its payload
        assert torch.equal(_peer_ints(t, peer, DATA - 16, 2), payload(peer, 2))
        assert t.offset_of(peer, torch.empty(4)) == -1
        assert t.offset_of(me, t.view(me, 64, (4,), torch.int64)) == 64
        boot.barrier(timeout=30)
        return "ok"
    finally:
        t.close(unmap=False)


def test_views_and_put_get(transport_name):
    assert run_world(_views_and_put_get, 2, name=transport_name, timeout=120) == ["ok"] * 2


def test_views_and_put_get_world_3(transport_name):
    assert run_world(_views_and_put_get, 3, name=transport_name, timeout=180) == ["ok"] * 3


def test_signal_orders_data_before_it(transport_name):
    assert run_world(_message_passing, 2, name=transport_name, iters=2000, timeout=180) == ["ok"] * 2


def test_wait_timeout_names_the_late_rank(transport_name):
    assert run_world(_timeout_names_late, 3, name=transport_name, timeout=120) == ["ok"] * 3


def test_peer_death_is_reported_not_waited_out(transport_name):
    out = run_world(_peer_death, 2, name=transport_name, timeout=120, expect_exit={1: -signal.SIGKILL})
    assert out[0] == "ok"


def test_growth_is_seen_by_peers(transport_name):
    assert run_world(_growth, 2, name=transport_name, timeout=120) == ["ok"] * 2


def test_out_of_bounds_raises_and_touches_nothing(transport_name):
    assert run_world(_bounds, 2, name=transport_name, timeout=120) == ["ok"] * 2
