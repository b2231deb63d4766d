"""The host side of CUDA Work objects that runs without a GPU: the bounded, backing-off event wait."""

from __future__ import annotations

import pytest

from zbccl import ZbcclTimeoutError
from zbccl.adapters.device_work import wait_event


class Event:
    """An event that completes after ``pending`` queries (``None``: never)."""

    def __init__(self, pending: int | None) -> None:
        self.pending, self.queries = pending, 0

    def query(self) -> bool:
        self.queries += 1
        return self.pending is not None and self.queries > self.pending


def test_wait_returns_once_the_event_completed_and_checks_every_step():
    ev, checks = Event(3), []
    wait_event(ev, 5.0, check=lambda: checks.append(1), op="synchronize")
    assert ev.queries == 4 and len(checks) == 4  # one check per pending query, one at the end


def test_a_device_side_error_raises_while_waiting():
    ev = Event(None)

    def check():
        if ev.queries >= 2:
            raise ZbcclTimeoutError("all_reduce: timed out waiting for ranks [1]", ranks=(1,))

    with pytest.raises(ZbcclTimeoutError, match=r"ranks \[1\]") as info:
        wait_event(ev, 5.0, check=check, op="synchronize")
    assert info.value.ranks == (1,)


def test_an_event_that_never_completes_times_out():
    with pytest.raises(ZbcclTimeoutError, match="synchronize: the device op did not complete in 0.1s"):
        wait_event(Event(None), 0.1, check=lambda: None, op="synchronize")


class Stream:
    """A stand-in for a CUDA stream: records the events it was made to wait on."""

    device = "cuda:0"

    def __init__(self) -> None:
        self.waited: list = []

    def wait_event(self, ev) -> None:
        self.waited.append(ev)


class Ops:
    """A stand-in for DeviceOps: ``check()`` raises ``error`` once set."""

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self.checks = 0

    def check(self) -> None:
        self.checks += 1
        if self.error is not None:
            raise self.error


def _work(monkeypatch, *, captured=False, pending=0):
    import torch

    from zbccl.adapters.device_work import DeviceWork

    current = Stream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    ev, ops = Event(pending), Ops()
    work = DeviceWork([torch.ones(2)], ev, Stream(), ops, timeout=5.0, captured=captured)
    return work, ev, ops, current


def test_wait_orders_the_current_stream_and_never_blocks(monkeypatch):
    work, ev, ops, current = _work(monkeypatch, pending=None)  # the op never completes on the device
    assert work.wait() is True  # returns at once: only the stream waits
    assert current.waited == [ev] and ops.checks == 1 and ev.queries == 0
    assert not work.is_completed()


def test_wait_raises_what_the_kernels_reported(monkeypatch):
    work, ev, ops, _ = _work(monkeypatch, pending=0)
    ops.error = ZbcclTimeoutError("all_reduce: timed out waiting for group rank(s) [1]", ranks=(1,))
    with pytest.raises(ZbcclTimeoutError, match=r"rank\(s\) \[1\]"):
        work.wait()
    assert work.is_completed() and not work.is_success() and isinstance(work.exception(), ZbcclTimeoutError)


def test_synchronize_blocks_until_the_event_completed(monkeypatch):
    work, ev, ops, _ = _work(monkeypatch, pending=3)
    work.synchronize()
    assert ev.queries == 4 and work.is_completed() and work.is_success() and work.exception() is None


def test_a_captured_work_orders_streams_but_refuses_host_waits(monkeypatch):
    from zbccl import ZbcclInvalidUsageError

    work, ev, ops, current = _work(monkeypatch, captured=True, pending=None)
    assert work.wait() and current.waited == [ev] and ops.checks == 0  # no status read inside a capture
    for what in (work.is_completed, work.synchronize):
        with pytest.raises(ZbcclInvalidUsageError, match="captured in a CUDA graph and runs at each replay"):
            what()
