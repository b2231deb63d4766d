"""The process's default communicator, and the guard every public op goes through.

:func:`collective` wraps each public op (``zbccl.all_reduce`` ...) and
:func:`guarded` each collective method of ``Communicator``. The guard:

1. resolves ``comm=`` (``None``: the default communicator),
2. refuses a communicator that cannot be used: zbccl finalized, the
   communicator destroyed, this process a forked child of the one that called
   ``init``, or the placeholder a non-member got from ``new_group``,
3. takes the communicator's FIFO op lock for the whole op (see
   :mod:`.oplock`), which also marks the op in flight for ``finalize``,
4. calls the op with the resolved ``comm=``; further keywords pass through.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from ..errors import ZbcclInvalidUsageError, ZbcclTimeoutError

if TYPE_CHECKING:
    from .communicator import Communicator

__all__ = ["collective", "guarded", "resolve_comm", "check_usable", "get_default", "set_default",
           "is_initialized", "in_forked_child", "mark_forked_child", "FINALIZED_WHILE_WAITING"]

F = TypeVar("F", bound=Callable[..., Any])

#: What an op still waiting when ``finalize()`` ran on its rank raises (after the op's name).
FINALIZED_WHILE_WAITING = "finalize() was called on this rank while the op waited"

_default: Communicator | None = None
_forked_from: int | None = None  # pid of the parent whose communicator this process inherited


def get_default() -> Communicator | None:
    return _default


def set_default(comm: Communicator | None) -> None:
    global _default
    _default = comm


def is_initialized() -> bool:
    return _default is not None


def in_forked_child() -> bool:
    """True in a process forked from an initialized zbccl process (it may not use zbccl)."""
    return _forked_from is not None


def mark_forked_child(parent_pid: int) -> None:
    global _forked_from
    _forked_from = parent_pid


def _forked_error(op: str) -> ZbcclInvalidUsageError:
    return ZbcclInvalidUsageError(
        f"{op}: in a forked child of an initialized zbccl process, zbccl cannot be used, expected the process "
        f"that called zbccl.init() (pid {_forked_from}), got its forked child (pid {os.getpid()}); start workers "
        "with the 'spawn' or 'forkserver' method, or fork before zbccl.init()")


def check_usable(comm: Any, op: str) -> None:
    """Raise :class:`ZbcclInvalidUsageError` unless ``comm`` is a communicator this process may use now."""
    refuse = getattr(comm, "_refuse", None)
    if refuse is not None:  # the non-member placeholder from new_group
        refuse(op)
    ctx = getattr(comm, "_ctx", None)
    if ctx is None:
        raise ZbcclInvalidUsageError(f"{op}: comm must be a zbccl Communicator or None, got {type(comm).__name__}")
    if ctx.forked:
        raise _forked_error(op)
    if ctx.finalized:
        raise ZbcclInvalidUsageError(f"{op}: zbccl was finalized, expected an initialized communicator")
    if comm.destroyed:
        raise ZbcclInvalidUsageError(f"{op}: this communicator was destroyed, expected a live communicator")


def resolve_comm(comm: Communicator | None = None, *, op: str = "zbccl") -> Communicator:
    """``comm``, or the default communicator; raises unless it can be used (see :func:`check_usable`)."""
    if comm is None:
        if _forked_from is not None:
            raise _forked_error(op)
        if _default is None:
            raise ZbcclInvalidUsageError(f"{op}: zbccl is not initialized, expected zbccl.init() first")
        comm = _default
    try:  # the common case first: a live communicator
        if comm._live:
            return comm
    except AttributeError:
        pass
    check_usable(comm, op)
    return comm


def _enter(comm: Communicator, op: str, timeout: Any) -> None:
    """Take ``comm``'s op lock (FIFO) or raise; the op then counts as in flight until release.

    After taking it, ``finalized`` is read again: ``finalize`` sets it before it
    looks for ops in flight, so an op either is seen (and waited for) or sees it.
    """
    lock = comm._op_lock
    ctx = comm._ctx
    if lock.try_acquire():
        if not comm._live:
            lock.release()
            check_usable(comm, op)
            raise ZbcclInvalidUsageError(f"{op}: zbccl was finalized, expected an initialized communicator")
        return
    try:
        wait = ctx.timeout if timeout is None else float(timeout)
    except (TypeError, ValueError):
        wait = ctx.timeout  # the op itself reports a bad timeout
    if not 0 < wait < float("inf"):
        wait = ctx.timeout
    if not lock.acquire(wait, stop=comm._stopped):
        if ctx.finalized:
            raise ZbcclInvalidUsageError(f"{op}: {FINALIZED_WHILE_WAITING}")
        check_usable(comm, op)
        raise ZbcclTimeoutError(
            f"{op}: timed out after {wait:.1f}s waiting for this rank's earlier ops on this communicator, "
            "expected other threads to finish them, got the communicator still busy", ranks=(comm.rank,))
    if comm._stopped():  # it changed while this op queued
        lock.release()
        if ctx.finalized:
            raise ZbcclInvalidUsageError(f"{op}: {FINALIZED_WHILE_WAITING}")
        check_usable(comm, op)


def collective(op: str) -> Callable[[F], F]:
    """Decorator of a public op ``fn(*args, comm=None, **kwargs)``: resolve, check, serialise."""

    def deco(fn: F) -> F:
        @functools.wraps(fn)
        def run(*args: Any, comm: Communicator | None = None, **kwargs: Any) -> Any:
            c = _default if comm is None else comm
            try:  # the common case first: a live, uncontended communicator (or this thread's reentry)
                lock = c._op_lock
                fast = c._live and lock.try_acquire()
            except AttributeError:
                fast = False
            if fast:
                if c._live:
                    try:
                        return fn(*args, comm=c, **kwargs) if kwargs else fn(*args, comm=c)
                    finally:
                        lock.release()
                lock.release()  # finalize ran in between (see _enter): the checks below say so
                check_usable(c, op)
            c = resolve_comm(comm, op=op)
            lock = c._op_lock
            _enter(c, op, kwargs.get("timeout"))
            try:
                return fn(*args, comm=c, **kwargs)
            finally:
                lock.release()

        return run  # type: ignore[return-value]

    return deco


def guarded(op: str) -> Callable[[F], F]:
    """Decorator of a collective ``Communicator`` method: check, serialise."""

    def deco(fn: F) -> F:
        @functools.wraps(fn)
        def run(self: Communicator, *args: Any, **kwargs: Any) -> Any:
            check_usable(self, op)
            _enter(self, op, kwargs.get("timeout"))
            try:
                return fn(self, *args, **kwargs)
            finally:
                self._op_lock.release()

        return run  # type: ignore[return-value]

    return deco
