"""Comm slots of sub-communicators: taken by ``new_group``, returned by ``Communicator.destroy``.

Every segment's control area has ``layout.MAX_COMMS`` slots; slot 0 is the
world's, and a group uses the same slot index in each member's segment.
Slots are shared by the whole job, so they are handed out through the store:
slot ``s`` is held while the counter ``slot/<s>/held`` is 1. A group's leader
takes the first slot whose ``add(+1)`` returns 1 (a racing leader that gets
2 or more gives its increment back), and destroy's leader returns it with
``add(-1)``. A holder's increment is never undone by anyone else, so at most
one group holds a slot.

Flags only grow, so a reused slot still holds the old group's values, which
would satisfy the new group's waits at once. Each member therefore zeroes
its own lines of the slot before the new group's first store barrier (no
member waits on a slot before that barrier), and each use of a slot gets its
own store prefix so the new group never reads the old one's keys.

The counters cannot be authenticated (any local user may write the store), so
a member never trusts the slot it is handed: the leader's record is sealed
and parsed strictly (:func:`parse_slot_record`), and every member refuses a
slot that one of its own live communicators uses (:func:`check_slot_free`). Two
groups with no common member may share an index harmlessly: each uses the
lines of its own members' segments only.
"""

from __future__ import annotations

import re

from ..bootstrap.store import StoreBootstrap
from ..errors import ZbcclRemoteError
from ..heap import layout
from ..heap.heap import GlobalHeap

__all__ = ["acquire_slot", "check_slot_free", "parse_slot_record", "release_slot", "reset_slot"]

_RECORD = re.compile(rb"(-1|[0-9]{1,4}):([0-9]{1,18}):([0-9a-f]{16})")


def acquire_slot(boot: StoreBootstrap) -> tuple[int, int] | None:
    """``(slot, use)`` of a free slot now held by the caller, or None when every slot is held.

    ``use`` counts how many times the slot was taken (part of the new group's store prefix).
    """
    for slot in range(1, layout.MAX_COMMS):
        if boot.add(f"slot/{slot}/held", 1) == 1:
            return slot, boot.add(f"slot/{slot}/uses", 1)
        boot.add(f"slot/{slot}/held", -1)
    return None


def release_slot(boot: StoreBootstrap, slot: int) -> None:
    """Return ``slot`` for reuse (by the leader of the group that held it, once)."""
    boot.add(f"slot/{slot}/held", -1)


def reset_slot(heap: GlobalHeap, slot: int) -> None:
    """Zero this rank's own lines of ``slot`` (flags, op header, size vectors)."""
    heap.transport.clear_pad(heap.rank, layout.slot_offset(slot), layout.SLOT_BYTES)


def parse_slot_record(raw: bytes, *, key: str) -> tuple[int, int, str]:
    """``(slot, use, nonce)`` of a leader's record ``b"<slot>:<use>:<nonce>"``; slot -1: none was free."""
    m = _RECORD.fullmatch(raw)
    slot = int(m.group(1)) if m else None
    if slot is None or not (slot == -1 or 1 <= slot < layout.MAX_COMMS):
        raise ZbcclRemoteError(
            f"new_group: malformed slot record under '{key}', expected '<slot in [1, {layout.MAX_COMMS})>:<use>:"
            f"<nonce>', got {bytes(raw[:40])!r}")
    return slot, int(m.group(2)), m.group(3).decode()


def check_slot_free(slot: int, live: list, *, key: str) -> None:
    """Raise unless none of this rank's ``live`` communicators uses ``slot`` (what the store handed out)."""
    holders = [c for c in live if c.slot == slot]
    if holders:
        raise ZbcclRemoteError(
            f"new_group: comm slot {slot} handed out under '{key}' is in use on this rank, expected a free slot, "
            f"got the one of live group {list(holders[0].ranks)} (the store's slot counters were tampered with)")
