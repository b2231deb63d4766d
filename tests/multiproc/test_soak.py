"""``zbccl soak``: a few hundred random ops on the default suite's budget, that the checker catches a
wrong result, and the command's exit status and JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.spawn import run_world

ARGS = dict(seed=7, seconds=None, check_every=16, report_every=1e9, heap_size=32 << 20, to_stderr=True)


def _soak(ctx, ops: int, corrupt: bool, fail: bool = False):
    import zbccl
    from zbccl.tools.soak import soak_rank

    if fail and ctx.rank == 1:  # rank 1's third broadcast raises before it enters the op
        real_bcast, calls = zbccl.broadcast, []

        def failing(*args, **kwargs):
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("injected failure")
            return real_bcast(*args, **kwargs)

        zbccl.broadcast = failing
    if corrupt:  # one element of every all_reduce through zbccl's API comes back off by one
        real = zbccl.all_reduce

        def off_by_one(t, *args, **kwargs):
            out = real(t, *args, **kwargs)
            if t.numel() > 5:
                t.view(-1)[5] += 1
            return out

        zbccl.all_reduce = off_by_one
    return soak_rank(rank=ctx.rank, world_size=ctx.world_size, store=ctx.store(), ops=ops, ep=True, **ARGS)


def test_a_few_hundred_random_ops_are_bit_exact_and_leak_nothing():
    from zbccl.tools.soak_ops import KINDS

    rows = run_world(_soak, 2, ops=400, corrupt=False, timeout=300)
    for r in rows:
        assert r["errors"] == [] and r["wrong"] == [], (r["errors"], r["wrong"])
        assert r["ops"] == 400 and sum(r["counts"].values()) == 400
    assert set(rows[0]["counts"]) == set(KINDS), rows[0]["counts"]  # every kind ran at least once
    assert rows[0]["counts"] == rows[1]["counts"], "the ranks drew different ops"
    growth = rows[0]["growth"]
    assert growth is not None and all(g["fds"] == 0 and g["sockets"] == 0 for g in growth), growth


def test_the_soak_reports_a_wrong_result():
    rows = run_world(_soak, 2, ops=120, corrupt=True, timeout=300)
    wrong = [w for r in rows for w in r["wrong"]]
    assert wrong and all("all_reduce" in w for w in wrong), wrong
    assert all(r["errors"] == [] for r in rows)


def test_an_error_on_one_rank_ends_the_soak_on_every_rank():
    rows = run_world(_soak, 2, ops=400, corrupt=False, fail=True, timeout=120)  # the ops' timeout is 300 s
    assert "injected failure" in rows[1]["errors"][0], rows[1]["errors"]
    assert rows[0]["errors"] and "rank 1" in rows[0]["errors"][0], rows[0]["errors"]  # told at once (abort)
    assert rows[0]["ops"] < 400 and rows[1]["ops"] < 400


def test_the_command_prints_json_and_its_exit_status_says_ok():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in ["src", os.environ.get("PYTHONPATH", "")] if p))
    out = subprocess.run([sys.executable, "-m", "zbccl", "soak", "--world", "2", "--ops", "96", "--check-every", "8",
                          "--json", "--no-ep"], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out.stdout)
    assert doc["ok"] and doc["ops"] == 96 and doc["wrong"] == 0 and doc["errors"] == 0, doc
    assert "ep" not in doc["counts"] and len(doc["growth"]) == 2
    timed = subprocess.run([sys.executable, "-m", "zbccl", "soak", "--minutes", "0.05", "--check-every", "8",
                            "--no-ep", "--json"], capture_output=True, text=True, timeout=300, env=env)
    assert timed.returncode == 0, timed.stderr[-3000:]
    doc = json.loads(timed.stdout)
    assert doc["ok"] and doc["seconds"] >= 3 and doc["growth"] is not None, doc  # ran its 3 s, then agreed to stop
    bad = subprocess.run([sys.executable, "-m", "zbccl", "soak", "--ops", "0"], capture_output=True, text=True,
                         timeout=60, env=env)
    assert bad.returncode == 2 and "--ops" in bad.stderr


def test_the_soak_across_two_hosts_is_bit_exact():
    """``--hosts 2``: every op of the mix in its between-hosts form (routed transport: mooncake between the
    two "hosts" of this machine), checked bit for bit; the summary says how many hosts."""
    import pytest

    from zbccl.heap.transports.mooncake.engine import missing_reason

    why = missing_reason()
    if why:
        pytest.skip(f"the mooncake transport is unavailable here: {why}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in ["src", os.environ.get("PYTHONPATH", "")] if p))
    out = subprocess.run([sys.executable, "-m", "zbccl", "soak", "--world", "2", "--hosts", "2", "--ops", "3000",
                          "--check-every", "32", "--seed", "5", "--json"], capture_output=True, text=True, timeout=300,
                         env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    doc = json.loads(out.stdout)
    # 3000 ops: the warm-up (a quarter) covers the descriptors opened on first use of a path between hosts (the
    # gloo group of send/recv); 160 ops showed them as growth (+1/+2 fds), 3000 ops show none. Sockets are counted
    # apart: Mooncake opens a lane to a peer when a transfer meets a busy one, at a random point (+1 in some runs)
    assert doc["ok"] and doc["hosts"] == 2 and doc["ops"] == 3000 and doc["wrong"] == 0 and doc["errors"] == 0, doc
    assert doc["limits"]["sockets"] == 2 and all(g["fds"] == 0 and g["sockets"] <= 2 for g in doc["growth"]), doc
    bad = subprocess.run([sys.executable, "-m", "zbccl", "soak", "--world", "2", "--hosts", "3", "--ops", "8"],
                         capture_output=True, text=True, timeout=60, env=env)
    assert bad.returncode == 2 and "--hosts" in bad.stderr, bad.stderr[-2000:]
