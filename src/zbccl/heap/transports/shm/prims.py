"""The slow Python stand-in for the native flag primitives (x86-64 only; see ``heap/flags.py``).

Plain ctypes loads and stores, which x86-64 orders enough (TSO: stores are not
reordered with stores, nor loads with loads). Same signatures as the native core.
"""

from __future__ import annotations

import ctypes
import os
import time

__all__ = ["PyPrimitives"]


class PyPrimitives:
    """Python stand-in with the native core's signatures (x86-64 only)."""

    native = False

    @staticmethod
    def load_acquire(addr: int) -> int:
        return ctypes.c_int64.from_address(addr).value

    @staticmethod
    def store_release(addr: int, value: int) -> None:
        ctypes.c_int64.from_address(addr).value = value

    signal = store_release

    @staticmethod
    def fetch_add(addr: int, delta: int) -> int:  # not atomic across processes: owner-only use
        cell = ctypes.c_int64.from_address(addr)
        old = cell.value
        cell.value = old + delta
        return old

    #: Not atomic across processes either: for counters whose readers only need to see them move.
    fetch_add_signal = fetch_add

    @staticmethod
    def wait_ge(addrs_ptr: int, n: int, target: int, spin: int, budget_ns: int) -> int:
        """Polls: ``spin`` times, then yielding for up to 1 ms, then sleeping 1 ms between polls (no futex here)."""
        addrs = (ctypes.c_uint64 * n).from_address(addrs_ptr)
        start = time.monotonic_ns()
        deadline = start + budget_ns
        polls = 0
        while True:
            first = next((i for i in range(n) if ctypes.c_int64.from_address(addrs[i]).value < target), -1)
            now = time.monotonic_ns()
            if first < 0 or now >= deadline:
                return first
            polls += 1
            if polls > spin:
                if now - start < 1_000_000:
                    os.sched_yield()
                else:
                    time.sleep(min(0.001, (deadline - now) / 1e9))

    @staticmethod
    def copy(dst: int, src: int, nbytes: int, nthreads: int = 1) -> None:
        ctypes.memmove(dst, src, nbytes)

    @staticmethod
    def copy_many(table_ptr: int, n: int, nthreads: int = 1) -> int:
        """``n`` copies from an int64 ``[n, 3]`` table of (dst, src, nbytes); returns the bytes moved."""
        table = (ctypes.c_int64 * (3 * n)).from_address(table_ptr)
        moved = 0
        for i in range(0, 3 * n, 3):
            ctypes.memmove(table[i], table[i + 1], table[i + 2])
            moved += table[i + 2]
        return moved

    @staticmethod
    def now_ns() -> int:
        return time.monotonic_ns()
