"""``zbccl faults``: a handful of trials (SIGKILL, SIGSTOP, SIGINT against one rank inside an op).

Each trial passes only when every survivor raised naming the victim within the bound after the
signal, mapped no segment and held no extra descriptor after finalize, and ran again with the
victim (or its replacement) after finalize and init; the tool's own leak scan covers the trial's
jobs. The long runs (100 trials per signal) are in docs/reliability.md.
"""

from __future__ import annotations

import pytest

CASES = [("kill", "collective"), ("int", "ep"), ("stop", "p2p"), ("kill", "group"), ("int", "growth")]


@pytest.mark.parametrize("kind,where", CASES)
def test_a_signalled_rank_is_named_in_time_and_the_survivors_run_again(kind, where):
    from zbccl.tools.faults import run_trial

    rec = run_trial(kind=kind, where=where, world=2, victim=1, delay=0.05)
    assert rec["passed"], rec["why"]
    assert rec["elapsed"] and 0 <= max(rec["elapsed"]) <= rec["bound"], rec


def test_a_kill_inside_init_is_named_by_the_init_timeout():
    """Inside init the survivor waits in the rendezvous for a rank that will not come: the init
    timeout names it (INIT_BOUND), the world runs again with a replacement."""
    from zbccl.tools.faults import INIT_BOUND, run_trial

    rec = run_trial(kind="kill", where="init", world=2, victim=0, delay=0.0)
    assert rec["passed"] and rec["bound"] == INIT_BOUND, rec


def test_the_summary_counts_per_signal_and_workload():
    from zbccl.tools.faults import summarize

    recs = [{"kind": "kill", "where": "ep", "passed": True, "elapsed": [0.1, 0.2]},
            {"kind": "kill", "where": "ep", "passed": False, "elapsed": [4.0]},
            {"kind": "int", "where": "init", "passed": True, "elapsed": [10.0]}]
    doc = summarize(recs, seed=1, world=2, seconds=3.0)
    assert doc["trials"] == 3 and doc["passed"] == 2
    assert doc["kinds"]["kill"]["by_where"]["ep"] == {"trials": 2, "passed": 1, "bound_s": 3.0, "worst_s": 4.0}
    assert doc["kinds"]["int"]["worst_in_ops_s"] is None and doc["kinds"]["int"]["worst_s"] == 10.0
    assert len(doc["failures"]) == 1


def test_the_command_refuses_unknown_signals_and_workloads(capsys):
    from zbccl.cli import main

    assert main(["faults", "--kinds", "kill,hup"]) == 2
    assert "unknown signal kind or workload" in capsys.readouterr().err
    assert main(["faults", "--where", "collective,nowhere"]) == 2
    assert "nowhere" in capsys.readouterr().err
