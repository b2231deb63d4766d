"""Hugging Face transformers tensor parallelism as a real client of the ``zbccl`` backend (2 ranks).

Tiny random models built from their configs (seed 0, saved under pytest's
temporary directory, nothing downloaded): Llama (dense), Qwen3-MoE (one MoE
and one dense layer) and Mixtral (MoE). Each rank loads them whole for the
reference, then under backend gloo and backend zbccl with
``DistributedConfig(tp_plan="auto")`` (one ``init_process_group`` per
backend over the spawn helper's store), and checks (``zbccl.bench.hf.compare``):

- TP logits within atol 1e-5 / rtol 1e-4 of the single process (fp32);
- zbccl logits bitwise equal to gloo's (a sum of two operands is the same in
  either order);
- 16 greedy tokens (KV cache) identical to the single process, gloo and zbccl;
- inside ``zbccl.heap_scope()``: the same logits and tokens, and
  ``memory_stats()["staged_bytes"]`` 0 per forward and per generated token
  (outside the scope the same run stages, which the test also asserts, so
  the zero is not vacuous).
"""

from __future__ import annotations

import io

import pytest

pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
pytest.importorskip("accelerate", reason="needs the hf extra: pip install -e '.[hf]'")

from tests.spawn import run_world  # noqa: E402

pytestmark = pytest.mark.hf

MODELS = ("llama", "moe", "mixtral")


def _rank(ctx, paths: dict[str, str]) -> dict:
    import torch

    from zbccl.bench import hf

    torch.set_num_threads(1)  # as torchrun does: two ranks share the cores

    results = hf.rank_check(rank=ctx.rank, world_size=ctx.world_size, store=ctx.store(), paths=paths,
                            backends=("gloo", "zbccl"), scope=True, timeout_s=60)
    lines, bad = hf.compare(results, world_size=ctx.world_size)
    staged = {n: results["zbccl"][n]["staged_per_forward"] for n in paths}
    return {"lines": lines, "bad": bad, "staged_outside_scope": staged}


def test_hf_tensor_parallel_on_zbccl(tmp_path):
    from zbccl.bench import hf

    paths = {name: hf.build_checkpoint(name, tmp_path / name) for name in MODELS}
    results = run_world(_rank, 2, timeout=150, paths=paths)
    for rank, res in enumerate(results):
        assert not res["bad"], f"rank {rank}:\n" + "\n".join(res["bad"] + res["lines"])
        # the scope's zero means something: the same forward outside heap_scope stages its operands
        assert all(v > 0 for v in res["staged_outside_scope"].values()), res["staged_outside_scope"]
    assert len(results[0]["lines"]) == 4 * len(MODELS)


def test_bench_tp_smoke():
    """``zbccl bench-tp`` on a small model: every variant runs, zbccl matches gloo token for token, the
    collectives per step are the model's (2 per layer + embedding + lm_head), and heap_scope stages nothing."""
    from zbccl.bench.tp import VARIANTS, run_bench_tp

    doc = run_bench_tp(batches=[2], hidden=64, layers=2, vocab=128, steps=3, rounds=1, threads=1, idle_wait=0.0,
                       progress=False, out=io.StringIO())
    rows = {r["variant"]: r for r in doc["rows"]}
    assert set(rows) == set(VARIANTS)
    for r in rows.values():
        assert r["calls_per_step"] == 2 * 2 + 2, r
        assert r["wrong"] == 0, r
        assert r["step_us"] > 0
        assert (r["comm_us"] is None) == r["variant"].startswith("none"), r
    assert rows["zbccl+scope"]["staged_per_step"] == 0
    assert rows["zbccl"]["staged_per_step"] > 0  # outside the scope the same step stages: the zero means something
