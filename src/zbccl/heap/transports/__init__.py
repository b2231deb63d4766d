"""Transports, chosen by topology and device through one registry.

``select(topology, device)`` returns the transport class that serves a job;
``create(topology, device, **options)`` an instance. Transports are looked up
lazily by module path, so a backend's dependencies (CUDA, Mooncake) load only
when it is chosen.

Registered today:

* ``shm``: device ``cpu``, the ranks of one host (memfd segments, pidfd liveness);
* ``cuda``: device ``cuda``, the ranks of one host (CUDA VMM segments shared as
  POSIX descriptors, device signal pads, pidfd liveness; needs ``zbccl[cuda]``).

Reserved, with a clear error until its issue lands: ``mooncake`` (any device,
more than one host: Mooncake Transfer Engine).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

from ...bootstrap.topology import Topology
from ...errors import ZbcclInvalidUsageError
from .base import NativeHandle, Segment, SignalPad, Transport

__all__ = ["Entry", "NativeHandle", "Segment", "SignalPad", "Transport", "create", "entries", "register",
           "resolve", "select"]


@dataclass(frozen=True)
class Entry:
    """A registered transport: ``target`` is ``"module:Class"`` (None: planned, not built yet)."""

    name: str
    device: str
    multi_host: bool
    target: str | None
    note: str = ""


_entries: dict[str, Entry] = {}


def register(entry: Entry) -> None:
    """Add (or replace) a transport under ``entry.name``."""
    _entries[entry.name] = entry


def entries() -> list[Entry]:
    """Every registered transport, planned ones included."""
    return list(_entries.values())


register(Entry("shm", "cpu", False, "zbccl.heap.transports.shm:ShmTransport"))
register(Entry("cuda", "cuda", False, "zbccl.heap.transports.cuda.transport:CudaTransport"))
register(Entry("mooncake", "any", True, None, "the inter-host transport (Mooncake Transfer Engine) is not built yet"))


def resolve(name: str) -> type[Transport]:
    """The transport class registered as ``name``; a clear error for an unknown or planned one."""
    entry = _entries.get(name)
    if entry is None:
        raise ZbcclInvalidUsageError(
            f"heap: unknown transport, expected one of {sorted(_entries)}, got {name!r}")
    if entry.target is None:
        raise ZbcclInvalidUsageError(f"heap: the {name} transport is not available yet: {entry.note}")
    module, cls = entry.target.split(":")
    return getattr(importlib.import_module(module), cls)


def select(topology: Topology, device: torch.device | str = "cpu") -> type[Transport]:
    """The transport class for a job of ``topology`` whose heaps live on ``device``.

    Raises :class:`~zbccl.errors.ZbcclInvalidUsageError` naming what is missing
    when no built transport serves the combination (a CUDA device, several hosts).
    """
    kind = torch.device(device).type
    multi = len({info.host_id for info in topology.infos}) > 1
    fits = [e for e in _entries.values() if e.device in (kind, "any") and (e.multi_host or not multi)]
    built = [e for e in fits if e.target is not None and e.device == kind]
    if built:
        return resolve(built[0].name)
    # More than one host: today each host maps its own ranks (shm, cuda), and collectives over the
    # whole world refuse (no inter-host transport); the store-based ops still work.
    if multi and kind in ("cpu", "cuda"):
        return resolve("shm" if kind == "cpu" else "cuda")
    planned = "; ".join(f"{e.name}: {e.note}" for e in fits if e.target is None) or "none is registered"
    raise ZbcclInvalidUsageError(
        f"heap: no transport for device {kind} over {'several hosts' if multi else 'one host'}, expected "
        f"device cpu (shm) or cuda (cuda), got {kind}; planned: {planned}")


def create(topology: Topology, device: torch.device | str = "cpu", **options) -> Transport:
    """An instance of :func:`select`'s transport, built with ``options`` (e.g. ``populate`` for shm)."""
    return select(topology, device)(device=device, **options)
