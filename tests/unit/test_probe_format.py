"""The host-state label and header line (``bench/probe.py``), without processes."""

from zbccl.bench.probe import SLOW_NS_PER_LINE, classify, format_state


def test_classify_threshold():
    assert classify(SLOW_NS_PER_LINE - 0.01) == "fast"
    assert classify(SLOW_NS_PER_LINE) == "slow"


def test_format_state():
    p = {"state": "slow", "shared_ns_per_line": 41.2, "private_ns_per_line": 6.0, "ratio": 6.87, "cpus": [0, 1]}
    assert format_state(p) == ("host state: slow (store-after-peer-read 41.2 ns/line vs 6.0 ns/line private, "
                               "ratio 6.9)")
    assert format_state({**p, "cpus": [1, 1]}).startswith("host state: slow on one CPU (")
    assert format_state(None) == "host state: not probed (world size 1)"
