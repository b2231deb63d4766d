"""The tuner's table: rule lookup, forcing, persistence, and ``zbccl tune`` end to end."""

from __future__ import annotations

import json

import pytest
import torch

from zbccl.errors import ZbcclInvalidUsageError
from zbccl.ops.plan import ALGO_CODES
from zbccl.ops.tuner import DEFAULT_CHUNK, TuningTable, parse_forced
from zbccl.tools.tune import _rules, run_tune


def test_rules_pick_by_size_and_world():
    t = TuningTable({"all_reduce": {"*": [[4096, "oneshot"], [-1, "twoshot", 1 << 18]],
                                    "4": [[-1, "oneshot"]]}})
    assert t.choose("all_reduce", torch.bfloat16, 4096, 2) == (ALGO_CODES["oneshot"], DEFAULT_CHUNK)
    assert t.choose("all_reduce", torch.bfloat16, 4097, 2) == (ALGO_CODES["twoshot"], 1 << 18)
    assert t.choose("all_reduce", torch.bfloat16, 1 << 30, 4)[0] == ALGO_CODES["oneshot"]
    assert t.choose("broadcast", torch.float32, 10, 2)[0] == ALGO_CODES["pull"]  # no rules: first algo
    t.forced = {"all_reduce": "oneshot"}
    assert t.choose("all_reduce", torch.bfloat16, 1 << 20, 2)[0] == ALGO_CODES["oneshot"]
    assert TuningTable.from_json(t.to_json()).rules == t.rules


def test_forcing_is_validated():
    assert parse_forced("all_reduce=twoshot, all_gather=push") == {"all_reduce": "twoshot", "all_gather": "push"}
    with pytest.raises(ZbcclInvalidUsageError, match="ZBCCL_ALGO"):
        parse_forced("all_reduce=ring")
    with pytest.raises(ZbcclInvalidUsageError):
        parse_forced("nonsense")


def test_rules_merge_neighbours():
    rows = [[4096, "pull", {}], [16384, "pull", {}], [65536, "push", {}], [262144, "pull", {}]]
    assert _rules(rows) == [[16384, "pull"], [65536, "push"], [-1, "pull"]]
    rows = [[1 << 20, "twoshot", {}, 1 << 20], [4 << 20, "twoshot", {}, 4 << 20]]
    assert _rules(rows) == [[1 << 20, "twoshot", 1 << 20], [-1, "twoshot", 4 << 20]]


def test_tune_writes_a_table_the_runtime_loads(tmp_path, monkeypatch):
    out = tmp_path / "table.json"
    run_tune(world_sizes=[2], max_size=16 << 10, out=out)
    data = json.loads(out.read_text())
    assert set(data["rules"]) == {"all_reduce", "all_gather", "all_to_all"}
    assert data["rules"]["all_reduce"]["2"][-1][0] == -1
    monkeypatch.setenv("ZBCCL_TUNE_FILE", str(out))
    table = TuningTable.load()
    assert table.source == str(out) and "2" in table.rules["all_gather"]
