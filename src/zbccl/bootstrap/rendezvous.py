"""Turn ``zbccl.init`` arguments into a store, a rank and a world size.

Accepted, in order of precedence: an existing torch ``ProcessGroup``
(``group=``), an explicit ``Store`` (``store=``), an ``init_method`` URL
(``tcp://``, ``env://``, ``file://``), or, with nothing given, the torchrun
environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``).
With no environment either, zbccl runs as a single rank.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from ..errors import ZbcclInvalidUsageError, ZbcclTimeoutError

__all__ = ["Rendezvous", "resolve"]


@dataclass
class Rendezvous:
    """The outcome of :func:`resolve`."""

    store: dist.Store
    rank: int
    world_size: int
    #: Global rank numbers of this world's members (the group's ranks for ``group=``).
    members: tuple[int, ...]
    #: Key prefix isolating this world's keys inside a shared store.
    namespace: str
    how: str


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    return int(raw) if raw not in (None, "") else None


def _check_rank(rank: int, world_size: int) -> None:
    if world_size < 1:
        raise ZbcclInvalidUsageError(f"init: world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ZbcclInvalidUsageError(f"init: rank must be in [0, {world_size}), got {rank}")


def resolve(*, rank: int | None, world_size: int | None, init_method: str | None,
            store: dist.Store | None, group: object | None, timeout: float) -> Rendezvous:
    """Collective: find (or build) the store every rank will rendezvous through."""
    if group is not None:
        return _from_group(group)
    if store is not None:
        rank = rank if rank is not None else _env_int("RANK")
        world_size = world_size if world_size is not None else _env_int("WORLD_SIZE")
        if rank is None or world_size is None:
            raise ZbcclInvalidUsageError(
                "init: a store needs rank and world_size, expected arguments or RANK/WORLD_SIZE, got none")
        _check_rank(rank, world_size)
        return Rendezvous(store, rank, world_size, tuple(range(world_size)), "zbccl", "store")
    if init_method is None:
        if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT") and (
                world_size is not None or _env_int("WORLD_SIZE") is not None):
            init_method = "env://"
        elif (world_size if world_size is not None else 1) == 1:
            return Rendezvous(dist.HashStore(), 0, 1, (0,), "zbccl", "single")
        else:
            raise ZbcclInvalidUsageError(
                f"init: world_size={world_size} but no rendezvous given, expected store=, init_method= "
                "or MASTER_ADDR/MASTER_PORT in the environment, got none")
    return _from_url(init_method, rank, world_size, timeout)


def _from_url(url: str, rank: int | None, world_size: int | None, timeout: float) -> Rendezvous:
    if url.startswith("env://"):
        rank = rank if rank is not None else _env_int("RANK")
        world_size = world_size if world_size is not None else _env_int("WORLD_SIZE")
    if rank is None or world_size is None:
        raise ZbcclInvalidUsageError(
            f"init: init_method {url!r} needs rank and world_size, expected arguments or RANK/WORLD_SIZE")
    _check_rank(rank, world_size)
    try:
        st, r, ws = next(dist.rendezvous(url, rank=rank, world_size=world_size,
                                         timeout=timedelta(seconds=timeout)))
    except (RuntimeError, TimeoutError) as exc:
        msg = str(exc)
        if "timeout" in msg.lower() or "timed out" in msg.lower() or isinstance(exc, TimeoutError):
            raise ZbcclTimeoutError(
                f"init: rendezvous at {url} timed out after {timeout:.1f}s (rank 0 hosts the store; "
                f"missing ranks unknown before the store is up): {msg.splitlines()[0] if msg else ''}",
                ranks=(0,)) from exc
        raise
    return Rendezvous(st, r, ws, tuple(range(ws)), "zbccl", url.split(":", 1)[0])


def _from_group(group: object) -> Rendezvous:
    if not dist.is_initialized():
        raise ZbcclInvalidUsageError("init: group= given but torch.distributed is not initialized")
    members = tuple(dist.get_process_group_ranks(group))
    rank = dist.get_rank(group)
    if rank < 0:
        raise ZbcclInvalidUsageError("init: this process is not a member of the given group")
    store = dist.distributed_c10d._get_default_store()
    name = dist.distributed_c10d._get_process_group_name(group) or "-".join(map(str, members))
    return Rendezvous(store, rank, len(members), members, f"zbccl/pg/{name}", "group")
