"""The cuda transport's own tiny Triton kernels (triton imported on first use).

* :func:`fetch_add`: one system-scope atomic add on an int64 device word (a
  peer's signal pad through this process's mapping), returning the old value;
  the host verbs' only read-modify-write, which no driver call offers.
* :func:`gather_rows`: every listed rank's first ``n`` int64 values loaded
  through an int64 table of base pointers (the selfcheck's and the GPU
  tests' proof that a kernel reaches a peer's memory by address).

The collectives' kernels are :mod:`zbccl.native.triton`'s, not these.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from ....errors import ZbcclSystemError

__all__ = ["triton_available", "fetch_add", "gather_rows"]

_lock = threading.Lock()
_kernels: dict[str, Any] = {}


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _build() -> dict[str, Any]:
    with _lock:
        if _kernels:
            return _kernels
        try:
            import triton
            import triton.language as tl
        except ImportError as exc:
            raise ZbcclSystemError(
                f"cuda: triton is missing, expected it for the cuda transport's atomics, got ImportError: {exc} "
                "(pip install zbccl[cuda])") from None

        @triton.jit(do_not_specialize=["addr", "delta"])
        def _fetch_add(addr, delta, out):
            p = addr.to(tl.pointer_type(tl.int64))
            old = tl.atomic_add(p, delta, sem="acq_rel", scope="sys")
            tl.store(out, old)

        @triton.jit
        def _gather(ptrs, out, n, BLOCK: tl.constexpr):
            r = tl.program_id(1)
            base = tl.load(ptrs + r).to(tl.pointer_type(tl.int64))
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            tl.store(out + r * n + offs, tl.load(base + offs, mask=mask, volatile=True), mask=mask)

        _kernels.update(fetch_add=_fetch_add, gather=_gather)
        return _kernels


def fetch_add(addr: int, delta: int, out: torch.Tensor) -> None:
    """Enqueue ``out[0] = atomic_add(*(int64*)addr, delta)`` (acq_rel, system scope) on the current stream."""
    _build()["fetch_add"][(1,)](addr, delta, out)


def gather_rows(ptrs: torch.Tensor, n: int) -> torch.Tensor:
    """``[len(ptrs), n]`` int64: the first ``n`` int64 of each base pointer in ``ptrs`` (int64, on the device)."""
    out = torch.empty((ptrs.numel(), n), dtype=torch.int64, device=ptrs.device)
    block = 1024
    _build()["gather"][(triton_cdiv(n, block), ptrs.numel())](ptrs, out, n, BLOCK=block)
    return out


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b
