"""``zbccl tune`` end to end, and every rank's view of a bad tuning file."""

from __future__ import annotations

import json

import pytest

from tests.spawn import run_world
from zbccl.ops.tuner import TuningTable
from zbccl.tools.tune import run_tune


def test_tune_writes_a_table_the_runtime_loads(tmp_path, monkeypatch):
    out = tmp_path / "table.json"
    run_tune(world_sizes=[2], max_size=16 << 10, out=out)
    data = json.loads(out.read_text())
    assert set(data["rules"]) == {"all_reduce", "all_gather", "all_to_all"}
    assert data["rules"]["all_reduce"]["2"][-1][0] == -1
    monkeypatch.setenv("ZBCCL_TUNE_FILE", str(out))
    table = TuningTable.load()
    assert table.source == str(out) and "2" in table.rules["all_gather"]


def _bad_tune_file(ctx):
    import time

    import zbccl

    ctx.init(heap_size=1 << 20, timeout=300)  # a hang would wait out 300 s; the world gives 60
    try:
        t = zbccl.zeros(64).fill_(ctx.rank + 1)
        msgs = []
        for _ in range(2):  # the first collective, and a later one: same error, no hang
            t0 = time.monotonic()
            with pytest.raises(zbccl.ZbcclInvalidUsageError) as info:
                zbccl.all_reduce(t)
            assert time.monotonic() - t0 < 20, "the error must arrive within seconds"
            msgs.append(str(info.value))
        assert msgs[0] == msgs[1] and info.value.ranks == (0,)
        assert t.tolist() == [ctx.rank + 1.0] * 64  # untouched
        return msgs[0]
    finally:
        zbccl.finalize()


@pytest.mark.parametrize("text, needle", [
    ('{"rules": {"all_reduce": {"*": [[-1, "ring"]]}}}', "all_reduce[*][0] algorithm"),
    ('{"rules": {"all_reduce": ', "cannot read"),
])
def test_bad_tune_file_fails_on_every_rank_with_one_message(tmp_path, text, needle):
    path = tmp_path / "tune.json"
    path.write_text(text)
    msgs = run_world(_bad_tune_file, 2, env={"ZBCCL_TUNE_FILE": str(path)}, timeout=60)
    assert msgs[0] == msgs[1], msgs
    assert msgs[0].startswith("tuning: ") and needle in msgs[0] and str(path) in msgs[0], msgs[0]


def test_bad_forced_algorithm_on_rank_0_fails_on_every_rank():
    msgs = run_world(_bad_tune_file, 2, env={"ZBCCL_ALGO": "all_reduce=ring"}, timeout=60)
    assert msgs[0] == msgs[1] and msgs[0].startswith("ZBCCL_ALGO: bad entry") and "'all_reduce=ring'" in msgs[0]
