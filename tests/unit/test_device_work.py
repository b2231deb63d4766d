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
