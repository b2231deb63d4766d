"""The Mooncake liveness monitor's verdict on a failed transfer (``Monitor.settled``), with the network probe
stood in: a probe of a killed process's port can go unanswered once before it is refused."""

from __future__ import annotations

from types import SimpleNamespace

from zbccl.heap.transports.mooncake import liveness


def _monitor(monkeypatch, answers: list[str]):
    calls = []

    def probe(ip, port, timeout):
        calls.append(port)
        return answers.pop(0) if answers else "dead"

    monkeypatch.setattr(liveness, "probe", probe)
    peers = {1: SimpleNamespace(ip="10.0.0.2", port=7001)}
    return liveness.Monitor(engine=None, peers=peers, scratch=0, period=1.0, stall=5.0), calls


def test_an_unanswered_probe_then_a_refusal_is_a_dead_rank(monkeypatch):
    mon, calls = _monitor(monkeypatch, ["unreachable", "dead"])
    assert mon.settled(1) == "dead" and len(calls) == 2
    assert mon.verdict([1]) == ([1], [])  # dead, and no longer counted unreachable


def test_a_host_that_stays_silent_is_unreachable(monkeypatch):
    mon, calls = _monitor(monkeypatch, ["unreachable", "unreachable"])
    assert mon.settled(1) == "unreachable" and len(calls) == 2
    assert mon.verdict([1]) == ([], [1])


def test_a_live_peer_is_asked_again_until_it_refuses(monkeypatch):
    mon, calls = _monitor(monkeypatch, ["alive", "alive", "dead"])
    assert mon.settled(1) == "dead" and len(calls) == 3
