"""The stamped steps of the mesh across hosts (ops/hosts/mesh.py): a step counts as arrived only once
its stamp and every byte it covers have landed, in whatever order the engine delivered them."""

from __future__ import annotations

import time
from collections.abc import Sequence
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.threads import run_threads
from zbccl.heap.transports.base import Pending
from zbccl.ops.hosts import mesh as mesh_mod
from zbccl.ops.hosts.mesh import ORDERED, STAMP, Mesh, part, region_bytes

SLOT = 4096
REGION = region_bytes(2, SLOT)


class _Memory:
    """Two ranks' heaps in this process, reached only by copies: a transport that can view nothing remote."""

    def __init__(self) -> None:
        self.heaps = {r: torch.zeros(2 * REGION, dtype=torch.uint8) for r in (0, 1)}

    def viewable(self, rank: int) -> bool:
        return False

    def view(self, rank, offset, shape, dtype, *, op="view"):
        n = int(np.prod(shape)) * dtype.itemsize
        return self.heaps[rank][offset:offset + n].view(dtype).view(shape)

    def put(self, rank, offset, src, *, op="put"):
        self.heaps[rank][offset:offset + src.numel()].copy_(src)

    def put_many(self, rank, pieces, *, op="put"):
        for offset, src in pieces:
            self.put(rank, offset, src, op=op)

    def put_async(self, rank, offset, src, *, op="put"):
        """A write that lands late, when first polled (the mesh polls its writes while it waits), from a copy of
        the source taken then: the mesh must keep its staging buffer unchanged until it landed, across the
        step's return (a step returns once the peer's bytes are here, its own last write maybe still in
        flight)."""
        memory = self

        class _Late(Pending):
            def done(self):
                memory.put(rank, offset, src.clone())
                return True

        return _Late()


class _SlowMemory(_Memory):
    """Writes that land on their own a few milliseconds after they start, from the source as it is then (an
    engine's threads): a step returns before its own last write landed, and the mesh must leave that write's
    staging buffer alone until it did; a write that lands from a buffer refilled early delivers wrong bytes."""

    def put_async(self, rank, offset, src, *, op="put"):
        import threading

        landed = threading.Event()

        def land():
            self.put(rank, offset, src.clone())
            landed.set()

        threading.Timer(0.003, land).start()

        class _Flying(Pending):
            def done(self):
                return landed.is_set()

        return _Flying()


def _meshes(memory):
    out = []
    for r in (0, 1):
        ctx = SimpleNamespace(rank=r, heap=SimpleNamespace(transport=memory))
        out.append(Mesh(ctx, [0, 1], [REGION, REGION], SLOT, 0, SimpleNamespace(interval=1.0)))
    return out


def _payload(src: int, n: int, salt: int = 0) -> torch.Tensor:
    return ((torch.arange(n, dtype=torch.int64) * 7 + 131 * src + salt) % 251).to(torch.uint8)


def _sealed(mesh) -> torch.Tensor:
    """The stamp ``mesh.seal`` filled last, as bytes."""
    return torch.from_numpy(mesh._out.view(np.uint8))


def _slot(memory, owner: int, parity: int, src: int) -> torch.Tensor:
    at = REGION + (parity * 2 + src) * (STAMP + SLOT)
    return memory.heaps[owner][at:at + STAMP + SLOT]


def test_a_step_is_seen_only_once_every_byte_it_covers_landed():
    memory = _Memory()
    m0, m1 = _meshes(memory)
    data = _payload(0, 3000)
    assert not m0.seal(1, [part(0, data[:1000]), part(1000, data[1000:])])  # mode 0: the check covers the bytes
    slot = _slot(memory, 1, 1, 0)
    slot[:STAMP].copy_(_sealed(m0))  # the stamp landed first, no byte yet
    assert not m1._here(0, 1)
    slot[STAMP:STAMP + 1500].copy_(data[:1500])  # half the bytes
    assert not m1._here(0, 1)
    slot[STAMP + 1500:STAMP + 2999].copy_(data[1500:2999])  # all but the last byte
    assert not m1._here(0, 1)
    slot[STAMP + 2999] = data[2999]
    assert m1._here(0, 1)
    assert torch.equal(m1.view(1, 0, 3000), data)


def test_a_torn_or_stale_stamp_never_passes():
    memory = _Memory()
    m0, m1 = _meshes(memory)
    data = _payload(0, 2048)
    slot = _slot(memory, 1, 1, 0)
    m0.seal(1, [part(0, data)])
    good = _sealed(m0).clone()
    slot[STAMP:STAMP + 2048].copy_(data)
    torn = good.clone()
    torn[16:24] = 0  # the step word landed, the first length word not yet
    slot[:STAMP].copy_(torn)
    assert not m1._here(0, 1)
    m0.seal(3, [part(0, data)])  # a stamp of another step over the same bytes
    slot[:STAMP].copy_(_sealed(m0))
    assert not m1._here(0, 1)
    slot[:STAMP].copy_(good)
    assert m1._here(0, 1)


def test_an_ordered_step_checks_its_stamp_only():
    big = ORDERED + 64
    memory = _Memory()
    m0, _ = _meshes(memory)
    assert m0.seal(5, [part(0, torch.zeros(big, dtype=torch.uint8))])
    assert int(m0._out[5]) == 1


@pytest.mark.parametrize("slow", [False, True], ids=["polled", "late"])
@pytest.mark.parametrize("ordered", [False, True], ids=["one-write", "ordered"])
@pytest.mark.parametrize("nbytes", [0, 8, 3000, SLOT - 256])
def test_steps_between_two_meshes_deliver_every_byte(nbytes, ordered, slow, monkeypatch):
    if ordered:  # every step with bytes writes them, then (once they landed) its stamp
        monkeypatch.setattr(mesh_mod, "ORDERED", 0)
    memory = _SlowMemory() if slow else _Memory()
    meshes = _meshes(memory)
    got = {}

    def run(r):
        m = meshes[r]
        for s in range(1, 7):
            piece = _payload(r, nbytes, s)
            pieces = [None, None]
            pieces[1 - r] = piece
            at = 256 if nbytes < SLOT - 256 else 0
            parity = m.step(pieces, op="test", timeout=30, at=at)
            got[(r, s)] = m.view(parity, 1 - r, at + nbytes)[at:].clone()

    errors = run_threads([lambda: run(0), lambda: run(1)], timeout=60)
    assert not errors, errors
    for r in (0, 1):
        for s in range(1, 7):
            assert torch.equal(got[(r, s)], _payload(1 - r, nbytes, s)), (r, s)


def test_the_region_holds_two_parities_of_stamped_slots():
    assert region_bytes(3, 1000) == 2 * 3 * (STAMP + 1000)
    assert mesh_mod.STAMP % 64 == 0


def test_drain_waits_for_writes_left_in_flight_and_gives_up_in_time():
    """``Mesh.drain`` (``HostOps.close``): writes a failed step left in flight are polled until they land, a
    failing one is dropped (its error was the op's), one that never lands is left after the bound."""
    from zbccl.errors import ZbcclRemoteError

    class _After(Pending):
        def __init__(self, polls, fail=False):
            self.polls, self.fail = polls, fail

        def done(self):
            self.polls -= 1
            if self.polls > 0:
                return False
            if self.fail:
                raise ZbcclRemoteError("lost", ranks=(1,))
            return True

    m0, _ = _meshes(_Memory())
    m0.track(1, _After(3))
    m0.track(1, _After(2, fail=True))
    m0.drain(5.0)
    assert m0._sent == []
    never = _After(1 << 30)
    m0.track(1, never)
    t = time.monotonic()
    m0.drain(0.05)
    assert time.monotonic() - t < 2.0 and m0._sent == [(1, never)]


def test_the_extent_of_a_step_is_what_its_stamp_covers():
    """What a member wrote into a slot ends where its stamp says: bytes past it are an older step's."""
    memory = _Memory()
    m0, m1 = _meshes(memory)
    old, new = _payload(0, 2000, salt=1), _payload(0, 300, salt=2)
    for step, parts in ((1, [(0, old)]), (3, [(0, new[:100]), (100, new[100:])])):
        m0.seal(step, [part(at, piece) for at, piece in parts])
        slot = _slot(memory, 1, 1, 0)
        slot[:STAMP].copy_(_sealed(m0))
        for at, piece in parts:
            slot[STAMP + at:STAMP + at + piece.numel()].copy_(piece)
        assert m1._here(0, step)
    assert m1.extent(1, 0) == 300  # step 3 wrote 300 bytes; the 1700 after them are step 1's
    assert torch.equal(m1.view(1, 0, 2000)[300:], old[300:])


class _Ranks:
    """Ranks' heaps and pads in this process, ``host[r]`` the host of rank ``r`` (two per host by default): a rank
    views (puts into and signals) the ranks of its host and reaches the others only by writes that land when
    polled. Counts every write per pair."""

    def __init__(self, region: int, host: Sequence[int] = (0, 0, 1, 1)) -> None:
        self.host = list(host)
        self.heaps = {r: torch.zeros(2 * region, dtype=torch.uint8) for r in range(len(host))}
        self.pads = {r: torch.zeros(4096, dtype=torch.uint8) for r in range(len(host))}
        self.writes: dict[tuple[int, int], int] = {}

    def transport(self, me: int):
        shared = self

        class _T(_Memory):
            def __init__(self):
                self.heaps, self.pads = shared.heaps, shared.pads

            def viewable(self, rank):
                return shared.host[rank] == shared.host[me]

            def put_async(self, rank, offset, src, *, op="put"):
                assert not self.viewable(rank)
                shared.writes[(me, rank)] = shared.writes.get((me, rank), 0) + 1
                return super().put_async(rank, offset, src, op=op)

            def signal(self, rank, line, value):
                shared.pads[rank].view(torch.int64)[line // 8] = value

            def load(self, rank, line):
                return int(shared.pads[rank].view(torch.int64)[line // 8])

        return _T()

    def meshes(self, region: int) -> list:
        n = len(self.host)
        topo = SimpleNamespace(host_of=lambda g: self.host[g])
        return [Mesh(SimpleNamespace(rank=r, heap=SimpleNamespace(transport=self.transport(r)), topology=topo),
                     list(range(n)), [region] * n, SLOT, 0, SimpleNamespace(interval=1.0)) for r in range(n)]


@pytest.mark.parametrize("nbytes", [0, 100, 1500, 3000])
def test_relayed_steps_deliver_every_byte_and_cross_once_per_host(nbytes):
    """Two hosts of two: a member's small step for both members of another host goes in one write to the one with
    its own index there, which passes the other's on (checked by the receiver as a direct write); steps too
    big to ride together go directly. Every byte arrives either way (payload = f(source, receiver, step))."""
    region = region_bytes(4, SLOT)
    four = _Ranks(region)
    meshes = four.meshes(region)
    assert [m.relays for m in meshes] == [[None, None, None, 2], [None, None, 3, None],
                                         [None, 0, None, None], [1, None, None, None]]
    assert [m.relayed_by for m in meshes] == [[None, None, None, 1], [None, None, 0, None],
                                             [None, 3, None, None], [2, None, None, None]]
    got = {}

    def run(r):
        m = meshes[r]
        for s in range(1, 7):
            pieces = [None if j == r else _payload(4 * r + j, nbytes, s) for j in range(4)]
            parity = m.step(pieces, op="test", timeout=30, at=64)
            for j in range(4):
                if j != r:
                    got[(j, r, s)] = m.view(parity, j, 64 + nbytes)[64:].clone()

    errors = run_threads([lambda r=r: run(r) for r in range(4)], timeout=60)
    assert not errors, errors
    for (j, r, s), bytes_ in got.items():
        assert torch.equal(bytes_, _payload(4 * j + r, nbytes, s)), (j, r, s)
    end = (64 + nbytes + 63) // 64 * 64  # each step's bytes, 64-byte aligned in the relay's write
    rides = end + STAMP + end <= min(ORDERED, SLOT)
    for a, b in ((0, 3), (1, 2), (2, 1), (3, 0)):  # the pairs whose steps ride when they fit
        assert four.writes.get((a, b), 0) == (0 if rides else 6), (a, b, four.writes)
    for a, b in ((0, 2), (1, 3), (2, 0), (3, 1)):
        assert four.writes[(a, b)] == 6


def test_a_bad_relayed_step_is_refused():
    """A verified relayed step whose rider is for a member of another host is an error, never a write there."""
    region = region_bytes(4, SLOT)
    four = _Ranks(region)
    m0, _, m2, _ = four.meshes(region)
    body = torch.zeros(STAMP, dtype=torch.uint8)
    body.view(torch.int64)[0], body.view(torch.int64)[7] = 1, 1  # step 1, for member 1 (on m2's other host)
    m0.seal(1, [], relay=(body.data_ptr(), STAMP))
    slot = four.heaps[2][region + (1 * 4 + 0) * (STAMP + SLOT):]
    slot[:STAMP].copy_(_sealed(m0))
    slot[STAMP:2 * STAMP].copy_(body)
    with pytest.raises(AssertionError, match="bad relayed step"):
        m2._here(0, 1)


def test_a_missing_relay_is_named_not_the_members_it_relays():
    """Two hosts of two, rank 3 never steps: rank 1's step for rank 2 rides with rank 3, which never passes it on;
    rank 2's timeout names rank 3 alone (the cause), as ranks 0 and 1 do."""
    from zbccl.errors import ZbcclTimeoutError

    region = region_bytes(4, SLOT)
    four = _Ranks(region)
    meshes = four.meshes(region)
    checked = []
    for m in meshes:
        m.watch = SimpleNamespace(interval=0.05, labels={g: g for g in range(4)}, where=lambda g: f"host {g // 2}",
                                  check=lambda members, pending, op, **kw: checked.append(
                                      (sorted(pending), sorted(set(kw.get("watched", ()))))))
    named = {}

    def run(r):
        with pytest.raises(ZbcclTimeoutError) as info:
            meshes[r].step([None if j == r else _payload(4 * r + j, 100, 1) for j in range(4)], op="test",
                           timeout=0.3)
        named[r] = info.value.ranks

    errors = run_threads([lambda r=r: run(r) for r in range(3)], timeout=60)
    assert not errors, errors
    assert named == {0: (3,), 1: (3,), 2: (3,)}, named
    # rank 2's liveness checks name rank 3 as late and watch rank 1 (late behind it) and its relay 3 for failures
    assert ([3], [1, 3]) in checked, checked


@pytest.mark.parametrize("host, relays", [
    ((0, 0, 1, 1, 2, 2), [[None, None, None, 2, None, 4], [None, None, 3, None, 5, None]]),  # 3 x 2
    ((0, 0, 1), [[None, None, None], [None, None, None], [None, 0, None]]),  # 2 + 1: rank 1 has no peer at index 1
])
def test_relays_on_other_layouts_deliver_every_byte(host, relays):
    """Three hosts of two (a step rides to each other host's relay), and a host of one beside a host of two (its
    rank relays to rank 0 what rank 1 gets; rank 1, index 1, has no counterpart there and writes directly)."""
    n = len(host)
    region = region_bytes(n, SLOT)
    ranks = _Ranks(region, host)
    meshes = ranks.meshes(region)
    assert [m.relays for m in meshes][:len(relays)] == relays
    got = {}

    def run(r):
        m = meshes[r]
        for s in range(1, 5):
            pieces = [None if j == r else _payload(n * r + j, 300 + 7 * j, s) for j in range(n)]
            parity = m.step(pieces, op="test", timeout=30)
            for j in range(n):
                if j != r:
                    got[(j, r, s)] = m.view(parity, j, 300 + 7 * r).clone()

    errors = run_threads([lambda r=r: run(r) for r in range(n)], timeout=60)
    assert not errors, errors
    for (j, r, s), bytes_ in got.items():
        assert torch.equal(bytes_, _payload(n * j + r, 300 + 7 * r, s)), (j, r, s)
    for a, m in enumerate(meshes):  # a member with a relay there is never written to directly
        for b, relay in enumerate(m.relays):
            if relay is not None:
                assert (a, b) not in ranks.writes and ranks.writes[(a, relay)] == 4, (a, b, ranks.writes)


@pytest.mark.parametrize("ordered", [False, True], ids=["one-write", "ordered"])
def test_loopback_runs_steps_alone_and_reaches_no_peer(ordered, monkeypatch):
    """``Mesh.loopback`` (``zbccl bench --hosts 2 --cpu``): a member's steps complete with no peer, each write
    landing in its own slot of the other member as that member's would; nothing reaches the other's memory, and
    the transport is back afterwards. A write outside the slots (an op's direct put) raises."""
    if ordered:
        monkeypatch.setattr(mesh_mod, "ORDERED", 0)
    memory = _Memory()
    m0, _ = _meshes(memory)
    before = memory.heaps[1].clone()
    with m0.loopback():
        for s in range(1, 5):
            piece = _payload(0, 1000, s)
            parity = m0.step([None, piece], op="test", timeout=5, at=64)
            assert torch.equal(m0.view(parity, 1, 64 + 1000)[64:], piece)
        with pytest.raises(AssertionError, match="outside the other member's region"):
            m0.t.put_async(1, 0, torch.zeros(8, dtype=torch.uint8))  # (the region is at REGION)
    assert torch.equal(memory.heaps[1], before)
    assert m0.t is memory


def test_loopback_needs_two_members_on_two_hosts():
    from zbccl.errors import ZbcclInvalidUsageError

    ctx = SimpleNamespace(rank=0, heap=SimpleNamespace(transport=_Memory()))
    three = Mesh(ctx, [0, 1, 2], [0, REGION, REGION], SLOT // 2, 0, SimpleNamespace(interval=1.0))
    with pytest.raises(ZbcclInvalidUsageError, match="two members"):
        with three.loopback():
            pass
