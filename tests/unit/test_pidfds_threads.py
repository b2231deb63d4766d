"""Pidfds (the shm transports' peer liveness) asked from several threads at once: a communicator per
thread waits on the same transport, and each wait polls the pidfds (``select.poll`` objects refuse a
concurrent ``poll()``)."""

from __future__ import annotations

import os
import threading

import pytest

from zbccl.heap.transports.liveness import Pidfds


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="no pidfd_open on this platform")
def test_dead_is_safe_from_many_threads():
    p = Pidfds()
    p.add(1, os.pidfd_open(os.getpid()))
    errors, start = [], threading.Barrier(4)

    def hammer():
        try:
            start.wait()
            for _ in range(20000):
                assert p.dead() == []
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    p.close()
    assert not errors, errors[:3]
