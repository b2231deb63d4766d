"""Smoke test of the MoE benchmark (``python -m zbccl.bench.ep``): tiny shapes, both routings, world 2.

Checks what the benchmark promises rather than its timings: zbccl's rows equal the gloo baseline
(``wrong`` 0 for every mode), every column of the table is there, the memory figures are positive
and under DeepEP's own reservation, and each block says which host state it ran in.
"""

from __future__ import annotations

import io

from zbccl.bench import ep as bench_ep


def test_ep_bench_runs_and_matches_gloo():
    out = io.StringIO()
    rows = bench_ep.run(worlds=(2,), tokens=32, hidden=128, experts=8, topk=2, routing=("uniform", "skewed"),
                        iters=2, ll_tokens=16, out=out)
    assert [(r["routing"], r["operands"]) for r in rows] == [
        (rt, m) for rt in ("uniform", "skewed") for m in ("heap", "private", "ll-heap")]
    for r in rows:
        assert r["wrong"] == 0, r
        assert r["step_us"] > 0 and r["gloo_step_us"] > 0 and r["cpu_ref_us"] > 0
        assert r["state"] in ("fast", "slow"), r  # the probe ran (world 2)
        if r["operands"] != "ll-heap":
            assert 0 < r["heap_peak_MiB"] and 0 < r["mem_ratio"] < 1, r
    text = out.getvalue()
    assert "cpu_ref_us" in text and "speedup" in text and "mem_ratio" in text
