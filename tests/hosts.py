"""Hosts on one machine for the inter-host tests: a thin layer over :mod:`zbccl.tools.netns`.

The namespace hosts (a bridge, veth pairs, net+pid+ipc+uts+mount namespaces per host) live in
``src/zbccl/tools/netns.py`` so that ``zbccl bench --hosts`` reuses them from an installed zbccl.
This module keeps the tests' API: :func:`run_hosts` hands each rank a ``tests.spawn.RankContext``
(``store()``, ``init()``) and puts the checkout (``tests``, ``src``) on the ranks' path.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from zbccl.tools import netns
from zbccl.tools.netns import HostsFailure, HostsUnavailable, NetnsHosts, hosts_skip_reason

__all__ = ["HostsUnavailable", "HostsFailure", "NetnsHosts", "run_hosts", "hosts_skip_reason"]

ROOT = Path(__file__).resolve().parent.parent


def run_hosts(fn: Callable[..., Any], hosts: NetnsHosts, ranks_per_host: int = 1, **kwargs) -> list[Any]:
    """:func:`zbccl.tools.netns.run_hosts` with ``tests.spawn.RankContext`` as each rank's context."""
    return netns.run_hosts(fn, hosts, ranks_per_host, context="tests.spawn:RankContext",
                           pythonpath=[str(ROOT / "src"), str(ROOT)], cwd=ROOT, **kwargs)
