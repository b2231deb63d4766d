"""Pidfds (the shm transports' peer liveness) asked from several threads at once: a communicator per
thread waits on the same transport, and each wait polls the pidfds (``select.poll`` objects refuse a
concurrent ``poll()``)."""

from __future__ import annotations

import os

import pytest

from tests.threads import run_threads
from zbccl.heap.transports.liveness import Pidfds


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="no pidfd_open on this platform")
def test_dead_is_safe_from_many_threads():
    p = Pidfds()
    p.add(1, os.pidfd_open(os.getpid()))

    def hammer():
        for _ in range(20000):
            assert p.dead() == []

    errors = run_threads([hammer] * 4)
    p.close()
    assert not errors, errors[:3]
