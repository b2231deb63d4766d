"""Transports, chosen by topology and device through one registry.

``select(topology, device)`` returns the transport class that serves a job;
``create(topology, device, **options)`` an instance. Transports are looked up
lazily by module path, so a backend's dependencies (CUDA, Mooncake) load only
when it is chosen.

Registered today:

* ``shm``: device ``cpu``, the ranks of one host (memfd segments, pidfd liveness).
* ``cuda``: device ``cuda``, the ranks of one host (CUDA VMM segments shared as
  POSIX descriptors, device signal pads, pidfd liveness; needs ``zbccl[cuda]``).
* ``mooncake``: the ranks of other hosts (Mooncake Transfer Engine; ``pip install
  zbccl[internode]``): put/get and signals only, no views of remote memory.
* ``routed``: device ``cpu``, several hosts: shm for the ranks of this host,
  mooncake for the others. Chosen when the ranks span hosts and Mooncake is
  installed; without it a job over several hosts maps each host's ranks over shm
  as before (and the collectives over the whole world refuse).
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass

import torch

from ...bootstrap.topology import Topology
from ...errors import ZbcclInvalidUsageError
from .base import NativeHandle, Segment, SignalPad, Transport

_log = logging.getLogger("zbccl")

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
register(Entry("mooncake", "any", True, "zbccl.heap.transports.mooncake:MooncakeTransport",
               "the inter-host transport (Mooncake Transfer Engine): pip install 'zbccl[internode]'"))
register(Entry("routed", "cpu", True, "zbccl.heap.transports.routed:RoutedTransport",
               "shm within a host, mooncake between hosts"))


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
    if multi and built and built[0].name == "routed":
        from .mooncake import missing_reason

        reason = missing_reason()
        if reason is None:
            return resolve("routed")
        _log.info("zbccl: the ranks span hosts but the mooncake transport is unavailable (%s); each host's "
                  "ranks share memory over shm only", reason)
        built = []
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
