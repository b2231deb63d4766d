"""The shm transport's memory: memfds, their mappings, and tensors over mapped addresses.

Everything here works on raw addresses in this process; nothing outside
``heap/transports/shm`` sees one (the transport hands out tensors and, to
native code only, its :class:`~..base.NativeHandle`).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from collections.abc import Callable

import torch

from ....errors import ZbcclOutOfMemoryError, ZbcclSystemError
from ...releases import on_death

__all__ = ["map_fd", "prefault", "unmap_addr", "create_memfd", "tensor_at", "store_i64", "load_i64"]

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0x8000)
_MAP_FIXED = getattr(mmap, "MAP_FIXED", 0x10)
_MADV_POPULATE_WRITE = 23  # Linux 5.14+


def map_fd(fd: int, nbytes: int, *, populate: bool, reserve: int | None = None) -> int:
    """``mmap`` a shared, read-write view of ``fd`` over ``reserve`` bytes (default ``nbytes``).

    Only the first ``nbytes`` (the memfd's size) are populated; the rest of the
    reservation lies past EOF until the owner grows the memfd.
    """
    reserve = nbytes if reserve is None else reserve
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    addr = _libc.mmap(None, reserve, prot, mmap.MAP_SHARED | (_MAP_POPULATE if populate and reserve == nbytes else 0),
                      fd, 0)
    if addr in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise ZbcclSystemError(f"heap: mmap of {reserve} bytes failed: {os.strerror(err)}")
    if populate and reserve != nbytes:
        # Populate the live range only (MAP_POPULATE over the whole reservation would try
        # every page past EOF): the same pages mapped again in place, fixed, populated.
        fixed = _libc.mmap(addr, nbytes, prot, mmap.MAP_SHARED | _MAP_FIXED | _MAP_POPULATE, fd, 0)
        if fixed != addr:
            err = ctypes.get_errno()
            _libc.munmap(addr, reserve)
            raise ZbcclSystemError(f"heap: populating {nbytes} bytes failed: {os.strerror(err)}")
    return int(addr)


def prefault(addr: int, nbytes: int) -> bool:
    """Fault ``[addr, addr+nbytes)`` in for writing now; False where the kernel lacks MADV_POPULATE_WRITE."""
    return _libc.madvise(addr, nbytes, _MADV_POPULATE_WRITE) == 0


def unmap_addr(addr: int, nbytes: int) -> None:
    _libc.munmap(addr, nbytes)


def create_memfd(name: str, nbytes: int) -> int:
    """A close-on-exec, 0600 memfd of ``nbytes``, its pages reserved now (``posix_fallocate``)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, nbytes)
        # Reserve the pages now: tmpfs otherwise overcommits and a later first
        # touch on a full machine kills the process with SIGBUS.
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.ENOSPC, errno.ENOMEM):
            raise ZbcclOutOfMemoryError(
                f"heap: cannot reserve a {nbytes}-byte shared segment: {exc.strerror}; "
                "lower heap_size or free memory") from None
        raise ZbcclSystemError(f"heap: creating the shared segment failed: {exc}") from None
    return fd


def store_i64(addr: int, value: int) -> None:
    """A plain int64 store (no ordering): for words nobody reads yet (the cookie before the handout)."""
    ctypes.c_int64.from_address(addr).value = value


def load_i64(addr: int) -> int:
    """A plain int64 load (no ordering)."""
    return ctypes.c_int64.from_address(addr).value


def tensor_at(addr: int, nbytes: int, release: Callable[[], None] | None = None) -> torch.Tensor:
    """A flat uint8 CPU tensor over ``[addr, addr+nbytes)``, zero-copy.

    The ctypes array under it owns the storage: ``release`` runs once after the
    last tensor sharing that storage died, at the next drain (:mod:`zbccl.heap.releases`).
    """
    buf = (ctypes.c_char * max(nbytes, 1)).from_address(addr)
    if release is not None:
        on_death(buf, release)
    return torch.frombuffer(buf, dtype=torch.uint8)[:nbytes]
