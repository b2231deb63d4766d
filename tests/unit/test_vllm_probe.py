"""The vLLM probe's skew-free measure: time from the last rank's entry to the last rank's exit."""

from __future__ import annotations

from zbccl.integrations.vllm import probe


def _worker(spans: dict[str, list[tuple[int, int]]]) -> dict:
    return {"spans": spans, "times": {k: (len(v), sum(b - a for a, b in v)) for k, v in spans.items()}}


def test_last_arrival_drops_the_wait_for_the_later_rank():
    # call 0: rank 1 arrives 900 ns late, both leave 100 ns after it -> 100 (+ 20 for rank 0's later exit)
    # call 1: rank 0 arrives late; the op takes 50 after it
    r0 = _worker({"tp.all_reduce": [(0, 1020), (5000, 5050)]})
    r1 = _worker({"tp.all_reduce": [(900, 1000), (4000, 5040)]})
    assert probe.last_arrival_ns([r0, r1]) == {"tp.all_reduce": 120 + 50}


def test_last_arrival_counts_only_ops_every_rank_recorded():
    r0 = _worker({"tp.all_reduce": [(0, 10)], "pp.send": [(0, 5)]})
    r1 = _worker({"tp.all_reduce": [(2, 12)], "pp.recv": [(0, 7)]})
    assert probe.last_arrival_ns([r0, r1]) == {"tp.all_reduce": 10}
    assert probe.last_arrival_ns([]) == {}


def test_timed_wrapper_keeps_spans_up_to_the_cap(monkeypatch):
    monkeypatch.setattr(probe, "MAX_SPANS", 3)
    probe._times.clear()
    probe._spans.clear()
    fn = probe._timed("tp.all_reduce", lambda x: x + 1)
    assert [fn(i) for i in range(5)] == [1, 2, 3, 4, 5]
    assert probe._times["tp.all_reduce"][0] == 5
    spans = probe._spans["tp.all_reduce"]
    assert len(spans) == 3 and all(a <= b for a, b in spans)
    assert spans == sorted(spans)
    probe._times.clear()
    probe._spans.clear()
