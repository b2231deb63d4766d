"""Layout of one rank's segment: a control area, then the SMA heap.

Pure arithmetic, no I/O. Every flag occupies its own 64-byte cache line,
``[int64 value][int32 waiters][padding]``, the contract of the native wait
primitives (``waiters`` lets a writer skip the futex wake when nobody sleeps).

::

    offset 0                      64 KiB                          1 MiB (COMM_BYTES)       CTRL_BYTES
    | header (one line per field) | comm slot 0 | slot 1 | ...    | kernel area            | heap ...
                                  ^ 8 KiB each, MAX_COMMS of them  ^ KERNEL_AREA: one kernel slot per comm slot

Header lines are written only by the owner and read by peers:

* ``MAGIC``, ``VERSION``, ``RANK``, ``HEAP_BYTES``, ``PID``: set once at creation;
* ``STATE``: ``STATE_INIT`` -> ``STATE_READY`` -> ``STATE_FINALIZED`` (clean exit)
  or ``STATE_FAILED`` (the owner hit an error it wants peers to see);
* ``ERROR``: the :class:`~zbccl.errors.ErrorCode` behind ``STATE_FAILED``;
* ``PROBE_FLAG`` and the ``PROBE`` area: the host-state probe's flag and the lines
  it times stores into after a peer read them;
* ``COOKIE``: a random 63-bit value written by the transport before the
  segment's descriptor is handed to anyone, and published through the store;
  a peer checks it after mapping, so a segment handed over by an impostor
  (another job's, a squatter's) is refused;
* ``SECRET``: this rank's share of the job secret (``SECRET_BYTES`` random
  bytes, written like the cookie but never published): only holders of the
  segments read it (:mod:`zbccl.bootstrap.secret`).

A comm slot belongs to one communicator (the world is slot 0). Line 0 of the
slot holds the owner's barrier epoch; the other lines are reserved for the
collectives' per-op headers and flags.

The kernel area holds the device collectives' signal words (``native/triton/geometry.py`` owns the
inside of a kernel slot): one kernel slot of ``KSLOT_BYTES`` per comm slot, at
:func:`kernel_slot_offset` from the area's start. The shm transport keeps the area in its pad at
``KERNEL_AREA`` (so the Triton kernels run over the real heap under the interpreter); a device
transport keeps it in a separate device allocation of :func:`kernel_pad_bytes` bytes, at offset 0.
"""

from __future__ import annotations

from ..native.triton.geometry import KMAX_WORLD, KSLOT_BYTES

__all__ = [
    "LINE", "MAGIC_VALUE", "LAYOUT_VERSION", "HEADER_BYTES", "SLOT_BYTES", "MAX_COMMS", "CTRL_BYTES",
    "STATE_INIT", "STATE_READY", "STATE_FINALIZED", "STATE_FAILED",
    "H_MAGIC", "H_VERSION", "H_RANK", "H_HEAP_BYTES", "H_PID", "H_STATE", "H_ERROR", "H_COOKIE",
    "H_SECRET", "SECRET_BYTES", "H_PROBE_FLAG", "H_PROBE", "PROBE_BYTES",
    "slot_offset", "slot_line", "segment_bytes", "SLOT_BARRIER",
    "COMM_BYTES", "KERNEL_AREA", "KSLOT_BYTES", "KMAX_WORLD", "kernel_slot_offset", "kernel_pad_bytes",
]

LINE = 64
MAGIC_VALUE = 0x7A6263636C000001  # "zbccl" + 1
LAYOUT_VERSION = 1

HEADER_BYTES = 64 << 10
SLOT_BYTES = 8 << 10
COMM_BYTES = 1 << 20
MAX_COMMS = (COMM_BYTES - HEADER_BYTES) // SLOT_BYTES
PAGE = 4096

# Header fields: byte offsets of their lines.
H_MAGIC = 0 * LINE
H_VERSION = 1 * LINE
H_RANK = 2 * LINE
H_HEAP_BYTES = 3 * LINE
H_PID = 4 * LINE
H_STATE = 5 * LINE
H_ERROR = 6 * LINE
H_COOKIE = 7 * LINE
H_SECRET = 9 * LINE
SECRET_BYTES = 32
#: The host-state probe (``bench/probe.py``): its flag line, and PROBE_BYTES of lines the owner
#: writes and a peer reads, in the header's unused second half (no heap block, nothing in memory_stats).
H_PROBE_FLAG = 8 * LINE
H_PROBE = HEADER_BYTES // 2
PROBE_BYTES = HEADER_BYTES // 2

STATE_INIT = 0
STATE_READY = 1
STATE_FINALIZED = 2
STATE_FAILED = 3

# Lines inside a comm slot.
SLOT_BARRIER = 0


def slot_offset(slot: int) -> int:
    """Byte offset of comm slot ``slot`` inside a segment."""
    if not 0 <= slot < MAX_COMMS:
        raise ValueError(f"comm slot {slot} out of range [0, {MAX_COMMS})")
    return HEADER_BYTES + slot * SLOT_BYTES


def slot_line(slot: int, line: int) -> int:
    """Byte offset of line ``line`` of comm slot ``slot``."""
    if not 0 <= line < SLOT_BYTES // LINE:
        raise ValueError(f"slot line {line} out of range [0, {SLOT_BYTES // LINE})")
    return slot_offset(slot) + line * LINE


def kernel_slot_offset(slot: int) -> int:
    """Byte offset of comm slot ``slot``'s kernel slot inside a kernel area."""
    if not 0 <= slot < MAX_COMMS:
        raise ValueError(f"comm slot {slot} out of range [0, {MAX_COMMS})")
    return slot * KSLOT_BYTES


def kernel_pad_bytes(world: int) -> int:
    """Bytes of a kernel area serving communicators of up to ``world`` ranks (page-rounded).

    The geometry is fixed (``KMAX_WORLD`` signal words per block), so every world up to that needs the
    same; a larger one cannot run the device kernels.
    """
    if not 1 <= world <= KMAX_WORLD:
        raise ValueError(f"device kernels serve 1 to {KMAX_WORLD} ranks, got a world of {world}")
    return (MAX_COMMS * KSLOT_BYTES + PAGE - 1) // PAGE * PAGE


#: Where the kernel area starts in a shm segment's control area, and the control area's size.
KERNEL_AREA = COMM_BYTES
CTRL_BYTES = COMM_BYTES + kernel_pad_bytes(KMAX_WORLD)


def segment_bytes(heap_bytes: int) -> int:
    """Total segment size for a heap of ``heap_bytes``: control area plus heap, page-rounded."""
    return CTRL_BYTES + (heap_bytes + PAGE - 1) // PAGE * PAGE
