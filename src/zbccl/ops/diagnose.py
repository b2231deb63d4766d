"""What a late rank is doing, for the ops' timeout messages.

"never arrived" must mean exactly that. When an op times out, each late
rank's flags in its own comm slot tell where it is instead: its ``ARRIVE``
(the last op it entered), its ``DONE`` (the last op it finished) and its
barrier epoch. These are read after the timeout, without synchronisation: the
rank may move on while we read, so the text is a diagnosis, never a decision.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

from ..native.abi import H_OP, L_ARRIVE, L_DONE, OP_NAMES

if TYPE_CHECKING:
    from .channel import OpChannel

__all__ = ["late_message", "describe"]


def describe(ch: OpChannel, r: int) -> str:
    """One late group rank ``r``, as seen from this rank at op ``ch.seq``."""
    from ..heap import layout

    load = ch.prims.load_acquire
    arrive, done = load(ch.lines[L_ARRIVE][r]), load(ch.lines[L_DONE][r])
    if arrive == ch.seq:
        return f"rank {r} entered this collective (#{ch.seq}) but has not finished it"
    if load(ch.lines[layout.SLOT_BARRIER][r]) > getattr(ch.comm, "_epoch", 0):
        return f"rank {r} is in a different collective: it waits in barrier()"
    if arrive > done or arrive > ch.seq:
        opcode = struct.unpack_from("<q", ch.headers[r], H_OP * 8)[0]
        name = OP_NAMES.get(opcode, f"op code {opcode}")
        return (f"rank {r} is in a different collective: {name} #{arrive} (this rank is at #{ch.seq}), "
                "so an earlier op did not end on every rank")
    return f"rank {r} never arrived (the last collective it finished here is #{done})"


def late_message(ch: OpChannel, late: list[int], *, op: str) -> str:
    """The timeout message: the late ranks, and what each of them is doing."""
    what = "; ".join(describe(ch, r) for r in late)
    return f"{op}: timed out after {ch.timeout:.1f}s waiting for ranks {late}: {what}"
