"""The SGLang plugin's switch, flag and version pin, without SGLang installed.

``register`` imports ``sglang.srt.plugins.hook_registry`` only; a stand-in module records what it
registers. Covers: the flag is always added and routes nothing by itself; ``ZBCCL_ENABLE=1``
registers the routing hooks on the pinned version only; another version is refused with exactly
one warning naming both versions; ``--enable-zbccl`` parses and becomes ``ZBCCL_ENABLE=1`` for the
workers; a parser that already has the flag keeps its own.
"""

from __future__ import annotations

import argparse
import enum
import sys
import types
import warnings

import pytest

import zbccl.integrations.sglang as plugin
from zbccl.integrations.sglang import group


class _HookType(enum.Enum):
    BEFORE = "before"
    AFTER = "after"
    AROUND = "around"
    REPLACE = "replace"


@pytest.fixture
def registry(monkeypatch):
    """A stand-in ``sglang.srt.plugins.hook_registry`` recording (target, hook, type), and a fresh plugin state."""
    calls: list[tuple[str, object, _HookType]] = []

    class HookRegistry:
        @classmethod
        def register(cls, target, hook, hook_type=_HookType.AFTER, *, source=None):
            calls.append((target, hook, hook_type))

    names = ["sglang", "sglang.srt", "sglang.srt.plugins", "sglang.srt.plugins.hook_registry"]
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules["sglang.srt.plugins.hook_registry"].HookRegistry = HookRegistry
    sys.modules["sglang.srt.plugins.hook_registry"].HookType = _HookType
    monkeypatch.setattr(plugin, "_state", {"registered": False, "warned": False})
    monkeypatch.setattr(plugin, "installed_version", lambda: "0.5.23")
    monkeypatch.delenv("ZBCCL_ENABLE", raising=False)
    monkeypatch.delenv("ZBCCL_SGLANG_PROBE", raising=False)
    return calls


GC = "sglang.srt.distributed.parallel_state.GroupCoordinator"


def test_version_pin():
    assert plugin.SGLANG_VERSION == "0.5.23"
    assert plugin.supported("0.5.23") and plugin.supported("0.5.23+cpu")
    assert not plugin.supported("0.5.22") and not plugin.supported("0.5.24") and not plugin.supported("none")


def test_without_the_switch_only_the_flag_is_registered(registry):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plugin.register()
        plugin.register()  # idempotent
    assert [(t, k.name) for t, _, k in registry] == [
        ("sglang.srt.server_args.ServerArgs.add_cli_args", "AFTER"),
        ("sglang.srt.server_args.ServerArgs.from_cli_args", "AROUND")]


def test_the_switch_registers_every_route(registry, monkeypatch):
    monkeypatch.setenv("ZBCCL_ENABLE", "1")
    plugin.register()
    got = {t: k.name for t, _, k in registry}
    assert got[f"{GC}.__init__"] == "AFTER"
    for name in group.ROUTES:
        assert got[f"{GC}.{name}"] == "AROUND", name
    assert got["sglang.srt.model_executor.model_runner.ModelRunner.forward"] == "AROUND"
    assert got["sglang.srt.managers.scheduler.Scheduler.get_internal_state"] == "AFTER"
    assert got["sglang.srt.layers.moe.fused_moe_triton.layer.create_moe_dispatcher"] == "AROUND"
    assert len(got) == len(registry), "a target registered twice"


def test_the_probe_wraps_the_routes_and_reports_once(registry, monkeypatch):
    monkeypatch.setenv("ZBCCL_ENABLE", "1")
    monkeypatch.setenv("ZBCCL_SGLANG_PROBE", "1")
    plugin.register()
    targets = [t for t, _, _ in registry]
    ar = [i for i, t in enumerate(targets) if t == f"{GC}.all_reduce"]
    assert len(ar) == 2 and registry[ar[1]][1].__name__ == "zbccl_probe_all_reduce"  # registered last: outermost
    assert targets.count("sglang.srt.managers.scheduler.Scheduler.get_internal_state") == 1


def test_another_version_is_refused_with_one_warning(registry, monkeypatch):
    monkeypatch.setenv("ZBCCL_ENABLE", "1")
    monkeypatch.setattr(plugin, "installed_version", lambda: "0.5.22")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plugin.register()
        plugin.register()
        # the flag path too: still one warning per process
        plugin._from_cli_args(lambda cls, args: "built", object, argparse.Namespace(enable_zbccl=True))
    msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 1 and "refused" in msgs[0] and "expected 0.5.23, got 0.5.22" in msgs[0], msgs
    assert [t for t, _, _ in registry] == ["sglang.srt.server_args.ServerArgs.add_cli_args",
                                           "sglang.srt.server_args.ServerArgs.from_cli_args"]


def test_flag_parses_and_becomes_the_workers_switch(registry, monkeypatch):
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    assert plugin._add_cli_args(None, parser) is None
    assert parser.parse_args(["--tp", "2"]).enable_zbccl is False
    args = parser.parse_args(["--tp", "2", "--enable-zbccl"])
    assert args.enable_zbccl is True
    seen = []
    got = plugin._from_cli_args(lambda cls, a: seen.append((cls, a)) or "server_args", "ServerArgs", args)
    assert got == "server_args" and seen == [("ServerArgs", args)]
    import os

    assert os.environ.get("ZBCCL_ENABLE") == "1" and plugin.enabled()
    monkeypatch.delenv("ZBCCL_ENABLE")
    plugin._from_cli_args(lambda cls, a: None, "ServerArgs", parser.parse_args([]))
    assert "ZBCCL_ENABLE" not in os.environ and not plugin.enabled()


def test_a_parser_that_has_the_flag_keeps_its_own():
    parser = argparse.ArgumentParser()
    parser.add_argument("--enable-zbccl", type=int, default=7)
    plugin._add_cli_args(None, parser)  # no argparse conflict
    assert parser.parse_args(["--enable-zbccl", "3"]).enable_zbccl == 3


def test_env_parsing(monkeypatch):
    for text, want in [("1", True), ("true", True), ("0", False), ("", False)]:
        monkeypatch.setenv("ZBCCL_ENABLE", text)
        assert plugin.enabled() is want, text
    monkeypatch.setenv("ZBCCL_ENABLE", "maybe")
    with pytest.raises(ValueError):
        plugin.enabled()


def test_routes_are_group_coordinator_methods_with_an_implementation():
    assert len(set(group.ROUTES)) == len(group.ROUTES)
    for name in group.ROUTES:
        assert callable(getattr(group.ZbcclGroup, name)), name
        assert group.around(name).__name__ == f"zbccl_{name}"
    assert "world" not in group.ROUTED_GROUPS and "tp" in group.ROUTED_GROUPS and "pp" in group.ROUTED_GROUPS
