"""The routed transport: shm for the ranks of this host, mooncake for the ranks of other hosts.

``heap.transports.select`` returns it for a job over several hosts (when
Mooncake is installed). Each rank's heap is one memory: the shm transport's
memfd segment, mapped by the local ranks and registered with this rank's
Mooncake engine for the remote ones (``MooncakeTransport.attach``). Every
verb goes to the transport that reaches the rank it names:

* a local rank: shm, exactly as on one host (views, native addresses, pidfd
  liveness);
* a remote rank: mooncake (put/get and the signal verbs; views raise). A
  fetch_add from a remote rank and one from a local rank on the same word are
  both atomic on that word (the owner's atomic server uses the same native
  fetch_add as the local ranks).

A remote rank's write into this host's memory does not wake a local waiter
sleeping on a futex: the shm waits re-check every ``liveness`` interval, so it
is seen within one (protocols that cross hosts wait on the words remote ranks
write through :meth:`wait_until` here, which polls).

``viewable(rank)`` is true for the local ranks only: the heap above uses it
to tell the ranks it can map (``GlobalHeap.reachable``) from the ones it
reaches through the verbs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from ...bootstrap.base import Bootstrap
from ...bootstrap.secret import JobSecret
from ...bootstrap.topology import Topology
from ...errors import ZbcclRemoteError, ZbcclTimeoutError
from .base import NativeHandle, Segment, SignalPad, Transport
from .mooncake import MooncakeTransport
from .mooncake.liveness import backoff
from .shm import ShmTransport

__all__ = ["RoutedTransport"]


class RoutedTransport(Transport):
    """Local ranks over shm, remote ranks over mooncake (see the module docstring)."""

    name = "routed"

    def __init__(self, *, device: torch.device | str = "cpu", populate: bool = True) -> None:
        super().__init__(device=device)
        self.remote = MooncakeTransport(device=device, populate=populate)  # a missing wheel fails here
        self.local = ShmTransport(device=device, populate=populate)
        self._local: frozenset[int] = frozenset()
        self.rank = -1

    def _via(self, rank: int) -> Transport:
        return self.local if rank in self._local else self.remote

    # ------------------------------------------------------------ lifecycle
    def establish(self, bootstrap: Bootstrap, topology: Topology, *, data_bytes: list[int], job_id: str,
                  timeout: float, reserve_bytes: list[int] | None = None) -> dict[int, Segment]:
        self.rank = me = bootstrap.rank
        reserve = list(data_bytes) if reserve_bytes is None else list(reserve_bytes)
        segments = self.local.establish(bootstrap, topology, data_bytes=data_bytes, job_id=job_id,
                                        timeout=timeout, reserve_bytes=reserve)
        try:
            handle = self.local.native()
            remote = [r for r in range(bootstrap.world_size) if not topology.is_local(r)]
            got = self.remote.attach(bootstrap, topology, pad=handle.pad_addr(me), data=handle.data_addr(me),
                                     data_bytes=data_bytes, reserve_bytes=reserve, peers=remote, job_id=job_id,
                                     timeout=timeout)
        except BaseException:
            self.local.close(unmap=True)
            raise
        self._local = frozenset(topology.local_ranks)
        segments.update({r: s for r, s in got.items() if r not in segments})
        return segments

    def grow(self, nbytes: int) -> None:
        self.remote.check_growth()  # before anything changes: both grow, or neither
        self.local.grow(nbytes)  # backs and publishes for the local ranks
        self.remote.register_growth(nbytes)  # registers the step and publishes it to the remote ranks

    def close(self, *, unmap: bool) -> None:
        self.remote.close(unmap=False)  # unregisters first: no remote write lands once shm unmaps
        self.local.close(unmap=unmap)

    # ------------------------------------------------------------ geometry
    def reachable(self, rank: int) -> bool:
        return self.local.reachable(rank) or self.remote.reachable(rank)

    def viewable(self, rank: int) -> bool:
        return self.local.reachable(rank)

    def size(self, rank: int) -> int:
        return self._via(rank).size(rank)

    def signal_pad(self, rank: int) -> SignalPad:
        return self._via(rank).signal_pad(rank)

    # ------------------------------------------------------------ views
    def view(self, rank: int, offset: int, shape: Sequence[int], dtype: torch.dtype, *,
             stride: Sequence[int] | None = None, release: Callable[[], None] | None = None,
             op: str = "view") -> torch.Tensor:
        return self._via(rank).view(rank, offset, shape, dtype, stride=stride, release=release, op=op)

    def pad_view(self, rank: int, line: int, nbytes: int, *, op: str = "signal pad") -> torch.Tensor:
        return self._via(rank).pad_view(rank, line, nbytes, op=op)

    def offset_of(self, rank: int, t: torch.Tensor) -> int:
        return self.local.offset_of(rank, t) if rank in self._local else -1

    def live_views(self) -> int:
        return self.local.live_views()

    # ------------------------------------------------------------ put / get
    def put(self, rank: int, offset: int, src, *, op: str = "put") -> None:
        self._via(rank).put(rank, offset, src, op=op)

    def put_many(self, rank: int, pieces, *, op: str = "put") -> None:
        self._via(rank).put_many(rank, pieces, op=op)

    def put_async(self, rank: int, offset: int, src, *, op: str = "put"):
        return self._via(rank).put_async(rank, offset, src, op=op)

    def get(self, rank: int, offset: int, nbytes: int, *, op: str = "get") -> bytes:
        return self._via(rank).get(rank, offset, nbytes, op=op)

    def get_into(self, rank: int, offset: int, dst: torch.Tensor, *, op: str = "get") -> None:
        self._via(rank).get_into(rank, offset, dst, op=op)

    def zero(self, rank: int, offset: int, nbytes: int, *, op: str = "zero") -> None:
        self._via(rank).zero(rank, offset, nbytes, op=op)

    def clear_pad(self, rank: int, line: int, nbytes: int) -> None:
        self._via(rank).clear_pad(rank, line, nbytes)

    # ------------------------------------------------------------ signals
    def signal(self, rank: int, line: int, value: int) -> None:
        self._via(rank).signal(rank, line, value)

    def load(self, rank: int, line: int) -> int:
        return self._via(rank).load(rank, line)

    def fetch_add(self, rank: int, line: int, delta: int) -> int:
        return self._via(rank).fetch_add(rank, line, delta)

    def wait_until(self, lines: Sequence[tuple[int, int]], target: int, *, timeout: float, op: str = "wait",
                   liveness: float = 1.0, labels: dict[int, int] | None = None) -> None:
        near = [(r, ln) for r, ln in lines if r in self._local]
        if len(near) == len(lines) or not near:
            self._via(lines[0][0] if lines else self.rank).wait_until(
                lines, target, timeout=timeout, op=op, liveness=liveness, labels=labels)
            return
        self._wait_mixed(lines, target, timeout=timeout, op=op, liveness=liveness, labels=labels or {})

    def _wait_mixed(self, lines: Sequence[tuple[int, int]], target: int, *, timeout: float, op: str,
                    liveness: float, labels: dict[int, int]) -> None:
        """Words of local and remote ranks at once: poll all (remote ones by reads), backing off to 1 ms."""
        label = labels.get
        start = time.monotonic()
        deadline, next_live, pause = start + timeout, start + liveness, 0.0
        while True:
            late = [(r, v) for r, ln in lines if (v := self.load(r, ln)) < target]
            if not late:
                return
            now = time.monotonic()
            ranks = {r for r, _ in late}
            if now >= next_live or now >= deadline:
                dead = sorted(ranks & set(self.dead_peers()))
                if dead:
                    names = [label(r, r) for r in dead]
                    raise ZbcclRemoteError(f"{op}: peer lost while waiting: rank(s) {names} died",
                                           ranks=tuple(names))
                gone = sorted(ranks & set(self.remote.unreachable_peers()))
                if gone:
                    names = [label(r, r) for r in gone]
                    where = "; ".join(f"rank {label(r, r)} on {self.remote.peers[r].where()}" for r in gone)
                    raise ZbcclTimeoutError(f"{op}: host unreachable while waiting for rank(s) {names} ({where})",
                                            ranks=tuple(names))
                next_live = now + liveness
            if now >= deadline:
                names = [label(r, r) for r, _ in late]
                got = ", ".join(f"{v} on rank {label(r, r)}" for r, v in late)
                raise ZbcclTimeoutError(
                    f"{op}: timed out after {timeout:.1f}s waiting for ranks {names}, expected their signal >= "
                    f"{target}, got {got}", ranks=tuple(names))
            pause = backoff(now - start, pause, remote=True, cap=1e-3, left=deadline - now)

    # ------------------------------------------------------------ liveness, trust, native
    def dead_peers(self) -> list[int]:
        return sorted(set(self.local.dead_peers()) | set(self.remote.dead_peers()))

    def unreachable_peers(self) -> list[int]:
        return self.remote.unreachable_peers()

    def where(self, rank: int) -> str:
        return self.local.where(rank) if rank in self._local else self.remote.where(rank)

    def job_secret(self, job_id: str, world_size: int) -> JobSecret | None:
        """The job cookie's key (Mooncake authenticates nothing; the shm shares cannot cross hosts)."""
        if len(self._local) + len(self.remote.peers) != world_size:
            return None
        return self.remote.job_secret(job_id, len(self.remote.peers) + 1)

    def traffic(self) -> dict[str, int]:
        """Bytes moved to and from other hosts (the mooncake side's counters; shm moves are not counted)."""
        return self.remote.traffic()

    def describe(self) -> dict:
        return {"local_ranks": sorted(self._local), "remote": self.remote.describe()}

    def native(self) -> NativeHandle:
        return self.local.native()
