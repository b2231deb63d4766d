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
liveness check, ``runtime/liveness.py``): it is called at each poll with the
ranks whose keys are still missing and raises when one of them died or any
member left an op half-way, or when this rank was finalized. Polls start at
``ZBCCL_LIVENESS_INTERVAL`` and back off to four times it, so a watched wait
notices within a few intervals without loading the store.

Every store call goes through :meth:`StoreBootstrap._call`: when the store's
host is gone (under torchrun, rank 0 hosts the TCPStore) the caller gets a
:class:`~zbccl.errors.ZbcclRemoteError`, not torch's ``DistNetworkError``
with a C++ backtrace in its text.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist

from .. import env
from ..errors import ZbcclRemoteError, ZbcclTimeoutError
from .base import Bootstrap, Watch

__all__ = ["StoreBootstrap"]

# How long one store.wait blocks before we look again at which ranks arrived.
_WAIT_SLICE_S = 1.0
# Under torchrun and zbccl's own URLs, rank 0 hosts the store.
_STORE_HOST_RANK = 0
T = TypeVar("T")


class StoreBootstrap(Bootstrap):
    """A :class:`Bootstrap` over a torch store for ranks ``0..world_size-1``.

    ``members`` maps this bootstrap's ranks to the rank numbers used in error
    messages (global ranks for a sub-group).
    """

    def __init__(self, store: dist.Store, rank: int, world_size: int, *, prefix: str,
                 members: tuple[int, ...] | None = None) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.prefix = prefix
        self.members = members if members is not None else tuple(range(world_size))
        self._seq: dict[str, int] = {}

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

    def set(self, key: str, value: bytes) -> None:
        self._call("set", self.store.set, self._key(key), value)

    def add(self, key: str, delta: int) -> int:
        return int(self._call("add", self.store.add, self._key(key), delta))

    def get(self, key: str, *, timeout: float, owner: int | None = None, watch: Watch | None = None) -> bytes:
        full = self._key(key)
        self._wait_keys([full], timeout=timeout, owners=[owner if owner is not None else -1], op="get", watch=watch)
        return self._call("get", self.store.get, full)

    def _wait_keys(self, keys: list[str], *, timeout: float, owners: list[int], op: str,
                   watch: Watch | None = None) -> None:
        deadline = time.monotonic() + timeout
        pending = list(zip(keys, owners))
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
                watch(tuple(o for _, o in pending if o >= 0), f"bootstrap {op}")
            left = deadline - time.monotonic()
            if left <= 0:
                missing = tuple(o for _, o in pending if o >= 0)
                raise ZbcclTimeoutError(
                    f"bootstrap {op}: timed out after {timeout:.1f}s waiting for ranks "
                    f"{list(missing)} (of {self.world_size}); they never arrived",
                    ranks=missing,
                )
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
        self._wait_keys(keys, timeout=timeout, owners=list(self.members), op=tag, watch=watch)
        if hasattr(self.store, "multi_get"):
            got = list(self._call(tag, self.store.multi_get, keys))
        else:  # pragma: no cover - old torch
            got = [self._call(tag, self.store.get, k) for k in keys]
        if seq > 0:
            # Every rank set its round-seq key, so all have read round seq-1.
            self._call(tag, self.store.delete_key, self._key(f"{tag}/{seq - 1}/{self.rank}"))
        return got
