"""The tuner's table: rule lookup, forcing, validation (``zbccl tune`` end to end: tests/multiproc)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from zbccl.errors import ZbcclInvalidUsageError
from zbccl.ops.tuner import (
    ALGO_CODES,
    DEFAULT_CHUNK,
    DEFAULT_RULES,
    TuningTable,
    parse_forced,
    validate_rules,
)
from zbccl.tools.tune import _rules, write_table


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


GOOD = {"all_reduce": {"*": [[4096, "oneshot"], [-1, "twoshot", 1 << 18]], "4": [[-1, "oneshot"]]}}


@pytest.mark.parametrize("rules, field, got", [
    ([], "bad rules", "'list'"),
    ({"all_reduce": {"*": [[-1, "ring"]]}}, "all_reduce[*][0] algorithm", "'ring'"),
    ({"allreduce": {"*": [[-1, "oneshot"]]}}, "bad op name", "'allreduce'"),
    ({"all_gather": {"*": [[-1, "twoshot"]]}}, "all_gather[*][0] algorithm", "'twoshot'"),  # another op's
    ({"all_reduce": {"0": [[-1, "oneshot"]]}}, "world size key of all_reduce", "'0'"),
    ({"all_reduce": {"two": [[-1, "oneshot"]]}}, "world size key of all_reduce", "'two'"),
    ({"all_reduce": {"*": []}}, "rules of all_reduce[*]", "[]"),
    ({"all_reduce": {"*": [[-2, "oneshot"]]}}, "max_bytes", "-2"),
    ({"all_reduce": {"*": [["4K", "oneshot"], [-1, "oneshot"]]}}, "max_bytes", "'4K'"),
    ({"all_reduce": {"*": [[1.5, "oneshot"], [-1, "oneshot"]]}}, "max_bytes", "1.5"),
    ({"all_reduce": {"*": [[True, "oneshot"], [-1, "oneshot"]]}}, "max_bytes", "True"),
    ({"all_reduce": {"*": [[-1, "oneshot"], [4096, "oneshot"]]}}, "[*][0] max_bytes", "-1"),
    ({"all_reduce": {"*": [[8192, "oneshot"], [4096, "oneshot"]]}}, "sizes ascending, above 8192", "4096"),
    ({"all_reduce": {"*": [[-1, "twoshot", 0]]}}, "chunk", "0"),
    ({"all_reduce": {"*": [[-1, "twoshot", -4096]]}}, "chunk", "-4096"),
    ({"all_reduce": {"*": [[-1, "twoshot", 1 << 40]]}}, "chunk", str(1 << 40)),
    ({"all_reduce": {"*": [[-1, "twoshot", "1M"]]}}, "chunk", "'1M'"),
    ({"all_reduce": {"*": [[-1]]}}, "rule all_reduce[*][0]", "[-1]"),
    ({"all_reduce": {"*": [[-1, "twoshot", 4096, 1]]}}, "rule all_reduce[*][0]", "[-1, 'twoshot', 4096, 1]"),
    ({"all_reduce": [[-1, "oneshot"]]}, "rules of all_reduce", "'list'"),
])
def test_every_field_is_validated(rules, field, got):
    with pytest.raises(ZbcclInvalidUsageError) as info:
        validate_rules(rules, source="t.json")
    msg = str(info.value)
    assert msg.startswith("tuning: bad ") and field in msg and " in t.json, expected " in msg, msg
    assert msg.endswith(f", got {got}"), msg


def test_valid_rules_pass_unchanged():
    assert validate_rules(GOOD, source="x") is GOOD
    validate_rules({op: {"*": r} for op, r in DEFAULT_RULES.items()}, source="defaults")


@pytest.mark.parametrize("text, needle", [
    ("{not json", "cannot read"),
    ('["rules"]', 'expected an object with "rules"'),
    ('{"measured": {}}', 'expected an object with "rules"'),
    ('{"rules": {"all_reduce": {"2": [[-1, "ring"]]}}}', "algorithm"),
])
def test_load_rejects_a_bad_file(tmp_path, monkeypatch, text, needle):
    path = tmp_path / "t.json"
    path.write_text(text)
    monkeypatch.setenv("ZBCCL_TUNE_FILE", str(path))
    monkeypatch.delenv("ZBCCL_ALGO", raising=False)
    with pytest.raises(ZbcclInvalidUsageError, match="^tuning: ") as info:
        TuningTable.load()
    assert needle in str(info.value) and str(path) in str(info.value)


def test_a_named_tune_file_must_exist(tmp_path, monkeypatch):
    monkeypatch.setenv("ZBCCL_TUNE_FILE", str(tmp_path / "missing.json"))
    with pytest.raises(ZbcclInvalidUsageError, match="cannot read"):
        TuningTable.load()


def test_write_table_is_atomic_and_validated(tmp_path, monkeypatch):
    path = tmp_path / "tuning" / "host.json"
    write_table({"rules": GOOD, "created": "now"}, path)
    assert json.loads(path.read_text())["rules"] == GOOD
    with pytest.raises(ZbcclInvalidUsageError, match="algorithm"):
        write_table({"rules": {"all_reduce": {"*": [[-1, "ring"]]}}}, path)

    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        write_table({"rules": {"all_gather": {"*": [[-1, "push"]]}}}, path)
    assert json.loads(path.read_text())["rules"] == GOOD  # the old table, whole
    assert sorted(p.name for p in path.parent.iterdir()) == ["host.json"]  # no temporary file left


@pytest.mark.parametrize("hosts, field", [
    ([], "hosts section"),
    ({"chunk": 100}, "hosts.chunk"),
    ({"chunk": True}, "hosts.chunk"),
    ({"chunk": 4096 + 32}, "hosts.chunk"),
    ({"direct_min": -1}, "hosts.direct_min"),
    ({"column_max": 1.5}, "hosts.column_max"),
    ({"hier_min": {"all_to_all": 1}}, "hosts.hier_min"),
    ({"hier_min": {"all_reduce": "64K"}}, "hosts.hier_min"),
    ({"relay": 1}, "hosts.relay"),
    ({"lanes": 4}, "hosts choice"),
])
def test_the_hosts_section_is_validated(hosts, field):
    from zbccl.ops.tuner import validate_hosts

    with pytest.raises(ZbcclInvalidUsageError, match=f"^tuning: bad {field} in here"):
        validate_hosts(hosts, source="here")


def test_the_hosts_section_overlays_the_defaults_and_travels_with_the_table(tmp_path, monkeypatch):
    from zbccl.ops.tuner import HOSTS_DEFAULTS, hosts_settings, validate_hosts

    full = hosts_settings()
    assert full == HOSTS_DEFAULTS and full["hier_min"] is not HOSTS_DEFAULTS["hier_min"]  # a copy
    assert validate_hosts(full, source="x", whole=True) is full
    with pytest.raises(ZbcclInvalidUsageError, match="every choice"):
        validate_hosts({"relay": True}, source="x", whole=True)
    section = {"hier_min": {"all_gather": None}, "relay": False, "chunk": 1 << 20}
    got = hosts_settings(section)
    assert got["hier_min"] == {**HOSTS_DEFAULTS["hier_min"], "all_gather": None}
    assert (got["relay"], got["chunk"], got["direct_min"]) == (False, 1 << 20, HOSTS_DEFAULTS["direct_min"])
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"rules": GOOD, "hosts": section}))
    monkeypatch.setenv("ZBCCL_TUNE_FILE", str(path))
    monkeypatch.delenv("ZBCCL_ALGO", raising=False)
    table = TuningTable.load()
    assert table.hosts == section and TuningTable.from_json(table.to_json()).hosts == section
    path.write_text(json.dumps({"rules": GOOD, "hosts": {"relay": "no"}}))
    with pytest.raises(ZbcclInvalidUsageError, match=r"bad hosts.relay in .*t.json"):
        TuningTable.load()
    with pytest.raises(ZbcclInvalidUsageError, match="hosts.relay"):
        write_table({"rules": GOOD, "hosts": {"relay": "no"}}, tmp_path / "w.json")


def test_info_shows_the_tables_choices_between_hosts(tmp_path, monkeypatch):
    """``zbccl info``'s tuning line: the table's source and every inter-host choice in effect; a bad table's error."""
    from zbccl.tools.info import _tuning, tuning_line

    path = tmp_path / "t.json"
    path.write_text(json.dumps({"rules": {}, "hosts": {"relay": False, "hier_min": {"all_gather": None}}}))
    monkeypatch.setenv("ZBCCL_TUNE_FILE", str(path))
    monkeypatch.delenv("ZBCCL_ALGO", raising=False)
    line = tuning_line(_tuning())
    assert line.startswith(f"tuning     {path}; between hosts (hier_min, relay from the table): chunk 4.0 MiB"), line
    assert "all_reduce from 256.0 KiB, all_gather never" in line and "relayed small steps off" in line, line
    path.write_text(json.dumps({"rules": {}, "hosts": {"relay": 3}}))
    assert tuning_line(_tuning()).startswith("tuning     error: tuning: bad hosts.relay in "), tuning_line(_tuning())
