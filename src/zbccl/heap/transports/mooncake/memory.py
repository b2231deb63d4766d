"""Memory of the mooncake transport: this rank's own reservation, and the control region's layout.

Every rank registers with its engine, once each: its signal pad, its data
segment's initial range and each growth step, and a small *control region*
private to the transport:

::

    CTRL_TABLE   [n_steps][end_0][end_1]...   growth table: data ends after each registration
    CTRL_MAIL    one line per source rank     fetch_add requests to this rank: [seq][line][delta]
    CTRL_REPLY   one line                     the answer to this rank's own request: [seq][old]
    CTRL_SCRATCH SCRATCH_BYTES                staging for the words this rank writes and reads remotely

A peer reads the growth table to learn the live size and the registration
boundaries (a transfer may not span two registrations: the verbs split at
them). Only the owner writes its table: the new end first, then ``n_steps``
(ordered stores; a reader that sees ``n_steps`` sees the ends below it).
"""

from __future__ import annotations

import ctypes
import mmap
import os

from ....errors import ZbcclOutOfMemoryError, ZbcclSystemError
from ...layout import LINE, PAGE

__all__ = ["MAX_STEPS", "CTRL_TABLE", "CTRL_MAIL", "SCRATCH_BYTES", "ctrl_layout", "parse_table", "split_at", "reserve",
           "release"]

#: Registrations a data segment may have: the initial one and up to MAX_STEPS - 1 growth steps.
MAX_STEPS = 255
CTRL_TABLE = 0
CTRL_MAIL = 4096
SCRATCH_BYTES = 4096

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
_MAP_FAILED = ctypes.c_void_p(-1).value


def ctrl_layout(world_size: int) -> tuple[int, int, int]:
    """``(reply, scratch, total)`` byte offsets of a control region for ``world_size`` ranks."""
    reply = CTRL_MAIL + -(-world_size * LINE // PAGE) * PAGE
    scratch = reply + PAGE
    return reply, scratch, scratch + SCRATCH_BYTES


def parse_table(words: list[int], reserve: int) -> list[int] | None:
    """The data ends of a growth table read as int64 ``words`` (``[n_steps, end_0, ...]``), or None when it is
    not one: a count of 1 to ``MAX_STEPS``, strictly increasing ends from 0 up to ``reserve``."""
    n = words[0] if words else 0
    if not 1 <= n <= MAX_STEPS or len(words) < n + 1:
        return None
    ends = list(words[1:n + 1])
    if ends[0] < 0 or ends[-1] > reserve or any(b <= a for a, b in zip(ends, ends[1:])):
        return None
    return ends


def split_at(ends: list[int], offset: int, nbytes: int) -> list[tuple[int, int]]:
    """``[offset, offset+nbytes)`` cut at the registration boundaries ``ends``: ``(offset, length)`` pieces, in
    order, covering the range exactly (it must lie within ``ends[-1]``; a transfer may not span two)."""
    out, lo, hi = [], offset, offset + nbytes
    for end in ends:
        if lo >= hi:
            break
        if lo < end:
            out.append((lo, min(hi, end) - lo))
            lo = min(hi, end)
    return out


def reserve(nbytes: int) -> int:
    """Address of ``nbytes`` of private, zeroed, not yet backed memory (pages come on first touch)."""
    addr = _libc.mmap(None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE,
                      mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
    if addr in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        if err == 12:  # ENOMEM
            raise ZbcclOutOfMemoryError(f"heap: cannot reserve {nbytes} bytes of address space: {os.strerror(err)}")
        raise ZbcclSystemError(f"heap: mmap of {nbytes} bytes failed: {os.strerror(err)}")
    return int(addr)


def release(addr: int, nbytes: int) -> None:
    _libc.munmap(addr, nbytes)
