"""``zbccl bench --hosts``: the smoke run between two namespace hosts (root; skips with the reason
elsewhere), the inter-host byte references, and the clear error where namespaces cannot be made."""

from __future__ import annotations

import io
import os

import pytest

from zbccl.bench.hosts import ep_rows, must_bytes, raw_share, ring_bytes, run_hosts_bench
from zbccl.cli import main
from zbccl.tools import netns


def _skip_reason() -> str | None:
    from zbccl.heap.transports.mooncake import missing_reason

    return netns.hosts_skip_reason() or missing_reason()


def test_ring_and_must_bytes_2x2():
    S, W, M = 1 << 20, 4, 2
    assert ring_bytes("all_reduce", S, W, M) == 2 * 2 * (W - 1) * S // W  # 2 of the ring's 4 edges cross
    assert must_bytes("all_reduce", S, W, M) == 2 * S
    assert ring_bytes("all_gather", S, W, M) == 2 * (W - 1) * S and must_bytes("all_gather", S, W, M) == W * S
    assert ring_bytes("reduce_scatter", S, W, M) == 2 * (W - 1) * S // W
    assert must_bytes("reduce_scatter", S, W, M) == S  # each host sends its partial of the other host's half
    assert ring_bytes("all_to_all", S, W, M) == must_bytes("all_to_all", S, W, M) == 2 * S
    assert ring_bytes("broadcast", S, W, M) == must_bytes("broadcast", S, W, M) == S
    assert ring_bytes("all_reduce", S, 2, 2) == 0  # one host: nothing crosses
    with pytest.raises(ValueError, match="unknown op"):
        must_bytes("gather", S, W, M)


@pytest.mark.parametrize("hosts,per_host", [(2, 1), (2, 2), (3, 2)])
def test_raw_exchange_moves_only_what_must_cross(hosts, per_host):
    S, W = 3 * 4 << 20, hosts * per_host  # divisible by every W here
    for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        # one write per pair of same-index ranks on two hosts, in each direction: W (H-1) writes
        assert raw_share(op, S, W, per_host) * W * (hosts - 1) == must_bytes(op, S, W, per_host), op
    assert raw_share("all_to_all", S, 4, 2) == S // 2  # each rank's pieces for both ranks of the other host
    assert raw_share("all_reduce", S, 4, 2) == S // 2 and raw_share("all_gather", S, 4, 2) == S
    assert raw_share("all_reduce", S, 2, 2) == 0  # one host: nothing crosses


def test_without_namespaces_the_error_says_why(monkeypatch, capsys):
    monkeypatch.setattr(netns, "hosts_skip_reason", lambda: "namespace hosts need root (ip netns, unshare), got uid 1000")
    with pytest.raises(netns.HostsUnavailable, match="need root"):
        run_hosts_bench(smoke=True, out=io.StringIO())
    assert main(["bench", "--hosts", "2", "--smoke"]) == 2
    assert "need root" in capsys.readouterr().err


def test_host_options_need_hosts(capsys):
    assert main(["bench", "--smoke"]) == 2
    assert "need --hosts" in capsys.readouterr().err


def test_smoke_between_two_namespace_hosts():
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    out = io.StringIO()
    # torch's intra-op threads on (2 per rank on 2 cores): the copies between hosts must not depend on them
    doc = run_hosts_bench(hosts=2, ranks_per_host=1, smoke=True, progress=False, out=out, timeout=300, threads=2,
                          own_cores=True)
    text = out.getvalue()
    cores = doc["hosts"]["cores"]  # each host on its own cores where there are two or more
    if len(os.sched_getaffinity(0)) >= 2:
        assert cores[0] and cores[1] and not set(cores[0]) & set(cores[1]), cores
        assert doc["hosts"]["rank0_affinity"] == cores[0] and f"host 1 on {cores[1]}" in text
    else:
        assert cores == [None, None] and "every host on all of this machine's" in text
    assert len(doc["cells"]) == 4 * 2 * 2 and "# all_reduce bf16   2x1" in text and "# all_to_all fp32   2x1" in text and "load average" in text
    assert "2 thread(s)/rank" in text
    for cell in doc["cells"]:
        assert cell["gloo"]["wrong"] == 0, cell  # gloo through the veths, checked like zbccl
        z = cell["zbccl"]
        if z.get("error"):  # an op zbccl does not run between hosts (yet) is reported, never a hang
            assert "rank" in z["error"], z
            continue
        assert z["wrong"] == 0, cell
        assert z["xhost_bytes"] >= must_bytes(cell["op"], cell["size"], 2, 1), cell  # the counters saw the data
        mc = cell["mc_raw"]  # the transfer limit, timed in the same cell, never checked
        assert "error" not in mc and mc["wrong"] is None and mc["timing"]["stats"]["median"] > 0, cell
    raw = doc["raw"]["sizes"]
    assert sorted(map(int, raw)) == [4096, 65536] and all(t["stats"]["median"] > 0 for t in raw.values())
    assert doc["raw"]["word"]["stats"]["median"] > 0
    ep = doc["ep"]
    if not ep.get("error"):
        (row,) = ep_rows(ep, "2x1")
        assert row["wrong"] == 0 and row["ll_wrong"] == 0 and row["gloo_us"] > 0 and row["step_us"] > 0, row
    assert "# EP dispatch+combine 2x1" in text
    assert "mc/g" in text and "mc_us: raw Mooncake writes of only must_B" in text
    assert doc["hosts"]["transport"]["remote"]["transport"] == "tcp"


def test_cpu_per_op_without_the_network():
    """``zbccl bench --hosts 2 --cpu``: every op's CPU per call with the writes looped back, against its time with
    the network, in the same processes; a real op runs after the looped-back ones (the ranks stayed in step)."""
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    from zbccl.bench.hosts_cpu import CPU_OPS, run_cpu_bench

    out = io.StringIO()
    doc = run_cpu_bench(sizes=(4096,), calls=10, rounds=2, own_cores=True, out=out, timeout=300)
    assert [c["op"] for c in doc["cells"]] == list(CPU_OPS)
    for c in doc["cells"]:
        assert c["op_us"] > 0 and 0 < c["cpu_us"] and 0 < c["thread_us"], c
    assert "cpu/op" in out.getvalue() and "all_to_all" in out.getvalue()
    with pytest.raises(ValueError, match="through the slots"):
        run_cpu_bench(sizes=(64 << 20,))


def test_cpu_option_needs_two_hosts_of_one_rank(capsys):
    assert main(["bench", "--cpu"]) == 2
    assert "need --hosts" in capsys.readouterr().err
    if _skip_reason() is None:
        assert main(["bench", "--hosts", "3", "--cpu"]) == 2
        assert "2 hosts of 1 rank" in capsys.readouterr().err
