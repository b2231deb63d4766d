"""barrier: an op of the op channel with no operands.

Synchronisation protocol (``native/csrc/core/chan_ops.c`` ``barrier``, over the handshake every
collective runs, see :mod:`.channel`): a rank posts its header (op ``BARRIER``, its sequence number
on the channel, the caller's tag in ``DIGEST``) and ``ARRIVE = seq``, and waits for every member's
``ARRIVE >= seq``: one round, as cheap as the flag barrier it replaced. It then reads every member's
ABORT lines (a member that arrived and left is named here) and checks every header: another op
there, or another tag, fails the op on every rank, naming each rank's op or tag (the DONE handshake
of a failed op). With no DONE round on success a member that passed may already post its next
header, so headers are read as a seqlock, and a member whose header moved past this op passed it,
which it does only once every header agreed. Barriers and collectives of one communicator share
its sequence numbers: ranks issue them in the same order.

Being an op of the channel, a barrier has the collectives' waits, liveness rule, ABORT marking
and error texts (``runtime/liveness.py``): a member that died, finalized or left any op half-way
is named within about one ``ZBCCL_LIVENESS_INTERVAL``; a rank that leaves a barrier half-way
(Ctrl-C, a timeout, a lost peer) marks its ABORT lines with ``WHERE_BARRIER``, or with its
communicator's role (``WHERE_EP`` under an EP ``Buffer``, whose tagged barrier this is).

:func:`run_barrier` is the engine ``Communicator.barrier`` runs (installed into the runtime layer,
which sits below the ops, by :mod:`zbccl.ops` when it is imported).
"""

from __future__ import annotations

from ..errors import ZbcclInvalidUsageError
from ..native.abi import OP_BARRIER, WHERE_BARRIER
from ..runtime.communicator import Communicator
from ..runtime.registry import collective
from . import hosts, route
from .diagnose import barrier_tags
from .entry import open_op

__all__ = ["barrier", "tagged_barrier", "run_barrier"]

_OP = "barrier"


def run_barrier(comm: Communicator, timeout: float | None, *, tag: int = 0) -> list[int] | None:
    """``comm``'s barrier on its op channel, posting ``tag`` (the caller holds the communicator's op lock).
    Returns None, or every member's tag when they differ (every member gets the same list, and the group
    stays in step: the op failed together in its handshake)."""
    if not comm._single_host:  # a communicator across hosts: a step through the pad words
        return hosts.barrier(comm, timeout, tag)
    ch = comm.op_state
    if ch is None or timeout is not None or not ch.plain:
        ch = open_op(comm, OP_BARRIER, None, op=_OP, timeout=timeout)
        if ch is None:  # world size 1: nothing to wait for
            return None
    key = (_OP, comm.role)
    plan = ch.choices.get(key)
    if plan is None:  # the struct is filled once; a barrier only changes its tag
        plan = ch.plan(key, op=OP_BARRIER, in_off=-1, out_off=-1, itemsize=1, aux=comm.role or WHERE_BARRIER)
    args = plan[0]
    args.digest = tag
    ch.where = args.aux
    try:
        ch.submit(plan, op=_OP)
    except ZbcclInvalidUsageError:
        tags = barrier_tags(ch)
        if tags is None:
            raise
        return tags
    finally:
        ch.where = 0
    return None


@collective("barrier", WHERE_BARRIER)
def tagged_barrier(tag: int, *, comm: Communicator | None = None, timeout: float | None = None) -> list[int] | None:
    """Collective: a barrier where every rank posts ``tag`` (an int64; EP's ``Exchange.sync``: op number, kind
    and phase). Returns None when every rank posted the same tag, else every rank's tag, on every rank
    (the caller decides what the disagreement means; the group stays in step). Raises as :func:`barrier`."""
    return run_barrier(comm, timeout, tag=tag)


@collective("barrier", WHERE_BARRIER)
def barrier(*, comm: Communicator | None = None, timeout: float | None = None, device: str | None = None) -> None:
    """Collective: return once every rank of ``comm`` entered (``Communicator.barrier``).

    Blocks the host. Raises :class:`~zbccl.errors.ZbcclTimeoutError` naming the ranks that never
    arrived (and what each is doing), :class:`~zbccl.errors.ZbcclRemoteError` within about a
    liveness interval when a member died, finalized or left an op half-way, and
    :class:`~zbccl.errors.ZbcclInvalidUsageError` on every rank when a member runs another op.

    ``device="cuda"``: a device barrier instead, enqueued on the current stream (later work on it starts
    once every rank's stream reached the barrier); the host does not wait, and it can be captured in a
    CUDA graph.
    """
    if device is None or device == "cpu":
        comm.barrier(timeout)
        return
    if device != "cuda" and device not in route._FAKE_DEVICES:
        raise ZbcclInvalidUsageError(f"barrier: unsupported device, expected None, 'cpu' or 'cuda', got {device!r}")
    if comm.world_size > 1:
        route.barrier(comm, device, timeout)


Communicator.barrier_engine = staticmethod(run_barrier)
