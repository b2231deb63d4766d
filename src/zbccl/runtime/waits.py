"""Bounded waits on peers' flags, with death detection.

Python waits on peers' flags (p2p's use the same primitive and rule; the
collectives and the barrier wait in the native op channel) go through
:func:`wait_flags`. The native
primitive spins, yields, then sleeps on a futex, and returns after at most one
*liveness slice*. Between slices it applies the one liveness rule of
:mod:`.liveness` (this rank's finalize, every peer's ABORT line, the late
peers' state and death: the transport polls a pidfd of each, so a child that
inherited a dead rank's descriptors cannot hide its death), so a killed or
departed peer is reported as :class:`~zbccl.errors.ZbcclRemoteError` within
about one slice, and a peer that is merely slow as
:class:`~zbccl.errors.ZbcclTimeoutError` naming exactly the ranks whose flags
never reached the target.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from ..errors import ZbcclTimeoutError
from . import liveness

if TYPE_CHECKING:
    from .context import Context

__all__ = ["FlagSet", "wait_flags", "check_peers"]


class FlagSet:
    """The addresses of some ranks' flags, precomputed once for the hot path.

    ``ranks`` are global ranks (to find their segments); ``labels`` are the
    numbers errors use, the communicator's own (group) ranks.
    """

    def __init__(self, ranks: list[int], addrs: list[int], labels: list[int] | None = None) -> None:
        self.ranks = list(ranks)
        self.labels = list(labels) if labels is not None else list(ranks)
        self.addrs = np.asarray(addrs, dtype=np.uint64)
        self.ptr = int(self.addrs.ctypes.data)
        self.n = len(self.ranks)


def check_peers(ctx: Context, ranks: list[int], *, op: str, labels: dict[int, int] | None = None) -> None:
    """:func:`.liveness.check` of a wait on ``ranks`` (global) that all are still late."""
    liveness.check(ctx, ranks, op=op, labels=labels)


def wait_flags(ctx: Context, flags: FlagSet, target: int, *, timeout: float, op: str,
               spin: int | None = None) -> None:
    """Block until every flag in ``flags`` is >= ``target``.

    Raises :class:`ZbcclRemoteError` when one of their owners dies or leaves,
    :class:`ZbcclTimeoutError` (naming the late ranks) after ``timeout`` seconds.
    """
    if flags.n == 0:
        return
    prims = ctx.prims
    spin = ctx.spin if spin is None else spin
    slice_ns = ctx.liveness_ns
    if prims.wait_ge(flags.ptr, flags.n, target, spin, slice_ns) < 0:
        return
    deadline = time.monotonic() + timeout
    labels = dict(zip(flags.ranks, flags.labels))
    while True:
        pending = [r for r, a in zip(flags.ranks, flags.addrs.tolist()) if prims.load_acquire(a) < target]
        if not pending:
            return
        liveness.check(ctx, flags.ranks, op=op, pending=pending, labels=labels)
        left = deadline - time.monotonic()
        if left <= 0:
            late = tuple(labels[r] for r, a in zip(flags.ranks, flags.addrs.tolist())
                         if prims.load_acquire(a) < target)
            if not late:
                return
            raise ZbcclTimeoutError(
                f"{op}: timed out after {timeout:.1f}s waiting for ranks {list(late)}; they never arrived",
                ranks=late)
        if prims.wait_ge(flags.ptr, flags.n, target, 0, min(slice_ns, int(left * 1e9))) < 0:
            return
