"""The per-rank choice between cached and streaming stores for large twoshot gathers."""

from __future__ import annotations

import pytest

from zbccl.errors import ZbcclInvalidUsageError
from zbccl.ops.tuner import StoreKind


class FakeCore:
    """Records chan_configure calls; ``rates`` are the op's ns per byte by store kind."""

    def __init__(self, rate_cached: float, rate_stream: float) -> None:
        self.rates = [rate_cached, rate_stream]
        self.stream_bytes = None
        self.configured: list[int] = []

    def chan_configure(self, handle: int, stream_bytes: int) -> None:
        self.stream_bytes = stream_bytes
        self.configured.append(stream_bytes)


class FakeChan:
    def __init__(self, core: FakeCore) -> None:
        self.prims, self.handle = core, 1


def run(kind: StoreKind, n: int) -> list[int]:
    used = []
    nbytes = 64 << 20
    for _ in range(n):
        kind.before(nbytes)
        used.append(kind.current)
        kind.after(nbytes, int(kind.ch.prims.rates[kind.current] * nbytes))
    return used


@pytest.mark.parametrize("cached,stream,winner", [(1.0, 2.0, 0), (2.0, 1.0, 1)])
def test_picks_the_faster_kind_and_keeps_exploring(monkeypatch, cached, stream, winner):
    monkeypatch.delenv("ZBCCL_STREAM_STORES", raising=False)
    kind = StoreKind(FakeChan(FakeCore(cached, stream)))
    used = run(kind, 64)
    assert used[:4] == [0, 1, 0, 1]  # warms up and measures both first
    settled = used[4:]
    assert settled.count(winner) >= len(settled) - len(settled) // StoreKind.EXPLORE - 1
    assert 1 - winner in settled  # still explores the other kind now and then


def test_host_state_change_is_followed(monkeypatch):
    monkeypatch.delenv("ZBCCL_STREAM_STORES", raising=False)
    core = FakeCore(1.0, 2.0)
    kind = StoreKind(FakeChan(core))
    assert run(kind, 30)[-8:] == [0] * 8
    # each size bucket learns on its own
    assert len(kind.stats) == 1
    core.rates = [4.0, 2.0]  # the host flips: cached stores become slow
    used = run(kind, 64)
    assert used[-8:].count(1) >= 7


def test_small_ops_and_fixed_modes(monkeypatch):
    monkeypatch.setenv("ZBCCL_STREAM_STORES", "on")
    core = FakeCore(1.0, 2.0)
    kind = StoreKind(FakeChan(core))
    run(kind, 10)
    assert kind.current == 1 and core.configured == [StoreKind.SLICE_BYTES]
    monkeypatch.setenv("ZBCCL_STREAM_STORES", "auto")
    kind = StoreKind(FakeChan(FakeCore(1.0, 2.0)))
    kind.before(4096)  # below MIN_BYTES: ignored
    kind.after(4096, 1000)
    assert kind.stats == {}
    monkeypatch.setenv("ZBCCL_STREAM_STORES", "sometimes")
    with pytest.raises(ZbcclInvalidUsageError, match="ZBCCL_STREAM_STORES"):
        StoreKind(FakeChan(FakeCore(1.0, 2.0)))
