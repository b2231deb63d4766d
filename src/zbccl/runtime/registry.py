"""The process's default communicator, and the guard every public op goes through.

:func:`collective` wraps each public op (``zbccl.all_reduce`` ...) and
:func:`guarded` each collective method of ``Communicator``. The guard:

1. resolves ``comm=`` (``None``: the default communicator),
2. refuses a communicator that cannot be used: zbccl finalized, the
   communicator destroyed, this process a forked child of the one that called
   ``init``, or the placeholder a non-member got from ``new_group``,
3. takes the communicator's FIFO op lock for the whole op (see
   :mod:`.oplock`), which also marks the op in flight for ``finalize``,
4. calls the op with the resolved ``comm=``; further keywords pass through,
5. is the op's boundary: an exception that leaves the op, at any point after it
   started (the first op's store read included), goes through
   :func:`.liveness.leave`, which marks this rank's ABORT line unless every rank
   raises that error together, so the peers name this rank within a liveness
   interval instead of waiting out the timeout.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from .. import env
from ..errors import ZbcclInvalidUsageError, ZbcclTimeoutError
from ..native.abi import WHERE_COLLECTIVE
from .liveness import FINALIZED_WHILE_WAITING, leave

if TYPE_CHECKING:
    from .communicator import Communicator

__all__ = ["collective", "guarded", "resolve_comm", "check_usable", "get_default", "set_default",
           "is_initialized", "in_forked_child", "mark_forked_child", "note_fallback", "FINALIZED_WHILE_WAITING",
           "set_device_ops_factory", "device_ops_factory", "close_device_state"]

F = TypeVar("F", bound=Callable[..., Any])
_log = logging.getLogger("zbccl")

_default: Communicator | None = None
_forked_from: int | None = None  # pid of the parent whose communicator this process inherited
_fallback: str | None = None  # why the 'zbccl' torch backend runs the world on gloo (resolve_comm says it)
# Makes a communicator's device ops (``Communicator.device_ops``): registered by the ops layer, which this
# layer may not import.
_device_ops_factory: Callable[[Communicator, str, str], Any] | None = None


def get_default() -> Communicator | None:
    return _default


def set_default(comm: Communicator | None) -> None:
    global _default, _fallback
    _default = comm
    if comm is not None:
        _fallback = None


def note_fallback(reason: str | None) -> None:
    """Record why the torch backend runs the default group on gloo: the error of a later zbccl call
    without a communicator (``zbccl.empty()``) then says so instead of only "not initialized"."""
    global _fallback
    _fallback = reason


def set_device_ops_factory(factory: Callable[[Communicator, str, str], Any]) -> None:
    """Register ``factory(comm, device, op) -> device ops`` (the ops layer does, at its import)."""
    global _device_ops_factory
    _device_ops_factory = factory


def device_ops_factory() -> Callable[[Communicator, str, str], Any]:
    if _device_ops_factory is None:  # only a process that imported zbccl.runtime without zbccl.ops
        raise ZbcclInvalidUsageError("device_ops: the ops layer is not loaded, expected `import zbccl` first")
    return _device_ops_factory


def close_device_state(comm: Communicator) -> None:
    """Drop ``comm``'s device ops (destroy, finalize): each one's ``close()`` if it has one; errors are logged."""
    state = getattr(comm, "device_state", None)
    if not state:
        return
    items = list(state.items())
    state.clear()
    for device, ops in items:
        close = getattr(ops, "close", None)
        if close is None:
            continue
        try:
            close()
        except Exception as exc:  # noqa: BLE001 - teardown goes on
            _log.info("zbccl: closing the %s ops of %r: %s", device, comm, exc)


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
    if ctx.left is not None:
        raise ZbcclInvalidUsageError(f"{op}: this communicator is broken on rank {comm.rank}: {ctx.left}; finalize "
                                     "and init again", ranks=(comm.rank,))
    if comm.destroyed:
        raise ZbcclInvalidUsageError(f"{op}: this communicator was destroyed, expected a live communicator")


def resolve_comm(comm: Communicator | None = None, *, op: str = "zbccl") -> Communicator:
    """``comm``, or the default communicator; raises unless it can be used (see :func:`check_usable`)."""
    if comm is None:
        if _forked_from is not None:
            raise _forked_error(op)
        if _default is None:
            why = f" (init_process_group ran this job on gloo instead: {_fallback})" if _fallback else ""
            raise ZbcclInvalidUsageError(f"{op}: zbccl is not initialized, expected zbccl.init() first{why}")
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
    if not 0 < wait <= env.MAX_SECONDS:
        wait = ctx.timeout  # the op itself reports a bad timeout
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


# The body of every public op's guard, generated per op with the op's own parameters (see _guard_source): a
# wrapper taking *args/**kwargs costs ~150 ns more per call than one with the op's signature, which is most of
# a cached all_reduce's Python part. {params}: the op's parameter list; {call}: the same names passed on, with
# comm=c; {timeout}: the op's timeout parameter, or None.
_GUARD = """
def make(_fn, _name, _where, _d):
    def run({params}):
        c = _default if comm is None else comm
        try:  # the common case first: a live, uncontended communicator (or this thread's reentry)
            lock = c._op_lock
            fast = c._live and lock.try_acquire()
        except AttributeError:
            fast = False
        if fast and not c._live:
            lock.release()  # finalize ran in between (see _enter): the checks below say so
            check_usable(c, _name)
            fast = False
        if not fast:
            c = resolve_comm(comm, op=_name)
            lock = c._op_lock
            _enter(c, _name, {timeout})
        try:
            return _fn({call})
        except BaseException as exc:
            leave(c._ctx, exc, op=_name, where=c.role or _where)
            raise
        finally:
            lock.release()
    return run
"""


def _guard_source(fn: Callable) -> tuple[str, tuple]:
    """``(source, defaults)`` of the guard of ``fn``, whose parameters must be named ones (no ``*args``,
    ``**kwargs``, none starting with ``_`` or named as the guard's locals) with a keyword-only ``comm=None``."""
    sig = inspect.signature(fn)
    params, call, defaults, star = [], [], [], False
    for p in sig.parameters.values():
        if (p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY) or p.name.startswith("_")
                or p.name in ("c", "lock", "fast", "exc")):  # the guard's own names
            raise TypeError(f"collective: {fn.__qualname__} must take named parameters only, got {p}")
        if p.kind == p.KEYWORD_ONLY and not star:
            params.append("*")
            star = True
        default = ""
        if p.default is not p.empty:
            default = f"=_d[{len(defaults)}]"
            defaults.append(p.default)
        params.append(p.name + default)
        call.append(("c" if p.name == "comm" else p.name) if p.kind != p.KEYWORD_ONLY else
                    f"{p.name}={'c' if p.name == 'comm' else p.name}")
    comm = sig.parameters.get("comm")
    if comm is None or comm.kind != comm.KEYWORD_ONLY or comm.default is not None:
        raise TypeError(f"collective: {fn.__qualname__} must take a keyword-only comm=None")
    timeout = "timeout" if "timeout" in sig.parameters else "None"
    return _GUARD.format(params=", ".join(params), call=", ".join(call), timeout=timeout), tuple(defaults)


def collective(op: str, where: int = WHERE_COLLECTIVE) -> Callable[[F], F]:
    """Decorator of a public op ``fn(..., *, comm=None, ...)``: resolve, check, serialise, and mark ABORT if
    the op is left half-way (``where``: its protocol, ``native/abi.py`` ``ABORT_WHERE``). The guard has
    ``fn``'s own signature (generated from it, as ``collections.namedtuple`` builds its class)."""

    def deco(fn: F) -> F:
        source, defaults = _guard_source(fn)
        ns: dict = {}
        exec(source, globals(), ns)  # noqa: S102 - the text is _GUARD and fn's parameter names only
        return functools.wraps(fn)(ns["make"](fn, op, where, defaults))  # type: ignore[return-value]

    return deco


def guarded(op: str, where: int) -> Callable[[F], F]:
    """Decorator of a collective ``Communicator`` method: check, serialise, mark ABORT if it is left
    half-way (as :func:`collective`)."""

    def deco(fn: F) -> F:
        @functools.wraps(fn)
        def run(self: Communicator, *args: Any, **kwargs: Any) -> Any:
            check_usable(self, op)
            _enter(self, op, kwargs.get("timeout"))
            try:
                return fn(self, *args, **kwargs)
            except BaseException as exc:
                leave(self._ctx, exc, op=op, where=self.role or where)
                raise
            finally:
                self._op_lock.release()

        return run  # type: ignore[return-value]

    return deco
