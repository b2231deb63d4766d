"""bench-tp's pure parts: combining ranks and rounds, the derived columns, and argument checks."""

from __future__ import annotations

import io

import pytest

from zbccl.bench import tp


def _row(variant: str, medians: list[float], *, batch: int = 1, staged: float = 0.0, wrong: int = 0,
         comm: list[float] | None = None) -> dict:
    return {"batch": batch, "variant": variant, "round_medians": medians, "staged": [staged] * len(medians),
            "calls": [10.0] * len(medians), "wrong": wrong, "comm": comm or [0.0] * len(medians),
            "load": [0.1] * len(medians)}


def test_combine_takes_the_slowest_rank_per_round_then_the_median():
    rank0 = [_row("none", [1e-3, 2e-3, 1e-3]),
             _row("zbccl", [1.2e-3, 1.1e-3, 1.3e-3], staged=64.0, comm=[1e-4, 2e-4, 3e-4]),
             _row("gloo", [3e-3, 3e-3, 3e-3], comm=[2e-3, 2e-3, 2e-3])]
    rank1 = [_row("none", [1.1e-3, 1e-3, 1e-3]), _row("zbccl", [1.1e-3, 1.4e-3, 1.2e-3], wrong=1, comm=[3e-4] * 3),
             _row("gloo", [2e-3, 3.5e-3, 2e-3], comm=[1e-3] * 3)]
    rows = {r["variant"]: r for r in tp._combine([rank0, rank1])}
    assert rows["none"]["step_us"] == pytest.approx(1100.0)  # rounds: max(1.0, 1.1), max(2, 1), max(1, 1) ms
    assert rows["zbccl"]["step_us"] == pytest.approx(1300.0)  # rounds 1.2, 1.4, 1.3 ms
    assert rows["zbccl"]["comm_us"] == pytest.approx(250.0)  # rounds (mean over ranks): 200, 250, 300 µs
    assert rows["zbccl"]["comm_pct"] == pytest.approx(100 * 250 / 1300)
    assert rows["zbccl"]["x_none"] == pytest.approx(1300 / 1100)
    assert rows["gloo"]["step_us"] == pytest.approx(3000.0)
    assert rows["gloo"]["comm_us"] == pytest.approx(1500.0)
    assert rows["zbccl"]["x_gloo_step"] == pytest.approx(3000 / 1300)
    assert rows["zbccl"]["x_gloo_comm"] == pytest.approx(1500 / 250)
    assert rows["zbccl"]["staged_per_step"] == 64.0 and rows["zbccl"]["wrong"] == 1
    assert rows["none"]["comm_us"] is None
    assert rows["zbccl"]["spread_pct"] == pytest.approx(100 * (1.4 - 1.2) / 1.3)


def test_scoped_variants_compare_with_the_scoped_lower_bound():
    rows = {r["variant"]: r for r in tp._combine([[_row("none", [1e-3]), _row("none+scope", [2e-3]),
                                                   _row("zbccl+scope", [2.5e-3], comm=[4e-4])]])}
    assert rows["zbccl+scope"]["x_none"] == pytest.approx(1.25)
    assert rows["zbccl+scope"]["comm_us"] == pytest.approx(400.0)
    assert rows["zbccl+scope"]["x_gloo_step"] is None  # no gloo row: no ratio


def test_table_prints_every_row():
    out = io.StringIO()
    tp.print_table(tp._combine([[_row("none", [1e-3]), _row("zbccl", [1.5e-3], comm=[5e-4])]]), out)
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and "zbccl" in lines[2] and "500.0" in lines[2] and "1.50" in lines[2]


@pytest.mark.parametrize("kwargs, needle", [({"dtype": "fp8"}, "unknown dtype"),
                                            ({"variants": ["nccl"]}, "unknown variants"),
                                            ({"hidden": 100}, "bad shape"), ({"rounds": 0}, "bad shape")])
def test_bad_arguments_are_refused_before_any_process_starts(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        tp.run_bench_tp(**kwargs)
