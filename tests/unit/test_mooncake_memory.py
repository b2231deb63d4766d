"""The mooncake transport's pure logic (no Mooncake needed): the growth table, the registration splits, the
control region's layout and the address it advertises."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from zbccl.heap.transports.mooncake.memory import MAX_STEPS, ctrl_layout, parse_table, split_at


def test_split_at_cuts_at_every_boundary_and_nowhere_else():
    ends = [4096, 8192, 20000]
    assert split_at(ends, 0, 4096) == [(0, 4096)]
    assert split_at(ends, 4000, 200) == [(4000, 96), (4096, 104)]
    assert split_at(ends, 100, 19900) == [(100, 3996), (4096, 4096), (8192, 11808)]
    assert split_at(ends, 8192, 0) == []
    assert split_at([0, 4096], 0, 16) == [(0, 16)]  # a first registration of 0 bytes is skipped


@given(st.lists(st.integers(1, 1 << 16), min_size=1, max_size=12), st.data())
def test_split_at_covers_the_range_exactly_within_one_registration_each(steps, data):
    ends, total = [], 0
    for s in steps:
        total += s
        ends.append(total)
    offset = data.draw(st.integers(0, total))
    nbytes = data.draw(st.integers(0, total - offset))
    pieces = split_at(ends, offset, nbytes)
    assert sum(n for _, n in pieces) == nbytes and all(n > 0 for _, n in pieces)
    at = offset
    for lo, n in pieces:
        assert lo == at
        start = max([0] + [e for e in ends if e <= lo])
        end = min(e for e in ends if e > lo)
        assert start <= lo and lo + n <= end  # inside one registration
        at += n


def test_parse_table_accepts_only_a_well_formed_table():
    assert parse_table([2, 4096, 8192], 8192) == [4096, 8192]
    assert parse_table([1, 0], 4096) == [0]
    for bad in ([0, 4096], [MAX_STEPS + 1] + [1] * (MAX_STEPS + 1), [2, 8192, 4096], [2, 4096, 4096],
                [1, -1], [1, 8193], [3, 1, 2], []):
        assert parse_table(bad, 8192) is None, bad


def test_control_region_layout_scales_with_the_world():
    reply, scratch, total = ctrl_layout(2)
    assert reply >= 4096 + 2 * 64 and scratch > reply and total > scratch and total % 4096 == 0
    reply, scratch, total = ctrl_layout(1000)
    assert reply >= 4096 + 1000 * 64


def test_the_advertised_address_is_never_loopback_across_hosts(monkeypatch):
    import pytest

    from zbccl.errors import ZbcclSystemError
    from zbccl.heap.transports.mooncake import engine

    monkeypatch.delenv("ZBCCL_MOONCAKE_HOST", raising=False)
    monkeypatch.delenv("ZBCCL_HOST_ID", raising=False)
    assert engine.local_address("127.0.0.1", multi_host=False) == "127.0.0.1"
    monkeypatch.setenv("ZBCCL_MOONCAKE_HOST", "10.9.8.7")
    assert engine.local_address("127.0.0.1", multi_host=True) == "10.9.8.7"
    monkeypatch.delenv("ZBCCL_MOONCAKE_HOST")
    monkeypatch.setattr(engine, "_route_to", lambda host: "127.0.0.1")
    with pytest.raises(ZbcclSystemError, match="set ZBCCL_MOONCAKE_HOST"):
        engine.local_address("localhost", multi_host=True)
    monkeypatch.setattr(engine, "_route_to", lambda host: "127.0.0.1" if host == "localhost" else "10.1.2.3")
    assert engine.local_address("localhost", multi_host=True) == "10.1.2.3"
    monkeypatch.setattr(engine, "_route_to", lambda host: "127.0.0.1")
    monkeypatch.setenv("ZBCCL_HOST_ID", "fake-host-1")  # hosts made of one machine: loopback reaches them
    assert engine.local_address("127.0.0.1", multi_host=True) == "127.0.0.1"


def test_mooncakes_benign_start_line_is_dropped_and_everything_else_kept():
    """``engine._without``: the error line Mooncake's ``initialize`` prints on every successful start (and glog's
    header before it) never reaches the user's stderr; any other line written meanwhile does, in order. In a
    child process: the filter redirects fd 2."""
    import subprocess
    import sys

    code = (
        "import os\n"
        "from zbccl.heap.transports.mooncake.engine import _BENIGN, _without\n"
        "os.write(2, b'before\\n')\n"
        "with _without(_BENIGN):\n"
        "    os.write(2, b'WARNING: Logging before InitGoogleLogging() is written to STDERR\\n')\n"
        "    os.write(2, b'E1128 14:51:49.591527  5509 transfer_metadata.cpp:1098] Local segment descriptor not "
        "found\\n')\n"
        "    os.write(2, b'E1128 a real error: remote-supplied address is not within any registered buffer\\n')\n"
        "    os.write(2, b'no newline at the end')\n"
        "os.write(2, b'\\nafter\\n')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert out.returncode == 0, out.stderr.decode()
    assert out.stderr.decode() == ("before\nE1128 a real error: remote-supplied address is not within any registered "
                                   "buffer\nno newline at the end\nafter\n"), out.stderr.decode()
