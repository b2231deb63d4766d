"""``zbccl bench --baselines vllm --quick``: vLLM's shm ops interleaved with zbccl in the same 2 ranks.

Runs only where ``make vllm-baseline`` built ``.venv-vllm`` (or this python has vLLM); the bench
re-runs itself under that venv. Checks every A/B cell is bit-exact for both implementations,
has one ratio per round, and that vLLM's manager used the bench's thread count.
"""

from __future__ import annotations

import io

import pytest

from zbccl.bench import ab
from zbccl.bench.runner import run_bench

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.mark.skipif(not ab.vllm_importable() and ab.find_vllm_python() is None,
                    reason="needs .venv-vllm: make vllm-baseline")
def test_interleaved_ab_quick(tmp_path):
    out = io.StringIO()
    doc = run_bench(world_size=2, ops=["all_reduce", "all_gather"], dtypes=["bf16"], min_size="4K",
                    max_size="64K", baselines=["vllm"], quick=True, threads=1, idle_wait=0.0, progress=False,
                    json_path=str(tmp_path / "ab.json"), out=out)
    assert (tmp_path / "ab.json").exists()
    assert doc["vllm"]["thread_num"] == 1 and "in-process" in doc["vllm"]["mode"]
    assert len(doc["cells"]) == 4
    for cell in doc["cells"]:
        assert cell["zbccl"]["wrong"] == 0 and cell["vllm"]["wrong"] == 0, cell
        assert cell["zbccl"]["staged_bytes"] == 0
        assert cell["ab"]["rounds"] == ab.ab_rounds(doc["options"]["timing"]["reps"])
        assert len(cell["ab"]["ratios"]) == cell["ab"]["rounds"] and cell["ab"]["median"] > 0
    assert "spread" in out.getvalue() and "every checked cell bit-exact" in out.getvalue()
