"""Zero-copy torch CUDA tensors over device addresses (a mapping of this rank's or a peer's memory).

``torch.as_tensor`` on an object exposing ``__cuda_array_interface__`` (v3)
aliases the memory without copying and keeps the object alive for as long as
some storage uses it; a ``weakref.finalize`` on that object is therefore the
"last tensor died" hook, the CUDA twin of the shm transport's ctypes buffer.
``"stream": None`` tells torch not to synchronise any stream on import.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

__all__ = ["device_tensor"]


class _Span:
    """The exporter object torch keeps alive while a storage uses the span."""

    __slots__ = ("__cuda_array_interface__", "__weakref__")

    def __init__(self, addr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (addr, False), "version": 3, "strides": None,
            "stream": None,
        }


def device_tensor(addr: int, nbytes: int, device: torch.device, release: Callable[[], None] | None = None
                  ) -> torch.Tensor:
    """A flat uint8 tensor on ``device`` over ``[addr, addr+nbytes)`` (device memory of this process's mapping).

    ``release`` runs once, when the last tensor sharing the storage died.
    A zero-length span is an empty tensor on ``device`` (it aliases nothing).
    """
    if nbytes == 0:
        if release is not None:
            release()
        return torch.empty(0, dtype=torch.uint8, device=device)
    span = _Span(addr, nbytes)
    if release is not None:
        weakref.finalize(span, release)
    with torch.cuda.device(device):
        return torch.as_tensor(span, device=device)
