"""``zbccl tune --hosts``: the rules that turn measurements into the inter-host choices, a quick run between two
namespace hosts of two ranks (root; skips with the reason elsewhere) that keeps the table's rules, and the clear
error where namespaces cannot be made."""

from __future__ import annotations

import json

import pytest

from zbccl.cli import main
from zbccl.ops.tuner import HOSTS_DEFAULTS, hosts_settings, validate_hosts
from zbccl.tools import netns
from zbccl.tools.tune_hosts import MARGIN, decide, run_tune_hosts


def test_decide_turns_measurements_into_choices():
    slow, fast = 1.0, 1.0 - 2 * MARGIN  # fast: wins by more than the margin; 1.0 against 1.0: no win
    measured = {
        "relay": [[4096, slow, fast, "all_to_all"], [4096, slow, slow, "all_reduce"], [16384, slow, slow, "x"]],
        "hier_all_reduce": [[1, slow, fast, "a"], [2, slow, slow, "a"], [3, slow, fast, "a"], [4, slow, fast, "a"]],
        "hier_all_gather": [[1, slow, fast, "g"], [2, slow, slow, "g"]],  # the largest lost: never
        "column": [[10, slow, fast, "a"], [20, slow, fast, "a"], [30, slow, slow, "a"], [40, slow, fast, "a"]],
        "direct": [[100, slow, fast, "t"], [200, slow, slow, "t"], [400, slow, fast, "t"]],
        "chunk": [[1 << 20, 1.0], [4 << 20, 1.0 - MARGIN / 2], [8 << 20, 2.0]],
    }
    got = decide(measured, HOSTS_DEFAULTS)
    assert got == {"relay": True,  # direct writes won one cell of three
                   "hier_min": {**HOSTS_DEFAULTS["hier_min"], "all_reduce": 3, "all_gather": None},  # from 3 up: wins
                   "column_max": 20,  # two phases won up to 20, not at 30
                   "direct_min": 200,  # pieces over the largest size where the slots won
                   "chunk": HOSTS_DEFAULTS["chunk"]}  # the fastest is the default (4 MiB)
    validate_hosts(hosts_settings(got), source="decide", whole=True)
    measured["relay"] = [[4096, slow, fast, "a"], [4096, slow, fast, "b"], [16384, slow, slow, "a"]]
    measured["direct"] = [[100, slow, fast, "t"], [400, slow, fast, "t"]]
    measured["chunk"] = [[1 << 20, 0.5], [4 << 20, 1.0]]
    got = decide(measured, HOSTS_DEFAULTS)
    assert (got["relay"], got["direct_min"], got["chunk"]) == (False, 50, 1 << 20)
    assert decide({}, HOSTS_DEFAULTS) == {"hier_min": HOSTS_DEFAULTS["hier_min"]}  # nothing measured: defaults


def test_without_namespaces_the_error_says_why(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(netns, "hosts_skip_reason", lambda: "namespace hosts need root (ip netns, unshare), got uid 1000")
    with pytest.raises(netns.HostsUnavailable, match="need root"):
        run_tune_hosts(quick=True, out=tmp_path / "t.json")
    assert main(["tune", "--hosts", "2", "--quick", "--out", str(tmp_path / "t.json")]) == 2
    assert "need root" in capsys.readouterr().err
    assert not (tmp_path / "t.json").exists()


def test_a_quick_run_between_namespace_hosts_saves_the_section_and_keeps_the_rules(tmp_path):
    from zbccl.heap.transports.mooncake import missing_reason

    reason = netns.hosts_skip_reason() or missing_reason()
    if reason:
        pytest.skip(reason)
    path = tmp_path / "table.json"
    rules = {"all_reduce": {"*": [[-1, "twoshot"]]}}
    path.write_text(json.dumps({"rules": rules, "measured": {"kept": 1}}))
    run_tune_hosts(hosts=2, ranks_per_host=2, quick=True, out=path, timeout=300, own_cores=True)
    table = json.loads(path.read_text())
    assert table["rules"] == rules and table["measured"] == {"kept": 1}
    validate_hosts(table["hosts"], source=str(path), whole=True)
    got = table["hosts_measured"]
    assert (got["hosts"], got["ranks_per_host"]) == (2, 2)
    assert got["cores"] == [None, None] or not set(got["cores"][0]) & set(got["cores"][1])  # own cores where 2+
    for key in ("relay", "hier_all_reduce", "hier_all_gather", "hier_broadcast", "hier_reduce_scatter", "column",
                "direct"):
        assert got[key] and all(r[1] > 0 and r[2] > 0 for r in got[key]), key
    assert [c for c, _ in got["chunk"]] == [1 << 20]
