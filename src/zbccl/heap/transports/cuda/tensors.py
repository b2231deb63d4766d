"""Zero-copy torch tensors over device addresses (a mapping of this rank's or a peer's memory).

Two ways in, both zero-copy, both with a "last tensor died" hook (``release``):

* ``__cuda_array_interface__`` (v3) through ``torch.as_tensor``: torch keeps
  the exporting object alive for as long as a storage uses it, so a
  a death hook on it (``heap/releases.py`` ``on_death``) is the hook; ``"stream": None`` asks for no
  synchronisation. torch infers the device from the pointer's attributes,
  which for VMM memory name the device holding the *physical* memory: right
  when the memory is this device's (or a peer's on the same GPU), wrong for
  a peer's memory on another GPU mapped here;
* DLPack, through a ``DLManagedTensor`` built with ctypes: the device is the
  one we state (the mapping's accessing device), and torch calls our deleter
  when the storage dies. Used whenever the first way would not give a tensor
  on ``device`` aliasing ``addr``.

:func:`device_tensor` picks; :func:`dlpack_tensor` is also usable on host
memory (``device_type`` 1), which is how it is tested without a GPU.
"""

from __future__ import annotations

import ctypes
import threading
from collections import deque
from collections.abc import Callable

import torch

from ...releases import add_queue, on_death

__all__ = ["device_tensor", "dlpack_tensor", "KDLCPU", "KDLCUDA"]

KDLCPU, KDLCUDA = 1, 2


class _Span:
    """The exporter object torch keeps alive while a storage uses the span."""

    __slots__ = ("__cuda_array_interface__", "__weakref__")

    def __init__(self, addr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (addr, False), "version": 3, "strides": None,
            "stream": None,
        }


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]

_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

_lock = threading.Lock()
_alive: dict[int, tuple] = {}  # address of a DLManagedTensor -> (it, its shape array, release)


def _delete(managed) -> None:
    with _lock:
        entry = _alive.pop(ctypes.addressof(managed.contents), None)
    if entry is not None and entry[2] is not None:
        entry[2]()


# The deleter torch calls when the last tensor died runs no Python code (a Ctrl-C raised there would be
# dropped, see heap/releases.py): it queues the pointer, and the next drain deletes.
_deleted: deque = deque()
add_queue(_deleted, _delete)
_deleter = _DELETER(_deleted.append)  # lives as long as the module


def dlpack_tensor(addr: int, nbytes: int, device_type: int, device_id: int,
                  release: Callable[[], None] | None = None) -> torch.Tensor:
    """A flat uint8 tensor over ``[addr, addr+nbytes)`` on the DLPack device ``(device_type, device_id)``."""
    m = _DLManagedTensor()
    shape = (ctypes.c_int64 * 1)(nbytes)
    m.dl_tensor.data = addr
    m.dl_tensor.device = _DLDevice(device_type, device_id)
    m.dl_tensor.ndim = 1
    m.dl_tensor.dtype = _DLDataType(1, 8, 1)  # kDLUInt, 8 bits, 1 lane
    m.dl_tensor.shape = shape
    m.dl_tensor.byte_offset = 0
    m.deleter = _deleter
    key = ctypes.addressof(m)
    with _lock:
        _alive[key] = (m, shape, release)
    try:
        capsule = _capsule_new(key, b"dltensor", None)
        return torch.utils.dlpack.from_dlpack(capsule)
    except BaseException:
        with _lock:
            _alive.pop(key, None)
        raise


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
    try:
        with torch.cuda.device(device):
            t = torch.as_tensor(span)
    except (RuntimeError, TypeError, ValueError):  # torch could not place the pointer: state the device ourselves
        t = None
    if t is not None and t.device == device and t.data_ptr() == addr:
        if release is not None:
            on_death(span, release)
        return t
    del t  # another device's physical memory mapped for this one: state the device ourselves
    return dlpack_tensor(addr, nbytes, KDLCUDA, device.index, release)
