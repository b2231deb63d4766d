"""Words and arrays that native code owns (not heap memory: the hot table, a channel's result copies).

Python reads them only through these two helpers, so that no module above the
native layer builds a ctypes object over an address itself.
"""

from __future__ import annotations

import ctypes

import numpy as np

__all__ = ["int64_cell", "copy_int64"]


def int64_cell(addr: int) -> ctypes.c_int64:
    """A ctypes int64 over native memory at ``addr`` (plain loads and stores, the owner's thread's)."""
    return ctypes.c_int64.from_address(addr)


def copy_int64(addr: int, n: int) -> np.ndarray:
    """A copy of the ``n`` int64 that native code left at ``addr``."""
    return np.frombuffer((ctypes.c_int64 * n).from_address(addr), dtype=np.int64).copy()
