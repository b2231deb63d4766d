"""Access to the flag primitives: the native core, or a slow Python stand-in.

The native core (``zbccl.native.core()``) gives acquire/release atomics and a
spin-yield-futex wait. If it cannot be built (no compiler), x86-64 can fall
back to plain ctypes loads and stores, which are ordered enough there (TSO:
stores are not reordered with stores, nor loads with loads); every other
architecture needs the native core and gets a clear error instead of a
silently racy fallback.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import time

from ..errors import ZbcclSystemError

__all__ = ["primitives"]

_log = logging.getLogger("zbccl")
_prims = None


class _PyPrimitives:
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

    @staticmethod
    def wait_ge(addrs_ptr: int, n: int, target: int, spin: int, budget_ns: int) -> int:
        addrs = (ctypes.c_uint64 * n).from_address(addrs_ptr)
        deadline = time.monotonic_ns() + budget_ns
        polls = 0
        while True:
            first = next((i for i in range(n) if ctypes.c_int64.from_address(addrs[i]).value < target), -1)
            if first < 0 or time.monotonic_ns() >= deadline:
                return first
            polls += 1
            if polls > spin:
                os.sched_yield()

    @staticmethod
    def now_ns() -> int:
        return time.monotonic_ns()


def primitives():
    """The flag primitives in use (built and loaded on first call)."""
    global _prims
    if _prims is None:
        try:
            from .. import native

            _prims = native.core()
        except Exception as exc:  # noqa: BLE001 - any build or load failure
            if platform.machine() not in ("x86_64", "AMD64"):
                raise ZbcclSystemError(
                    f"native core unavailable on {platform.machine()} and required there: {exc}") from exc
            _log.warning("zbccl: native core unavailable (%s); using slow Python flag waits", exc)
            _prims = _PyPrimitives()
    return _prims
