"""``NetnsHosts(own_cores=True)``: each namespace host's processes on their own cores (no namespace is made
here: the split and the command that applies it; ``tests/integration/test_bench_hosts.py`` runs it)."""

from __future__ import annotations

import subprocess

import pytest

from zbccl.tools import netns


@pytest.mark.parametrize("usable,n,want", [
    ({0, 1}, 2, [{0}, {1}]),
    ({0, 1, 2, 3}, 2, [{0, 1}, {2, 3}]),
    ({2, 3, 5, 7, 8}, 2, [{2, 3}, {5, 7}]),  # an affinity with gaps; the odd core left out: equal hosts
    ({0, 1}, 3, [None, None, None]),  # fewer cores than hosts: shared, and said so
])
def test_own_cores_split_the_usable_cores(monkeypatch, usable, n, want):
    monkeypatch.setattr(netns.os, "sched_getaffinity", lambda pid: set(usable))
    monkeypatch.setattr(netns.shutil, "which", lambda tool: f"/usr/bin/{tool}")
    assert netns.NetnsHosts(n, own_cores=True).cores == [None if w is None else sorted(w) for w in want]
    assert netns.NetnsHosts(n).cores == [None] * n  # off by default: every host on all cores


def test_a_host_with_own_cores_starts_under_taskset(monkeypatch):
    monkeypatch.setattr(netns.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(netns.shutil, "which", lambda tool: f"/usr/bin/{tool}")
    started = []

    class _Popen:
        def __init__(self, argv, **kwargs):
            started.append(argv)
            self.pid = 0

    monkeypatch.setattr(subprocess, "Popen", _Popen)
    hosts = netns.NetnsHosts(2, own_cores=True)
    hosts.popen(1, [["python", "-c", "pass"]], env={}, stdout=None, stderr=None)
    assert started[0][:3] == ["taskset", "-c", "2,3"] and started[0][3:6] == ["ip", "netns", "exec"]
    shared = netns.NetnsHosts(2)
    shared.popen(0, [["python", "-c", "pass"]], env={}, stdout=None, stderr=None)
    assert started[1][:3] == ["ip", "netns", "exec"]


def test_without_taskset_the_hosts_share_the_cores(monkeypatch):
    monkeypatch.setattr(netns.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(netns.shutil, "which", lambda tool: None)
    assert netns.NetnsHosts(2, own_cores=True).cores == [None, None]
