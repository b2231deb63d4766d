"""The lane of CUDA collectives (ops/route.py) without a GPU: stream ordering.

The lane's inputs are the current stream and whether it captures; here they are stand-ins, and the
test checks what the lane does with them. (Peers' growth needs nothing of the lane: the cuda transport's
``grow`` returns once every peer mapped it, tests/multiproc/test_cuda_sim.py.)
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from zbccl import ZbcclInvalidUsageError
from zbccl.ops import route


class Stream:
    def __init__(self, name: str) -> None:
        self.name, self.waited = name, []

    def wait_stream(self, other) -> None:
        self.waited.append(other.name)


@pytest.fixture
def cuda(monkeypatch):
    state = SimpleNamespace(stream=Stream("s0"), capturing=False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: state.stream)
    monkeypatch.setattr(route, "_stream_key", lambda: (0, state.stream.name))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state.capturing)
    return state


def _comm():
    ops = object()
    return SimpleNamespace(device_state={"cuda": ops}), ops


def test_a_stream_change_waits_for_the_previous_op_and_nothing_else_does(cuda):
    comm, ops = _comm()
    s0 = cuda.stream
    assert route.lane(comm, "cuda", "all_reduce") is ops
    route.lane(comm, "cuda", "all_reduce")
    assert s0.waited == []  # same stream: no wait
    cuda.stream = s1 = Stream("s1")
    route.lane(comm, "cuda", "all_gather")
    assert s1.waited == ["s0"]  # the new stream waits for the communicator's last op
    route.lane(comm, "cuda", "all_gather")
    assert s1.waited == ["s0"]


def test_a_capture_takes_the_lane_without_waiting_on_uncaptured_work(cuda):
    comm, _ = _comm()
    route.lane(comm, "cuda", "all_reduce")
    cuda.capturing, cuda.stream = True, Stream("capture")
    route.lane(comm, "cuda", "all_reduce")
    assert cuda.stream.waited == []  # a capture may not wait on uncaptured work
    cuda.capturing, after = False, Stream("after")
    cuda.stream = after
    route.lane(comm, "cuda", "all_reduce")
    assert after.waited == ["capture"]  # the lane moved to the capturing stream


def test_device_ops_are_not_made_inside_a_capture(cuda, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    cuda.capturing = True
    with pytest.raises(ZbcclInvalidUsageError, match="all_reduce: first cuda collective of this communicator "
                                                     "inside a CUDA graph capture"):
        route.make_device_ops(SimpleNamespace(), "cuda", "all_reduce")
