"""The pause rule of the waits between hosts (``heap/transports/base.pause``): yield while hot, then naps from
10 us doubling to 100 us, later an eighth of the time waited, never over the cap nor past the deadline."""

from __future__ import annotations

import pytest

from zbccl.heap.transports import base


@pytest.fixture
def naps(monkeypatch):
    got: list[int] = []
    monkeypatch.setattr(base, "_nap", got.append)
    yields: list[int] = []
    monkeypatch.setattr(base.os, "sched_yield", lambda: yields.append(1))
    return got, yields


def test_hot_phase_yields_and_never_naps(naps):
    got, yields = naps
    assert base.pause(100e-6, 0.0, hot=200e-6, left=1.0) == 0.0
    assert base.pause(100e-6, 0.0, hot=200e-6, left=1.0, spin=False) == 0.0  # (remote polls: back to back)
    assert got == [] and len(yields) == 1


def test_naps_double_from_10us_to_100us_then_an_eighth_of_the_wait(naps):
    got, _ = naps
    p, waited = 0.0, 300e-6
    for _ in range(6):
        p = base.pause(waited, p, hot=200e-6, left=1.0)
    assert got == [10_000, 20_000, 40_000, 80_000, 100_000, 100_000]
    p = base.pause(4e-3, p, hot=200e-6, left=1.0)  # waited 4 ms: up to 0.5 ms
    assert got[-1] == 200_000  # (doubling from 100 us)
    for _ in range(3):
        p = base.pause(4e-3, p, hot=200e-6, left=1.0)
    assert got[-3:] == [400_000, 500_000, 500_000]
    p = base.pause(60.0, p, hot=200e-6, left=1.0, cap=1e-3)
    assert got[-1] == 1_000_000  # never over the cap


def test_a_nap_never_passes_the_deadline(naps):
    got, _ = naps
    base.pause(1.0, 0.5e-3, hot=0.0, left=30e-6)
    base.pause(1.0, 0.5e-3, hot=0.0, left=-1.0)
    assert got == [30_000, 0]


def test_without_a_native_core_the_naps_are_sleeps(monkeypatch):
    monkeypatch.setattr(base, "_nap", None)
    from zbccl import native

    def broken():
        raise RuntimeError("no compiler")

    monkeypatch.setattr(native, "core", broken)
    slept: list[float] = []
    monkeypatch.setattr(base.time, "sleep", slept.append)
    base.pause(1e-3, 0.0, hot=0.0, left=1.0)
    assert slept == [pytest.approx(10e-6)]
