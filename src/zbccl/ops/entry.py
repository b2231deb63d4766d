"""The start and frame every collective shares.

:func:`run_op` is each op's one entry after its local checks: a profiler range
when the torch profiler runs; at world size 1 the null backend (no handshake,
no native core); otherwise the op's channel, where an argument error found on
this rank is posted through the native call so that every rank raises
together, the op's timeout is applied, and an op left half-way (Ctrl-C, an
unexpected exception) marks the communicator broken for the peers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from ..errors import ZbcclInvalidUsageError
from .args import timeout_error
from .channel import ERR_USAGE, OpChannel, channel_of

__all__ = ["run_op", "open_op", "profiled", "profiling"]


@contextlib.contextmanager
def _record(name: str):
    with torch.autograd.profiler.record_function(name):
        yield


def profiled(op: str, t: Any):
    """A profiler range ``zbccl::<op>(<bytes>B)``."""
    nbytes = t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0  # a bad argument too
    return _record(f"zbccl::{op}({nbytes}B)")


def open_op(comm, opcode: int, error: str | None, *, op: str, timeout) -> OpChannel | None:
    """The op's channel (None at world size 1), after failing together on ``error``."""
    if comm.world_size == 1:
        error = error or timeout_error(timeout, 1.0, op=op)[1]
        if error:
            raise ZbcclInvalidUsageError(error)
        return None
    ch = comm.op_state
    if ch is None:
        ch = channel_of(comm)
    elif error is None and timeout is None and ch.plain:
        return ch  # nothing to check or set
    error = ch.enter(timeout, op=op) or error
    if error:
        seq = ch.seq
        try:
            ch.fail(opcode, error, ERR_USAGE, op=op)
        except BaseException as exc:  # Ctrl-C while the peers have not arrived yet included
            ch.left(seq, exc, op=op)
            raise
    return ch


def run_op(comm, opcode: int, error: str | None, native: Callable[..., None], single: Callable[..., None],
           args: tuple, *, op: str, timeout, t: Any) -> None:
    """Run one collective: ``single(*args)`` at world size 1, else ``native(ch, *args)`` on the
    channel, after ``error`` (this rank's local verdict) failed the op on every rank if set."""
    ch = comm.op_state
    if ch is not None and ch.plain and error is None and timeout is None and not profiling():
        seq = ch.seq  # the common case, inline: nothing to fail, check or set
        try:
            native(ch, *args)
        except BaseException as exc:
            ch.left(seq, exc, op=op)
            raise
        return None
    if profiling():
        with profiled(op, t):
            return _run(comm, opcode, error, native, single, args, op, timeout)
    return _run(comm, opcode, error, native, single, args, op, timeout)


def profiling() -> bool:
    return torch.autograd.profiler._is_profiler_enabled


def _run(comm, opcode, error, native, single, args, op, timeout) -> None:
    ch = open_op(comm, opcode, error, op=op, timeout=timeout)
    if ch is None:
        single(*args)
        return
    seq = ch.seq
    try:
        native(ch, *args)
    except BaseException as exc:
        ch.left(seq, exc, op=op)
        raise
