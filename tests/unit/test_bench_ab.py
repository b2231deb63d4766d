"""The interleaved A/B of ``zbccl bench --baselines vllm`` without vLLM: ratio aggregation, the A/B
loop on fake implementations (one process), the table's ratio and spread columns, option parsing and
the clear error (or re-run) when vLLM is missing."""

from __future__ import annotations

import io

import pytest
import torch

from zbccl import cli
from zbccl.bench import ab, report, runner, timing


def test_ratio_stats_median_and_spread():
    got = ab.ratio_stats([10.0, 20.0, 10.0, 5.0], [20.0, 20.0, 30.0, 5.0])
    assert got["ratios"] == [2.0, 1.0, 3.0, 1.0]
    assert (got["median"], got["min"], got["max"], got["rounds"]) == (1.5, 1.0, 3.0, 4)
    with pytest.raises(ValueError, match="ratio_stats: rounds differ"):
        ab.ratio_stats([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="got 0 and 0"):
        ab.ratio_stats([], [])


@pytest.mark.parametrize("reps", [1, 3, 5])
def test_rounds_are_even_so_both_orders_count_alike(reps):
    n = ab.ab_rounds(reps)
    assert n % 2 == 0 and n >= 6


class _Fake:
    """A world-of-one implementation: all_reduce of one rank is the identity; ``corrupt`` breaks it."""

    def __init__(self, name: str, *, corrupt: bool = False, log: list | None = None) -> None:
        self.name, self.corrupt, self.log = name, corrupt, log if log is not None else []

    def supports(self, op: str) -> bool:
        return True

    def empty(self, numel, dtype):
        return torch.empty(numel, dtype=dtype)

    def bind(self, op, out, inp):
        def call():
            self.log.append(self.name)
            if out is not inp:
                out.copy_(inp)
            if self.corrupt:
                out.view(-1)[0] = 999
        return call

    def sync(self) -> None:
        pass

    def staged_bytes(self) -> int:
        return 0


def _harness() -> runner.Harness:
    cfg = timing.TimingConfig(target_s=0.0005, reps=3, warmup=0, cap_s=0.1)
    return runner.Harness(0, 1, None, timing.LocalControl(), cfg, None, 0.0)


@pytest.mark.parametrize("op", ["all_reduce", "all_gather"])
def test_measure_ab_interleaves_checks_every_round_and_reports_both(op):
    log: list[str] = []
    got = ab.measure_ab([_Fake("zbccl", log=log), _Fake("vllm", corrupt=True, log=log)], op, "bf16", 64,
                        _harness())
    rounds = ab.ab_rounds(3)
    assert got["zbccl"]["wrong"] == 0 and got["zbccl"]["staged_bytes"] == 0
    assert got["vllm"]["wrong"] == rounds + 1  # the first check plus one per round, one element each
    for name in ("zbccl", "vllm"):
        t = got[name]["timing"]
        assert len(t["samples_us"]) == rounds and t["stats"]["n"] == rounds and t["iters"] >= 1
    assert got["ab"]["rounds"] == rounds and got["ab"]["order"] == ["zbccl", "vllm"]
    assert got["ab"]["min"] <= got["ab"]["median"] <= got["ab"]["max"]
    # rounds alternate the order (z v, v z, z v, ...): the log's runs of one name are one block
    # (check + iters calls) at both ends and two blocks of the same name in between
    runs: list[list] = []
    for name in log:
        if runs and runs[-1][0] == name:
            runs[-1][1] += 1
        else:
            runs.append([name, 1])
    block = {n: 1 + got[n]["timing"]["iters"] for n in ("zbccl", "vllm")}
    tail = runs[-(rounds + 1):]
    assert tail[0] == ["zbccl", block["zbccl"]] and tail[-1][1] == block[tail[-1][0]]
    assert all(length == 2 * block[name] for name, length in tail[1:-1])


def test_measure_ab_records_an_error_instead_of_raising():
    class Boom(_Fake):
        def bind(self, op, out, inp):
            raise RuntimeError("no such op")

    got = ab.measure_ab([_Fake("zbccl"), Boom("vllm")], "all_reduce", "fp32", 16, _harness())
    assert "RuntimeError: no such op" in got["zbccl"]["error"] and got["vllm"]["wrong"] is None


def _ab_doc() -> dict:
    def tim(us):
        return {"samples_us": [us], "iters": 10, "foreign_cores": 0.1, "steal_cores": 0.0, "own_cores": 2.0,
                "stats": timing.summarize([us])}

    cell = {"op": "all_reduce", "dtype": "bf16", "size": 4096, "count": 2048,
            "zbccl": {"wrong": 0, "staged_bytes": 0, "timing": tim(10.0)}, "vllm": {"wrong": 0, "timing": tim(25.0)},
            "ab": {**ab.ratio_stats([10.0, 10.0, 10.0], [20.0, 30.0, 12.5]), "order": ["zbccl", "vllm"]}}
    machine = {"cpu_model": "cpu", "cores": 2, "torch": "t", "zbccl": "z", "world_size": 2, "threads": 1}
    return {"machine": machine, "options": {"ops": ["all_reduce"], "dtypes": ["bf16"]}, "cells": [cell],
            "memcpy": None, "gates": {}, "zbccl_ops": ["all_reduce"], "wall_s": 1.0,
            "vllm": {"vllm_version": "0.32.0", "torch_version": "2.13.0+cpu", "thread_num": 1, "mode": "in-process"}}


def test_table_shows_the_median_of_per_round_ratios_and_its_spread():
    lines = report.format_table(_ab_doc(), "all_reduce", "bf16").splitlines()
    assert "vllm/zbccl" in lines[1] and "spread" in lines[1]
    row = lines[2]
    assert "2.0x" in row  # median of 2.0, 3.0, 1.25 (not 25/10 = 2.5 of the medians)
    assert "1.25..3.00" in row
    out = io.StringIO()
    report.print_report(_ab_doc(), out)
    assert "in-process, thread_num 1" in out.getvalue() and "spread their min..max" in out.getvalue()
    assert report.format_spread(None) == "-"


def test_baseline_option_parsing():
    opts = runner._options(2, ["all_reduce"], ["bf16"], "4K", "64K", ["gloo", "vllm"], True, 0.0)
    assert opts["baselines"] == ["gloo", "vllm"]
    with pytest.raises(ValueError, match=r"bench: unknown baseline \['nccl'\]"):
        runner._options(2, ["all_reduce"], ["bf16"], "4K", "64K", ["nccl"], True, 0.0)


def test_missing_vllm_fails_clearly_with_the_setup_command(monkeypatch, capsys):
    monkeypatch.setattr(runner, "vllm_importable", lambda: False)
    monkeypatch.setattr(runner, "find_vllm_python", lambda: None)
    with pytest.raises(ValueError, match="make vllm-baseline"):
        runner.run_bench(ops=["all_reduce"], dtypes=["bf16"], baselines=["vllm"], quick=True, out=io.StringIO())
    code = cli.main(["bench", "--ops", "all_reduce", "--baselines", "vllm", "--quick"])
    assert code == 2 and "scripts/setup_vllm_baseline.sh" in capsys.readouterr().err


def test_missing_vllm_reruns_under_the_vllm_venv(monkeypatch, tmp_path):
    seen = {}

    def fake_run(kwargs, *, python, out, timeout):
        seen.update(kwargs, python=python)
        return _ab_doc()

    monkeypatch.setattr(runner, "vllm_importable", lambda: False)
    monkeypatch.setattr(runner, "find_vllm_python", lambda: tmp_path / "python")
    monkeypatch.setattr(runner, "run_in_vllm_venv", fake_run)
    out = io.StringIO()
    doc = runner.run_bench(ops=["all_reduce"], dtypes=["bf16"], baselines=["vllm"], quick=True, out=out,
                           json_path=str(tmp_path / "r.json"))
    assert doc["cells"][0]["ab"]["rounds"] == 3 and (tmp_path / "r.json").exists()
    assert out.getvalue().startswith("zbccl bench: this python") and str(tmp_path / "python") in out.getvalue()
    assert seen["baselines"] == ["vllm"] and seen["quick"] is True and "json_path" not in seen


def test_overheads_report_the_python_part_of_a_small_all_reduce():
    from zbccl.bench.micro import format_overheads

    o = {"alloc": [], "native_ns": {"signal": 30.0},
         "small_call": {"bytes": 4096, "dtype": "fp32", "whole_ns": 10000.0, "python_ns": 1200.0,
                        "python_share": 0.12}}
    assert format_overheads(o)[-1].startswith("all_reduce 4096 B fp32: whole call 10.00 us, Python part 1200 ns (12%")


def test_one_interleaved_baseline_per_run():
    with pytest.raises(ValueError, match=r"one interleaved baseline per run, expected one of \['vllm', 'mpi'\]"):
        runner._options(2, ["all_reduce"], ["fp32"], "4K", "64K", ["vllm", "mpi"], True, 0.0)
    assert runner._options(2, ["all_reduce"], ["fp32"], "4K", "64K", ["mpi"], True, 0.0)["baselines"] == ["mpi"]


def test_missing_mpi_fails_clearly_with_the_install_command(monkeypatch):
    from zbccl.bench import mpi

    monkeypatch.setattr(mpi.shutil, "which", lambda name: None)
    assert mpi.mpi_available().startswith("mpirun")
    with pytest.raises(ValueError, match=r"--baselines mpi needs Open MPI and mpi4py.*got no mpirun.*openmpi-bin"):
        runner.run_bench(ops=["all_reduce"], dtypes=["fp32"], baselines=["mpi"], quick=True, out=io.StringIO())


def test_mpi_impl_is_fp32_only():
    pytest.importorskip("mpi4py", reason="needs the mpi extra")
    from zbccl.bench.mpi import MpiImpl

    impl = MpiImpl()
    assert impl.supports("all_gather") and not impl.supports("reduce_scatter") and impl.dtypes == ("fp32",)
    t = torch.zeros(4, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="mpi: MPI has no datatype for torch.bfloat16, expected torch.float32"):
        impl.bind("all_reduce", t, t)


def test_mpi_columns_replace_the_vllm_ones():
    doc = _ab_doc()
    cell = doc["cells"][0]
    cell["mpi"] = cell.pop("vllm")
    doc["vllm"], doc["mpi"] = None, {"library": "Open MPI v4.1.4", "mpi4py": "4.1.2", "dtypes": ["fp32"]}
    text = report.format_table(doc, "all_reduce", "bf16")
    assert "mpi/zbccl" in text and "vllm" not in text and "1.25..3.00" in text
    out = io.StringIO()
    report.print_report(doc, out)
    assert "mpi: Open MPI v4.1.4" in out.getvalue() and "fp32 only" in out.getvalue()
