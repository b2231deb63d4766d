"""Access to the flag primitives: the native core, or a slow Python stand-in.

The native core (``zbccl.native.core()``) gives acquire/release atomics and a
spin-yield-futex wait. If it cannot be built (no compiler), x86-64 can fall
back to plain ctypes loads and stores (``transports/shm/prims.py``), which are
ordered enough there (TSO); every other
architecture needs the native core and gets a clear error instead of a
silently racy fallback.
"""

from __future__ import annotations

import logging
import platform

from ..errors import ZbcclSystemError
from .transports.shm.prims import PyPrimitives

__all__ = ["primitives", "python_copy_many"]

_log = logging.getLogger("zbccl")
_prims = None


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
            _prims = PyPrimitives()
    return _prims


#: The stand-in's row copies (``copy_many(table_ptr, n, nthreads)``), for callers whose primitives lack them.
python_copy_many = PyPrimitives.copy_many
