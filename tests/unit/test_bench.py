"""zbccl.bench: bandwidth maths, stats, payload oracle, report formatting (the sweep: tests/multiproc)."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import time

import pytest
import torch

from zbccl.bench import report, runner, timing
from zbccl.cli import main as cli_main


def test_busbw_factors_follow_nccl_tests():
    assert report.busbw_factor("all_reduce", 2) == 1.0
    assert report.busbw_factor("all_reduce", 4) == 1.5
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        assert report.busbw_factor(op, 4) == 0.75
    assert report.busbw_factor("broadcast", 3) == 1.0
    with pytest.raises(ValueError, match="unknown op"):
        report.busbw_factor("gather", 2)


def test_algbw_uses_nccl_tests_data_size():
    # all_gather's S is its output (world x input); the others use the per-rank input
    assert report.algbw_bytes("all_gather", 1000, 4) == 4000
    assert report.algbw_bytes("reduce_scatter", 1000, 4) == 1000
    algbw, busbw = report.bandwidths("all_reduce", 10**6, 2, 100.0)  # 1 MB in 100 us
    assert algbw == pytest.approx(10.0) and busbw == pytest.approx(10.0)
    assert report.bandwidths("all_reduce", 10**6, 2, None) == (None, None)


def test_size_ladder():
    assert runner.size_ladder(4096, 65536) == [4096, 16384, 65536]
    assert runner.size_ladder(4096, 64 << 20, factor=16, limit=3) == [4096, 65536, 1 << 20]
    assert runner.size_ladder(4096, 5000) == [4096]
    with pytest.raises(ValueError):
        runner.size_ladder(8192, 4096)


def test_summarize():
    s = timing.summarize([5.0, 1.0, 3.0, 2.0])
    assert s == {"median": 2.5, "min": 1.0, "max": 5.0, "n": 4}
    assert timing.summarize([])["median"] is None


def test_time_calls_locally():
    calls = []
    t = timing.time_calls(lambda: calls.append(1), ctl=timing.LocalControl(), sync=lambda: None,
                          cfg=timing.TimingConfig(target_s=0.005, reps=3, warmup=1))
    assert len(t.samples_us) == 3 and t.iters >= 1 and t.stats["min"] <= t.stats["median"] <= t.stats["max"]
    assert t.foreign_cores >= 0 and json.dumps(t.to_dict())


@pytest.mark.parametrize("ws", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_payload_oracle_is_exact_and_identifies_sources(ws, dtype):
    n = 61 * ws * 4
    ins = [timing.payload(r, n, dtype) for r in range(ws)]
    assert all(int(x.abs().max()) <= 30 for x in ins)
    assert not torch.equal(ins[0], ins[1])  # the rank is visible in the data
    exact = sum(x.double() for x in ins)
    assert torch.equal(timing.expected("all_reduce", 0, ws, n, dtype).double(), exact)  # no rounding
    assert torch.equal(timing.expected("all_gather", 1, ws, n, dtype), torch.cat(ins))
    c = n // ws
    assert torch.equal(timing.expected("reduce_scatter", 1, ws, n, dtype).double(), exact[c:2 * c])
    a2a = timing.expected("all_to_all", 1, ws, n, dtype)
    assert torch.equal(a2a[:c], ins[0][c:2 * c]) and torch.equal(a2a[c:2 * c], ins[1][c:2 * c])
    assert torch.equal(timing.expected("broadcast", 2, ws, n, dtype), ins[0])


def test_count_wrong():
    ref = torch.arange(8, dtype=torch.float32)
    bad = ref.clone()
    bad[3], bad[5] = 100, float("nan")
    assert timing.count_wrong(ref.clone(), ref) == 0
    assert timing.count_wrong(bad, ref) == 2
    assert timing.count_wrong(ref[:4], ref) == 8
    assert timing.count_wrong(ref.bfloat16(), ref) == 8


def _doc() -> dict:
    tim = {"samples_us": [10.0, 12.0, 11.0], "iters": 100, "foreign_cores": 0.05, "steal_cores": 0.0,
           "own_cores": 2.0, "stats": timing.summarize([10.0, 12.0, 11.0])}
    slow = {**tim, "stats": timing.summarize([110.0]), "foreign_cores": 0.3}
    cells = [{"op": "all_reduce", "dtype": "fp32", "size": 4096, "count": 1024,
              "zbccl": {"wrong": 0, "staged_bytes": 0, "timing": tim}, "gloo": {"wrong": 0, "timing": slow},
              "vllm": {"wrong": 0, "timing": slow}},
             {"op": "all_reduce", "dtype": "fp32", "size": 16384, "count": 4096,
              "zbccl": {"error": "rank 1: boom", "wrong": None}, "gloo": {"wrong": 3, "timing": slow}}]
    memcpy = {"sizes": {"4096": {"all": tim, "solo": tim}}}
    machine = {"cpu_model": "cpu", "cores": 2, "torch": "t", "zbccl": "z", "world_size": 2, "threads": 1}
    return {"machine": machine, "options": {"ops": ["all_reduce"], "dtypes": ["fp32"]}, "cells": cells,
            "memcpy": memcpy, "gates": {"all_reduce/fp32": {"idle": True, "waited_s": 0.3, "load_cores": 0.1}},
            "zbccl_ops": ["all_reduce"], "vllm": {"vllm_version": "0.32.0"}, "wall_s": 1.0}


def test_table_rows_and_summary():
    text = report.format_table(_doc(), "all_reduce", "fp32")
    lines = text.splitlines()
    assert lines[0].startswith("# all_reduce fp32") and "idle after 0.3 s" in lines[0]
    assert lines[1].split()[:9] == ["size", "count", "dtype", "time_us", "min", "max", "algbw", "busbw", "#wrong"]
    row = lines[2].split()
    assert row[:4] == ["4096", "1024", "fp32", "11.0"] and row[8] == "0"
    assert "10.0x" in lines[2]  # gloo 110 us vs zbccl 11 us, and vllm likewise
    assert "ERR" in lines[3] and " 3 " in lines[3]
    out = io.StringIO()
    report.print_report(_doc(), out)
    assert "2 cells wrong or failed" in out.getvalue() and "staged_bytes: 0" in out.getvalue()


def test_json_and_plot(tmp_path):
    report.write_json(_doc(), tmp_path / "new" / "r.json")  # the folder is created
    assert json.loads((tmp_path / "new" / "r.json").read_text())["cells"][0]["count"] == 1024
    msg = report.write_plot(_doc(), tmp_path / "plots" / "r.png")
    if importlib.util.find_spec("matplotlib") is None:  # one outcome per environment, never either
        assert msg.startswith("plot skipped: matplotlib is not installed") and not (tmp_path / "plots").exists()
    else:
        assert (tmp_path / "plots" / "r.png").stat().st_size > 1000, msg


def test_progress_bar_without_a_terminal():
    buf = io.StringIO()
    bar = report.Progress(20, stream=buf)
    for i in range(20):
        bar.step(f"cell {i}")
    bar.close()
    lines = buf.getvalue().splitlines()
    assert len(lines) == 11 and lines[0].startswith("[....") and "] 19/20 cell 18" in lines[-2]
    assert lines[-1].startswith("[" + "#" * 24 + "] 20/20 done")


def test_cli_help_opens_with_usage(capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main(["bench", "--help"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith("usage: zbccl bench [-n N]")


def test_bad_options_are_rejected():
    with pytest.raises(ValueError, match="unknown op"):
        runner.run_bench(ops=["all_reduce", "gather"], out=io.StringIO())
    with pytest.raises(ValueError, match="world size"):
        runner.run_bench(world_size=0, out=io.StringIO())
    with pytest.raises(ValueError, match="gap out of range"):
        runner.run_bench(gap_ms=-1, out=io.StringIO())
    cores = len(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match="needs a core per rank"):
        runner.run_bench(world_size=min(cores + 1, 8), gap_ms=1, out=io.StringIO())


def test_calls_inside_a_model_step_start_at_one_instant_after_the_gap():
    """--gap-ms: each call follows gap_ms of matmuls and starts at the agreed instant, not earlier."""
    starts: list[int] = []
    ends: list[int] = []

    def call():
        starts.append(time.perf_counter_ns())
        ends.append(time.perf_counter_ns())

    cfg = timing.TimingConfig(target_s=0.01, reps=2, warmup=1, gap_ms=0.3)
    t = timing.time_calls(call, ctl=timing.LocalControl(), sync=lambda: None, cfg=cfg)
    assert len(t.samples_us) == 2 and t.iters >= 10
    gapped = starts[-2 * t.iters:]
    # consecutive calls are at least the gap apart (the matmuls ran in between) ...
    assert min(b - a for a, b in zip(gapped, gapped[1:])) >= 0.3e6
    # ... and a call's time counts from the common start, so it is at least the call itself
    assert all(s >= 0 for s in t.samples_us)
    timing.gap_compute(0.1)  # the weight is made once
    assert len(timing._GAP_WEIGHT) == 2 and timing._GAP_WEIGHT[0].dtype == torch.bfloat16


def test_every_bench_op_has_its_zbccl_function():
    # a missing function would silently drop zbccl's cells from every sweep
    assert runner.zbccl_ops_available() == list(runner.ZBCCL_FUNCS)


def test_noisy_timing_is_redone_after_a_gate():
    gates = []
    cfg = timing.TimingConfig(target_s=0.002, reps=2, warmup=0)
    quiet = dict(ctl=timing.LocalControl(), sync=lambda: None, cfg=cfg)
    t = timing.time_quietly(lambda: None, **quiet, regate=lambda: gates.append(1) or True, noise_limit=-1.0)
    assert t.attempts == 2 and gates == [1]
    t = timing.time_quietly(lambda: None, **quiet, regate=lambda: False, noise_limit=-1.0)  # budget spent
    assert t.attempts == 1
