"""The per-rank store-kind policy of EP dispatch pulls (``zbccl.ep.stores.PullStores``)."""

from __future__ import annotations

import pytest

from zbccl.ep import stores
from zbccl.ep.stores import EXPLORE_OPS, MIN_BYTES, STALE_S, PullStores


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_fixed_kinds_ignore_measurements():
    for mode in (0, 1):
        p = PullStores(mode)
        p.record(1 - mode, MIN_BYTES, 1)
        assert p.choose(MIN_BYTES) == mode and p.choose(1) == mode


def test_auto_measures_both_then_follows_the_faster_and_re_samples_the_other():
    clock = Clock()
    p = PullStores(-1, clock=clock)
    assert p.choose(MIN_BYTES - 1) == 0  # small pulls: cached, not sampled
    big = 4 << 20
    assert p.choose(big) == 0  # cached first
    p.record(0, big, 50 * big)  # a slow first pull (a fresh block)
    assert p.choose(big) == 1  # streaming not measured yet
    p.record(1, big, 1 * big)  # 1 ns/byte
    assert p.choose(big) == 0  # FIRST_SAMPLES (2) of each before trusting either
    p.record(0, big, 5 * big)  # 5 ns/byte
    assert p.choose(big) == 1
    p.record(1, big, 1 * big)
    assert p.choose(big) == 1  # streaming is faster
    for _ in range(EXPLORE_OPS - 2):
        p.record(1, big, big)
    assert p.choose(big) == 1
    p.record(1, big, big)  # the cached kind has not been sampled for EXPLORE_OPS pulls
    assert p.choose(big) == 0
    p.record(0, big, big // 2)  # the state flipped: cached is now faster (0.5 ns/byte)
    assert p.choose(big) == 0
    clock.t += STALE_S  # streaming's samples are old: sample it again
    assert p.choose(big) == 1
    assert p.rates() == {"cached": 0.5, "streaming": 1.0}


def test_a_slow_first_sample_does_not_decide():
    p = PullStores(-1, clock=Clock())
    big = 4 << 20
    for kind, ns in ((0, 9), (1, 2), (0, 1), (1, 2)):  # cached: slow first pull, then the real 1 ns/byte
        assert p.choose(big) == kind
        p.record(kind, big, ns * big)
    assert p.choose(big) == 0


def test_rate_is_the_least_of_the_last_samples():
    p = PullStores(-1, clock=Clock())
    big = MIN_BYTES
    for ns in (9, 3, 7, 8, 8):  # the 3 stays among the last SAMPLES (4)
        p.record(0, big, ns * big)
    assert p.rates()["cached"] == 3
    p.record(0, big, 8 * big)  # now it falls out
    assert p.rates()["cached"] == 7


def test_bad_environment_is_refused(monkeypatch):
    import zbccl

    monkeypatch.setenv("ZBCCL_STREAM_STORES", "sometimes")
    with pytest.raises(zbccl.ZbcclInvalidUsageError, match="ZBCCL_STREAM_STORES"):
        stores.PullStores()
    monkeypatch.setenv("ZBCCL_STREAM_STORES", "on")
    assert stores.PullStores().mode == 1
