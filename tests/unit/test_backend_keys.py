"""Which ops the torch backend leaves to gloo on a group spanning hosts (pure logic: no world)."""

from __future__ import annotations

from types import SimpleNamespace

from zbccl.adapters import backend


def test_one_host_leaves_nothing_to_gloo():
    assert backend.gloo_keys_across_hosts(SimpleNamespace(_single_host=True)) == frozenset()
    assert backend.gloo_keys_across_hosts(None) == frozenset()


def test_without_the_collectives_across_hosts_only_barrier_runs_on_zbccl(monkeypatch):
    monkeypatch.setattr(backend, "ops_across_hosts", lambda: frozenset({"barrier"}))
    keys = backend.gloo_keys_across_hosts(SimpleNamespace(_single_host=False))
    every = {k for ks in backend.FALLBACK_KEYS.values() for k in ks}
    assert keys == every - {"barrier"}


def test_with_them_only_p2p_and_what_is_missing_run_on_gloo(monkeypatch):
    routed = {"all_reduce", "all_gather_into_tensor", "all_gather_v", "reduce_scatter_tensor", "reduce_scatter_v",
              "all_to_all_single", "broadcast", "barrier"}
    monkeypatch.setattr(backend, "ops_across_hosts", lambda: frozenset(routed))
    assert backend.gloo_keys_across_hosts(SimpleNamespace(_single_host=False)) == {"send", "recv"}
    monkeypatch.setattr(backend, "ops_across_hosts", lambda: frozenset(routed - {"reduce_scatter_v"}))
    # reduce_scatter's list form (unequal sizes) and reduce are built on reduce_scatter_v
    assert backend.gloo_keys_across_hosts(SimpleNamespace(_single_host=False)) == {"send", "recv", "reduce_scatter",
                                                                                     "reduce"}


def test_the_build_routes_every_collective_across_hosts():
    assert backend.ops_across_hosts() >= {"barrier", "all_reduce", "all_to_all_single"}


def test_every_op_key_says_what_it_is_built_on():
    assert set(backend._BUILT_ON) == {k for ks in backend.FALLBACK_KEYS.values() for k in ks}
