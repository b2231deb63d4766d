"""Rendezvous through a torch ``Store`` (TCPStore, FileStore, HashStore...).

zbccl never opens its own rendezvous socket: torch's store is the engine.
Keys live under ``zbccl/<generation>/`` where the generation counts how many
times this rank initialised zbccl on this store, so a re-``init`` after
``finalize`` on the same store never reads stale keys.

Keys do not pile up: in round ``k`` of an all-gather every rank has set its
key, so every rank has finished reading round ``k-1``; each rank then
deletes its own key of round ``k-1``. A long-running job keeps at most one
round per tag in the store.

A wait may be given a ``watch(pending_ranks, op)`` callable (the runtime's
liveness check, ``runtime/liveness.py``), else it runs the bootstrap's
``default_watch`` (init's watch once the ranks' pids are known, then the world
communicator's): it is called at each poll with the
ranks whose keys are still missing and raises when one of them died or any
member left an op (or init) half-way, or when this rank was finalized. Polls start at
``ZBCCL_LIVENESS_INTERVAL`` and back off to four times it, so a watched wait
notices within a few intervals without loading the store.

Every store call goes through :meth:`StoreBootstrap._call`: when the store's
host is gone (under torchrun, rank 0 hosts the TCPStore) the caller gets a
:class:`~zbccl.errors.ZbcclRemoteError`, not torch's ``DistNetworkError``
with a C++ backtrace in its text.

Trust (see :mod:`.secret`): any local user can write the store. Until the
heap is up, values are small fixed-format records (sizes, host facts, socket
names), parsed strictly by their readers; the bootstrap keeps a digest of each
one written and read. :meth:`StoreBootstrap.adopt_secret` then compares, under
the job's secret, every rank's digests of what it wrote with what every other
rank read (a forged init record fails there, on every rank), and from then on
seals every value it writes and opens every value it reads: a value that is
not the job's raises :class:`~zbccl.errors.ZbcclRemoteError` naming the key,
and nothing of it is parsed. Counters (:meth:`add`) cannot be sealed; their
users check what they hand out against their own state.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist

from .. import env
from ..errors import ZbcclError, ZbcclRemoteError, ZbcclTimeoutError
from .base import Bootstrap, Watch
from .secret import JobSecret, SealError

__all__ = ["StoreBootstrap", "in_range", "parse_record"]

# How long one store.wait blocks before we look again at which ranks arrived.
_WAIT_SLICE_S = 1.0
# Under torchrun and zbccl's own URLs, rank 0 hosts the store.
_STORE_HOST_RANK = 0
T = TypeVar("T")


class StoreBootstrap(Bootstrap):
    """A :class:`Bootstrap` over a torch store for ranks ``0..world_size-1``.

    ``members`` maps this bootstrap's ranks to the rank numbers used in error
    messages (global ranks for a sub-group). With ``secret`` every value is
    sealed and opened (see the module docstring).
    """

    #: The watch of every wait given none (the runtime sets it: init's, then the world communicator's), so
    #: that no store wait runs blind to a dead peer, a peer that left, or this rank's finalize.
    default_watch: Watch | None = None

    def __init__(self, store: dist.Store, rank: int, world_size: int, *, prefix: str,
                 members: tuple[int, ...] | None = None, secret: JobSecret | None = None,
                 record: bool = False) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.prefix = prefix
        self.members = members if members is not None else tuple(range(world_size))
        self._seq: dict[str, int] = {}
        self.secret = secret
        #: Until :meth:`adopt_secret` (when ``record``): digests of the all-gather values written and read.
        self._record = record and secret is None
        self._wrote: list[tuple[str, str]] = []
        self._read: list[tuple[int, str, str]] = []

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}"

    def _call(self, op: str, fn: Callable[..., T], *args) -> T:
        """``fn(*args)`` on the store; a store that stopped answering becomes a ZbcclRemoteError."""
        try:
            return fn(*args)
        except (RuntimeError, OSError) as exc:  # torch's DistError family is RuntimeError
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ZbcclRemoteError(
                f"bootstrap {op}: the rendezvous store stopped answering, expected its host (rank "
                f"{_STORE_HOST_RANK} under torchrun) alive, got {type(exc).__name__}: {first}",
                ranks=(_STORE_HOST_RANK,)) from None

    def _seal(self, full: str, value: bytes) -> bytes:
        return value if self.secret is None else self.secret.seal(full, value)

    def _open(self, full: str, blob: bytes, *, op: str, owner: int | None) -> bytes:
        if self.secret is None:
            return blob
        try:
            return self.secret.open(full, blob)
        except SealError as exc:
            who = f"rank {owner}'s" if owner is not None and owner >= 0 else "the"
            raise ZbcclRemoteError(
                f"bootstrap {op}: forged store value under key '{full}': expected {who} value sealed with "
                f"the job's secret, got {exc}; someone else wrote the rendezvous store, nothing of it was used",
                ranks=(owner,) if owner is not None and owner >= 0 else ()) from None

    def set(self, key: str, value: bytes) -> None:
        full = self._key(key)
        self._call("set", self.store.set, full, self._seal(full, value))

    def add(self, key: str, delta: int) -> int:
        return int(self._call("add", self.store.add, self._key(key), delta))

    def counters(self, keys: Sequence[str]) -> list[int]:
        """Counters read together: two round trips when they all exist (``multi_get`` would block on a missing
        one), else one :meth:`add` each (creating the missing at 0); a value that is not a counter reads as -1."""
        full = [self._key(k) for k in keys]
        if not hasattr(self.store, "multi_get") or not self._call("counters", self.store.check, full):
            return super().counters(keys)
        return [int(v) if v.isdigit() else -1 for v in self._call("counters", self.store.multi_get, full)]

    def get(self, key: str, *, timeout: float, owner: int | None = None, watch: Watch | None = None) -> bytes:
        full = self._key(key)
        self._wait_keys([full], timeout=timeout, owners=[owner if owner is not None else -1], op="get", watch=watch)
        return self._open(full, self._call("get", self.store.get, full), op="get", owner=owner)

    def _wait_keys(self, keys: list[str], *, timeout: float, owners: list[int], op: str,
                   watch: Watch | None = None) -> None:
        deadline = time.monotonic() + timeout
        pending = list(zip(keys, owners))
        watch = watch if watch is not None else self.default_watch
        if watch is not None:
            first = env.LIVENESS_INTERVAL.get()
            poll, most = first, 4 * first
        else:
            poll = most = _WAIT_SLICE_S
        while True:
            # check() is one round trip for all keys and never blocks.
            pending = [(k, o) for k, o in pending if not self._call(op, self.store.check, [k])]
            if not pending:
                return
            if watch is not None:
                try:
                    watch(tuple(o for _, o in pending if o >= 0), f"bootstrap {op}")
                except ZbcclError:
                    # A peer may write its key and then leave (raise, finalize): what it wrote counts.
                    if any(not self._call(op, self.store.check, [k]) for k, _ in pending):
                        raise
                    return
            left = deadline - time.monotonic()
            if left <= 0:
                missing = tuple(o for _, o in pending if o >= 0)
                err = ZbcclTimeoutError(
                    f"bootstrap {op}: timed out after {timeout:.1f}s waiting for ranks "
                    f"{list(missing)} (of {self.world_size}); they never arrived",
                    ranks=missing,
                )
                err.via = missing[0] if missing else None  # the rank a leave names on its ABORT line (VIA)
                raise err
            try:
                self.store.wait([pending[0][0]], timedelta(seconds=min(poll, left)))
            except Exception:  # noqa: BLE001 - its own timeout types; a dead store fails check() next
                pass
            poll = min(2 * poll, most)

    def all_gather(self, value: bytes, *, timeout: float, tag: str = "ag", watch: Watch | None = None) -> list[bytes]:
        seq = self._seq.get(tag, 0)
        self._seq[tag] = seq + 1
        base = f"{tag}/{seq}"
        self.set(f"{base}/{self.rank}", value)
        keys = [self._key(f"{base}/{r}") for r in range(self.world_size)]
        if self._record:
            self._wrote.append((keys[self.rank], _digest(value)))
        self._wait_keys(keys, timeout=timeout, owners=list(self.members), op=tag, watch=watch)
        if hasattr(self.store, "multi_get"):
            got = list(self._call(tag, self.store.multi_get, keys))
        else:  # pragma: no cover - old torch
            got = [self._call(tag, self.store.get, k) for k in keys]
        if seq > 0:
            # Every rank set its round-seq key, so all have read round seq-1.
            self._call(tag, self.store.delete_key, self._key(f"{tag}/{seq - 1}/{self.rank}"))
        if self._record:
            self._read.extend((r, k, _digest(v)) for r, (k, v) in enumerate(zip(keys, got)))
        if self.secret is None:
            return got
        return [self._open(k, v, op=tag, owner=self.members[r]) for r, (k, v) in enumerate(zip(keys, got))]

    def adopt_secret(self, secret: JobSecret | None, *, timeout: float) -> None:
        """Collective: check the values exchanged so far under ``secret``, then seal everything from now on.

        Every rank publishes (sealed) the digests of the values it wrote; each
        compares them with the digests of what it read. Raises
        :class:`~zbccl.errors.ZbcclRemoteError` on every rank that read a value
        its writer never wrote, naming the key. With ``secret`` None (some rank
        is out of reach of the transport that would share it) it only stops
        recording: values stay unauthenticated, and users of the store that
        need authentication refuse to run.
        """
        self._record = False
        if secret is None:
            self._wrote, self._read = [], []
            return
        self.secret = secret
        wrote = dict(self._wrote)
        got = self.all_gather(json.dumps(wrote).encode(), timeout=timeout, tag="auth")
        claims = {}
        for r, raw in enumerate(got):
            claims.update({k: (r, v) for k, v in _strict_json(raw, dict, op="auth").items()})
        forged = [(r, key) for r, key, digest in self._read if claims.get(key, (r, None))[1] != digest]
        self._wrote, self._read = [], []
        # A second (sealed) round, so that every rank fails when any rank read a forged value.
        verdicts = self.all_gather(json.dumps([[self.members[r], k] for r, k in forged]).encode(), timeout=timeout,
                                   tag="auth")
        for r, raw in enumerate(verdicts):
            seen = _strict_json(raw, list, op="auth")
            if seen:
                writer, key = seen[0]
                who = "this rank" if r == self.rank else f"rank {self.members[r]}"
                raise ZbcclRemoteError(
                    f"init: forged store value under key '{key}' (read by {who}): expected the value rank {writer} "
                    "wrote (its digest, sealed with the job's secret), got another; someone else wrote the "
                    "rendezvous store", ranks=(writer,))


def parse_record(raw: bytes, check: Callable[[object], T], *, op: str, rank: int, what: str) -> T:
    """``check(json.loads(raw))`` for a record rank ``rank`` published: anything that does not parse or
    fails ``check`` (which raises ValueError, KeyError or TypeError) is a :class:`~zbccl.errors.ZbcclRemoteError`
    naming the rank and ``what`` was expected, never a stray exception from deep inside."""
    try:
        return check(json.loads(raw))
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError):
        raise ZbcclRemoteError(f"{op}: malformed record of rank {rank} in the rendezvous store, expected {what}, "
                               f"got {bytes(raw[:60])!r}", ranks=(rank,)) from None


def in_range(value: object, lo: int, hi: int) -> int:
    """``value`` as an int in ``[lo, hi]`` (a JSON integer, not a bool or a float); ValueError otherwise."""
    if type(value) is not int or not lo <= value <= hi:
        raise ValueError(value)
    return value


def _digest(value: bytes) -> str:
    return hashlib.sha256(value).hexdigest()


def _strict_json(raw: bytes, kind: type, *, op: str):
    """``raw`` as JSON of type ``kind`` (an authenticated record that does not parse is still refused)."""
    try:
        value = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        value = None
    if not isinstance(value, kind):
        raise ZbcclRemoteError(f"bootstrap {op}: malformed record, expected JSON {kind.__name__}, "
                               f"got {bytes(raw[:40])!r}")
    return value
