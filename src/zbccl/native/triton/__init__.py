"""Triton kernels of the device collectives (issue 23): pull-based, zero-buffer, graph-capturable.

Layout: :mod:`.geometry` (the kernel signal area; pure constants, no triton), :mod:`.prims` (what
differs between a GPU and the interpreter), :mod:`.sync` (the handshake every kernel runs: publish,
signal, bounded wait, agree, epoch), :mod:`.elements` (moving and reducing data), :mod:`.kernels`
(the ``@triton.jit`` collectives) and :mod:`.launch` (one launcher per kernel, over int64 pointer
tables).
No zbccl runtime knowledge lives here: ``ops/device.py`` validates, plans and calls the launchers.

Importing this package does not import triton; :func:`load` does, once, with a clear error when it
is missing. Set ``TRITON_INTERPRET=1`` before the first :func:`load` to run the kernels on CPU
tensors and host addresses (the shm heap), as the CI does.
"""

from __future__ import annotations

from types import ModuleType

from ...errors import ZbcclSystemError
from . import geometry

__all__ = ["geometry", "load", "available"]


def available() -> bool:
    """Whether triton can be imported (without importing it when it cannot)."""
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def load() -> ModuleType:
    """The launchers (:mod:`.launch`), importing triton on first use."""
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        raise ZbcclSystemError(
            "device ops: triton is not installed, expected triton>=3.6 for the device kernels "
            f"(pip install zbccl[cuda]), got ImportError: {exc}") from None
    from . import launch

    return launch
