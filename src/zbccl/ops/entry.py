"""The start every collective shares: argument errors fail together, the op's timeout is set.

An op calls :func:`open_op` with the first problem its local checks found (or
None). With a problem, every rank raises (the handshake carries it); without
one, the op's channel comes back with its timeout applied to both paths.
World size 1 has no handshake and no channel: errors raise at once.
"""

from __future__ import annotations

from ..errors import ZbcclInvalidUsageError
from .args import timeout_error
from .channel import OpChannel, channel_of
from .fastpath import native_channel

__all__ = ["open_op"]


def open_op(comm, opcode: int, error: str | None, *, op: str, timeout) -> OpChannel | None:
    """The op's channel (None at world size 1), after failing together on ``error``."""
    if comm.world_size == 1:
        error = error or timeout_error(timeout, 1.0, op=op)[1]
        if error:
            raise ZbcclInvalidUsageError(error)
        return None
    ch = channel_of(comm)
    if error is None and timeout is None and ch.broken is None and ch.timeout == ch.default_timeout:
        return ch  # the common case: nothing to check or set
    error = ch.enter(timeout, op=op) or error
    if error:
        seq = ch.seq
        try:
            ch.fail_together(opcode, error, op=op)
        except BaseException as exc:  # Ctrl-C while the peers have not arrived yet included
            ch.left(seq, exc, op=op)
            raise
    nat = native_channel(ch)
    if nat is not None:
        nat.set_timeout(ch.timeout)
    return ch
