"""barrier: an op of the op channel with no operands.

Synchronisation protocol (``native/csrc/core/chan_ops.c`` ``barrier``, over the handshake every
collective runs, see :mod:`.channel`): a rank posts its header (op ``BARRIER``, its sequence number
on the channel) and ``ARRIVE = seq``, waits for every member's ``ARRIVE >= seq``, checks that every
header is a barrier of the same number (a rank running another op there fails the op on every rank,
naming each rank's op), then ``DONE = seq`` and waits for every ``DONE >= seq`` (so no fast rank's
next header overwrites this one before every member read it). Barriers and collectives of one
communicator share its sequence numbers: ranks issue them in the same order.

Being an op of the channel, a barrier has the collectives' waits, liveness rule, ABORT marking
and error texts (``runtime/liveness.py``): a member that died, finalized or left any op half-way
is named within about one ``ZBCCL_LIVENESS_INTERVAL``; a rank that leaves a barrier half-way
(Ctrl-C, a timeout, a lost peer) marks its ABORT lines with ``WHERE_BARRIER``, or with its
communicator's role (``WHERE_EP`` under an EP ``Buffer``, whose tagged barrier this is).

:func:`run_barrier` is the engine ``Communicator.barrier`` runs (installed into the runtime layer,
which sits below the ops, by :mod:`zbccl.ops` when it is imported).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..native.abi import OP_BARRIER, WHERE_BARRIER
from ..runtime.communicator import Communicator
from ..runtime.registry import collective
from .entry import open_op

if TYPE_CHECKING:
    from .channel import OpChannel

__all__ = ["barrier", "run_barrier"]

_OP = "barrier"


def run_barrier(comm: Communicator, timeout: float | None) -> None:
    """``comm``'s barrier on its op channel (the caller holds the communicator's op lock)."""
    ch: OpChannel | None = open_op(comm, OP_BARRIER, None, op=_OP, timeout=timeout)
    if ch is None:  # world size 1: nothing to wait for
        return
    where = comm.role or WHERE_BARRIER
    ch.where = where
    try:
        ch.run(_OP, op=OP_BARRIER, in_off=-1, out_off=-1, itemsize=1, aux=where)
    finally:
        ch.where = 0


@collective("barrier", WHERE_BARRIER)
def barrier(*, comm: Communicator | None = None, timeout: float | None = None) -> None:
    """Collective: return once every rank of ``comm`` entered (``Communicator.barrier``).

    Blocks the host. Raises :class:`~zbccl.errors.ZbcclTimeoutError` naming the ranks that never
    arrived (and what each is doing), :class:`~zbccl.errors.ZbcclRemoteError` within about a
    liveness interval when a member died, finalized or left an op half-way, and
    :class:`~zbccl.errors.ZbcclInvalidUsageError` on every rank when a member runs another op.
    """
    comm.barrier(timeout)


Communicator.barrier_engine = staticmethod(run_barrier)
