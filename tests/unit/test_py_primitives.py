"""The Python stand-in for the native flag primitives (``heap/transports/shm/prims.py``), used when the native
core cannot be built: its waits back off to sleeping, so a waiting thread (a transport's mapper thread waits
for seconds at a time) does not hold a core."""

from __future__ import annotations

import time

import numpy as np

from zbccl.heap.transports.shm.prims import PyPrimitives


def test_wait_ge_returns_the_first_late_flag_after_its_budget_and_sleeps_meanwhile():
    words = np.zeros(2, dtype=np.int64)
    addrs = np.asarray([words.ctypes.data, words.ctypes.data + 8], dtype=np.uint64)
    ptr = int(addrs.ctypes.data)
    words[:] = [3, 1]
    assert PyPrimitives.wait_ge(ptr, 2, 1, 0, 0) == -1  # both satisfied
    wall, cpu = time.monotonic(), time.thread_time()
    assert PyPrimitives.wait_ge(ptr, 2, 2, 0, 200_000_000) == 1  # the second never reaches 2
    wall, cpu = time.monotonic() - wall, time.thread_time() - cpu
    assert wall >= 0.2 and cpu < 0.3 * wall, (wall, cpu)  # it slept most of the budget (spinning: cpu ~ wall)


def test_fetch_add_signal_adds_and_returns_the_old_value():
    word = np.zeros(1, dtype=np.int64)
    assert PyPrimitives.fetch_add_signal(word.ctypes.data, 5) == 0
    assert PyPrimitives.fetch_add_signal(word.ctypes.data, 1) == 5 and word[0] == 6
