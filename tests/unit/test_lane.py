"""The lane of CUDA collectives (ops/route.py) without a GPU: stream ordering and peers' growth.

The lane's inputs are the current stream, whether it captures, and the transport's view of peers'
sizes; here they are stand-ins, and the test checks what the lane does with them.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from zbccl import ZbcclInvalidUsageError
from zbccl.heap.transports.base import Transport as Transport_
from zbccl.ops import route


class Stream:
    def __init__(self, name: str) -> None:
        self.name, self.waited = name, []

    def wait_stream(self, other) -> None:
        self.waited.append(other.name)


class Transport:
    def __init__(self) -> None:
        self.read, self.stale = [], []

    def size(self, rank: int) -> int:
        self.read.append(rank)
        return 4096

    def stale_peers(self, ranks):
        return [r for r in ranks if r in self.stale]

    map_grown = Transport_.map_grown  # the seam's default: each peer's size


@pytest.fixture
def cuda(monkeypatch):
    state = SimpleNamespace(stream=Stream("s0"), capturing=False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: state.stream)
    monkeypatch.setattr(route, "_stream_key", lambda: (0, state.stream.name))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state.capturing)
    return state


def _comm():
    transport, ops = Transport(), object()
    heap = SimpleNamespace(transport=transport)
    comm = SimpleNamespace(device_state={"cuda": ops}, ranks=(0, 1, 2), global_rank=1,
                           device_heap=lambda device, op="device_heap": heap)
    return comm, ops, transport


def test_a_stream_change_waits_for_the_previous_op_and_nothing_else_does(cuda):
    comm, ops, _ = _comm()
    s0 = cuda.stream
    assert route.lane(comm, "cuda", "all_reduce") is ops
    route.lane(comm, "cuda", "all_reduce")
    assert s0.waited == []  # same stream: no wait
    cuda.stream = s1 = Stream("s1")
    route.lane(comm, "cuda", "all_gather")
    assert s1.waited == ["s0"]  # the new stream waits for the communicator's last op
    route.lane(comm, "cuda", "all_gather")
    assert s1.waited == ["s0"]


def test_eager_ops_map_peers_growth_and_captures_do_not(cuda):
    comm, _, transport = _comm()
    route.lane(comm, "cuda", "all_reduce")
    assert transport.read == [0, 2]  # every peer's size, which maps what it grew by
    cuda.capturing, cuda.stream = True, Stream("capture")
    route.lane(comm, "cuda", "all_reduce")
    assert transport.read == [0, 2] and cuda.stream.waited == []  # nothing mapped, no wait on uncaptured work
    transport.stale = [2]
    with pytest.raises(ZbcclInvalidUsageError, match=r"all_reduce: the heaps of ranks \[2\] grew since this rank "
                                                     r"last mapped them") as info:
        route.lane(comm, "cuda", "all_reduce")
    assert info.value.ranks == (2,)


def test_device_ops_are_not_made_inside_a_capture(cuda, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    cuda.capturing = True
    with pytest.raises(ZbcclInvalidUsageError, match="all_reduce: first cuda collective of this communicator "
                                                     "inside a CUDA graph capture"):
        route.make_device_ops(SimpleNamespace(), "cuda", "all_reduce")


def test_a_transport_with_map_grown_maps_every_peer_in_one_call(cuda):
    """The cuda transport's ``map_grown`` (one load per peer, a map only for those that grew) replaces the
    per-peer ``size`` reads; a capture still only asks ``stale_peers``."""
    comm, _, transport = _comm()
    calls = []
    transport.map_grown = lambda ranks: calls.append(list(ranks))
    route.lane(comm, "cuda", "all_reduce")
    route.lane(comm, "cuda", "all_gather")
    assert calls == [[0, 2], [0, 2]] and transport.read == []
    cuda.capturing = True
    route.lane(comm, "cuda", "all_reduce")
    assert len(calls) == 2
