"""Every ZBCCL_* variable, the API's timeouts and the CLI's numbers are validated: bad or unrepresentable
values fail at once with a message naming the variable (or argument), the accepted range and the value."""

from __future__ import annotations

import pytest
import torch.distributed as dist

import zbccl
from zbccl import cli, env


@pytest.fixture
def no_dist_env(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    for var in env.VARIABLES:
        monkeypatch.delenv(var.name, raising=False)


BAD = [  # (variable, value, what the message must say besides the name and the value)
    ("ZBCCL_TIMEOUT", "1e10", "at most"),
    ("ZBCCL_LIVENESS_INTERVAL", "1e9", "at most"),
    ("ZBCCL_WAIT_POLL_US", "-7", "-1"),
    ("ZBCCL_WAIT_POLL_US", "1e18", "at most"),
    ("ZBCCL_WAIT_POLL_US", "nan", "-1"),
    ("ZBCCL_WAIT_SPIN", "-5", "-1"),
    ("ZBCCL_WAIT_SPIN", str(1 << 40), "at most"),
    ("ZBCCL_THREADS", "-5", "-1"),
    ("ZBCCL_THREADS", "100000", "at most"),
    ("ZBCCL_LOG_LEVEL", "NOPE", "DEBUG"),
    ("ZBCCL_STREAM_STORES", "sometimes", "auto"),
    ("ZBCCL_HEAP_SIZE", "99999999999T", "at most"),
    ("ZBCCL_HEAP_MAX", "99999999999T", "at most"),
    ("ZBCCL_SMA_CACHE_LIMIT", "99999999999T", "at most"),
    ("ZBCCL_ALGO", "all_reduce", "op=algo"),
    ("ZBCCL_FALLBACK_OPS", "all gather;x", "comma"),
    ("ZBCCL_PREFAULT", "maybe", "on"),
]


@pytest.mark.parametrize("name,value,says", BAD)
def test_bad_variable_is_refused_naming_it(monkeypatch, name, value, says):
    monkeypatch.setenv(name, value)
    var = next(v for v in env.VARIABLES if v.name == name)
    with pytest.raises(zbccl.ZbcclInvalidUsageError) as info:
        var.get()
    msg = str(info.value)
    assert name in msg and repr(value) in msg and says in msg, msg


@pytest.mark.parametrize("name,value,says", BAD)
def test_init_validates_every_variable_first(no_dist_env, monkeypatch, name, value, says):
    monkeypatch.setenv(name, value)
    with pytest.raises(zbccl.ZbcclInvalidUsageError, match=name):
        zbccl.init(store=dist.HashStore(), rank=0, world_size=1, heap_size="1M")
    assert not zbccl.is_initialized()


def test_defaults_and_the_largest_accepted_values_parse(monkeypatch):
    for var in env.VARIABLES:
        monkeypatch.delenv(var.name, raising=False)
        assert var.get() == var.default, var.name
    for name, value in (("ZBCCL_TIMEOUT", str(env.MAX_SECONDS)), ("ZBCCL_LIVENESS_INTERVAL", "3600"),
                        ("ZBCCL_WAIT_POLL_US", "-1"), ("ZBCCL_THREADS", "0"), ("ZBCCL_LOG_LEVEL", "debug"),
                        ("ZBCCL_HEAP_SIZE", "4T"), ("ZBCCL_STREAM_STORES", "ON")):
        monkeypatch.setenv(name, value)
        next(v for v in env.VARIABLES if v.name == name).get()


def test_sizes_are_bounded_both_ways():
    assert env.parse_size(env.MAX_BYTES) == env.MAX_BYTES
    for bad in (-5, env.MAX_BYTES + 1, "1e3", "-4K", "9" * 400, "9" * 400 + "T"):
        with pytest.raises(ValueError):
            env.parse_size(bad)


def test_huge_liveness_interval_never_reaches_finalize(no_dist_env, monkeypatch):
    # Once accepted, a 1e9 s interval made finalize() raise OverflowError; now it is refused at init.
    monkeypatch.setenv("ZBCCL_LIVENESS_INTERVAL", "1e9")
    with pytest.raises(zbccl.ZbcclInvalidUsageError, match="ZBCCL_LIVENESS_INTERVAL"):
        zbccl.init(store=dist.HashStore(), rank=0, world_size=1, heap_size="1M")
    monkeypatch.setenv("ZBCCL_LIVENESS_INTERVAL", "3600")  # large, accepted: init and finalize work
    zbccl.init(store=dist.HashStore(), rank=0, world_size=1, heap_size="1M")
    zbccl.finalize()
    assert not zbccl.is_initialized()


def _ops_with_huge_timeouts(comm) -> None:
    t = zbccl.zeros(4)  # dies with this frame, before finalize
    calls = {"barrier": lambda: comm.barrier(timeout=1e10),
             "all_gather_object": lambda: comm.all_gather_object(1, timeout=1e10),
             "new_group": lambda: comm.new_group([0], timeout=1e10),
             "all_reduce": lambda: zbccl.all_reduce(t, timeout=1e10)}
    for op, call in calls.items():
        with pytest.raises(zbccl.ZbcclInvalidUsageError, match=rf"{op}: timeout .*at most"):
            call()
    comm.barrier(timeout=env.MAX_SECONDS)
    zbccl.all_reduce(t, timeout=env.MAX_SECONDS)


def test_api_timeouts_are_capped_with_a_clear_error(no_dist_env):
    with pytest.raises(zbccl.ZbcclInvalidUsageError, match=r"init: timeout .* at most"):
        zbccl.init(store=dist.HashStore(), rank=0, world_size=1, heap_size="1M", timeout=1e10)
    comm = zbccl.init(store=dist.HashStore(), rank=0, world_size=1, heap_size="1M", timeout=env.MAX_SECONDS)
    try:
        _ops_with_huge_timeouts(comm)
    finally:
        zbccl.finalize()


@pytest.mark.parametrize("argv", [["demo", "-n", "0"], ["demo", "-n", "-3"], ["demo", "--iters", "0"],
                                  ["demo", "--size", "lots"], ["bench", "-n", "0"], ["bench", "--threads", "-2"],
                                  ["tune", "-n", "2,x"], ["tune", "-n", "0"], ["tune", "--max-size", "-4"],
                                  ["bench", "--gap-ms", "nan"], ["bench", "--idle-wait", "-1"]])
def test_cli_refuses_bad_numbers_with_a_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and "error:" in err and "Traceback" not in err, err


def test_info_reports_a_bad_setting_instead_of_failing(monkeypatch):
    from zbccl.tools.info import collect_info

    monkeypatch.setenv("ZBCCL_THREADS", "-5")
    monkeypatch.setenv("ZBCCL_LOG_LEVEL", "NOPE")
    info = collect_info()
    for name in ("ZBCCL_THREADS", "ZBCCL_LOG_LEVEL"):
        assert info["config"][name]["value"].startswith("invalid: env: bad value for " + name), info["config"][name]
    assert "invalid" in info["threads"]["policy"]


def test_cli_reports_a_bad_setting_without_a_traceback(monkeypatch, capsys):
    monkeypatch.setenv("ZBCCL_TIMEOUT", "1e10")
    monkeypatch.setattr("zbccl.tools.demo.run_demo", lambda **kw: zbccl.env.TIMEOUT.get())
    assert cli.main(["demo", "-n", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zbccl demo: error: env: bad value for ZBCCL_TIMEOUT") and "'1e10'" in err, err
