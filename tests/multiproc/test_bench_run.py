"""zbccl bench end to end: one tiny sweep over two launched ranks, zbccl beside gloo."""

from __future__ import annotations

import io
import json
import math

from zbccl.bench import runner


def test_run_bench_end_to_end(tmp_path):
    path = tmp_path / "bench.json"
    out = io.StringIO()
    doc = runner.run_bench(world_size=2, ops=["all_reduce"], dtypes=["fp32"], min_size="4K", max_size="64K",
                           baselines=["gloo"], quick=True, idle_wait=0.5, json_path=str(path), progress=False,
                           out=out)
    assert doc["zbccl_ops"] == list(runner.ZBCCL_FUNCS)  # zbccl was measured, not skipped as "unavailable"
    loaded = json.loads(path.read_text())
    assert loaded["machine"]["world_size"] == 2 and len(loaded["cells"]) == 2
    for cell in loaded["cells"]:
        for impl in ("zbccl", "gloo"):  # both measured and checked, never skipped
            assert cell[impl]["wrong"] == 0, cell
            assert all(math.isfinite(x) and x > 0 for x in cell[impl]["timing"]["samples_us"])
        assert cell["zbccl"]["staged_bytes"] == 0
    probes = loaded["host_state"]["all_reduce/fp32"]  # probed at the start and end of the op block
    for when in ("start", "end"):
        assert probes[when]["state"] in ("fast", "slow") and probes[when]["shared_ns_per_line"] > 0
    assert "host state: " in out.getvalue()
    assert "# all_reduce fp32" in out.getvalue() and "every checked cell bit-exact" in out.getvalue()
