"""What a dead heap tensor gives back, run where a Ctrl-C can neither be lost nor cut it short.

A tensor over heap memory owns a storage object; when the last tensor sharing that storage dies, its
memory goes back (the allocator's block: ``sma.free``; a peer view: the transport's view count). A
Python finalizer (``weakref.finalize``) cannot do that safely. The interpreter runs a pending signal's
Python handler at the first instruction of any Python function, a finalizer's included, and the
``KeyboardInterrupt`` that SIGINT's handler raises there is printed and dropped ("Exception ignored
in: <finalize object ...>"): the Ctrl-C was lost (no rank raised and the job ran on, docs/reliability.md)
and the release it cut short never ran (the block stayed allocated).

So the death of a storage runs no Python code (:func:`on_death`): its weakref's callback is the queue's
``append`` (C), and the releases run in :func:`drain`, which the allocator calls at its entry points
(``CachingAllocator(before=drain)``: every allocation, statistics and snapshot), the transports' view
counts (``live_views``) and ``finalize`` call too. A drain on the main thread holds SIGINT while the
releases run: the signal's handler is swapped for one that only notes the signal, and once the queue is
empty the original handler is restored and called with what was noted (the default one raises
``KeyboardInterrupt`` in the caller). Other threads never run Python signal handlers, so their drains
need nothing. A signal arriving just before the swap or just after the restore is raised there, to the
caller, before a release was taken from the queue or after all of them ran.
"""

from __future__ import annotations

import _signal  # signal's C functions: ``signal``'s wrappers convert to and from enums (most of a drain's cost)
import logging
import signal
import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = ["on_death", "drain", "pending", "add_queue", "remove_queue", "note_interrupt", "in_callback"]

_log = logging.getLogger(__name__)



class _Ref(weakref.ref):
    """A weakref that carries its storage's release."""

    __slots__ = ("release",)


#: Weakrefs of storages that died, in order (appended by the interpreter, in C, as each one dies).
_dead: deque = deque()
#: The weakrefs of storages watched, by id (kept here: a weakref must live for its callback to run).
_watched: dict[int, _Ref] = {}
#: Other queues a drain empties, each with what applies an item: the heap_scope hook's frees (heap offsets
#: that its native deleter hands to ``deque.append`` through ctypes, again no Python code).
_queues: list[tuple[deque, Callable[[Any], None]]] = []
#: SIGINTs a callback caught where it could not raise them (a ctypes callback from native code, whose
#: exceptions ctypes prints and drops): the next drain on the main thread delivers them.
_noted: list[int] = []


def add_queue(queue: deque, apply: Callable[[Any], None]) -> None:
    """Let every :func:`drain` apply (``apply(item)``) what ``queue`` holds."""
    _queues.append((queue, apply))


def remove_queue(queue: deque) -> None:
    """Stop draining ``queue`` (what it still holds is applied first)."""
    _apply_queue(queue, next((a for q, a in _queues if q is queue), None))
    _queues[:] = [(q, a) for q, a in _queues if q is not queue]


def note_interrupt() -> None:
    """A callback that cannot raise caught a ``KeyboardInterrupt``: deliver it at the next drain."""
    _noted.append(signal.SIGINT)


_local = threading.local()
_SIGINT = int(signal.SIGINT)


class in_callback:
    """``with in_callback():`` code called from native code, where nothing may raise: a drain inside
    keeps the SIGINTs it held for the next drain outside instead of delivering them."""

    def __enter__(self) -> None:
        _local.depth = getattr(_local, "depth", 0) + 1

    def __exit__(self, *exc: object) -> None:
        _local.depth -= 1


def on_death(obj: Any, release: Callable[[], None]) -> None:
    """Run ``release`` once ``obj`` died, at the next :func:`drain`."""
    ref = _Ref(obj, _dead.append)
    ref.release = release
    _watched[id(ref)] = ref


def pending() -> int:
    """Storages that died and whose release has not run yet."""
    return len(_dead)


def drain() -> None:
    """Run the release of every storage that died (any thread; cheap when none did). On the main thread
    a SIGINT that arrives meanwhile is held until they all ran, then delivered to its handler here."""
    if not _dead and not _noted:  # the common case, on every allocation: no generator, no call
        for queue, _ in _queues:
            if queue:
                break
        else:
            return
    if threading.current_thread() is not threading.main_thread():
        _run()  # the noted interrupts wait for the main thread: only there does SIGINT raise
        return
    previous = _signal.getsignal(_SIGINT)
    if not callable(previous):  # SIG_DFL, SIG_IGN, or set outside Python: no Python handler runs
        _run()
        return
    noted: list[tuple[int, Any]] = []
    _signal.signal(_SIGINT, lambda signum, frame: noted.append((signum, frame)))
    try:
        _run()
        while _noted:
            noted.append((_noted.pop(), None))
    finally:
        _signal.signal(_SIGINT, previous)
        if noted and getattr(_local, "depth", 0):
            _noted.extend(signum for signum, _ in noted)
        elif noted:
            previous(*noted[0])


def _run() -> None:
    while _dead:
        try:
            ref = _dead.popleft()
        except IndexError:  # another thread took the last one
            return
        _watched.pop(id(ref), None)
        release, ref.release = ref.release, None
        if release is None:
            continue
        try:
            release()
        except Exception as exc:  # noqa: BLE001 - as a finalizer's: reported, the other releases still run
            _log.warning("zbccl: releasing a dead heap tensor's memory failed: %s", exc)
    for queue, apply in list(_queues):
        _apply_queue(queue, apply)


def _apply_queue(queue: deque, apply: Callable[[Any], None] | None) -> None:
    while queue and apply is not None:
        try:
            item = queue.popleft()
        except IndexError:
            return
        try:
            apply(item)
        except Exception as exc:  # noqa: BLE001 - reported, the other items still applied
            _log.warning("zbccl: a queued heap free failed: %s", exc)
