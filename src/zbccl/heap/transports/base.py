"""The transport seam: every access to a peer's memory goes through one :class:`Transport`.

Modelled on torch SymmetricMemory (``get_buffer``, ``get_signal_pad``,
``put_signal``/``wait_signal``), MSCCL++'s Connection/Semaphore and NCCL's
per-transport ``ncclTransport``. A transport owns, for every rank it can
reach:

* a **data segment**: the rank's heap, addressed by byte ``offset`` from 0 up
  to the rank's *live size* (:meth:`Transport.size`; heaps grow, and only the
  owner grows its own);
* a **signal pad**: the rank's control area of 8-byte signal words, addressed
  by byte ``line`` offset (:meth:`Transport.signal_pad`). The layout of the pad
  (header, comm slots, op lines) is :mod:`zbccl.heap.layout`'s; each word the
  protocols wait on sits alone on a :attr:`Transport.LINE`-byte line.

The two are separate regions: offsets into one never reach the other, and
every verb checks its range against the region it names. The CPU transport
keeps both in one memfd (the pad first); a CUDA transport may keep the pad
in host memory and the data in HBM.

Verbs and what they guarantee (ranks are global ranks; ``op`` names the
caller in error messages):

* **Views** (:meth:`~Transport.view`, :meth:`~Transport.view_bytes`,
  :meth:`~Transport.pad_view`): a tensor aliasing the memory, zero-copy, on
  :attr:`~Transport.device`, of a rank whose memory is mapped here
  (:meth:`~Transport.viewable`; a remote rank of a transport between hosts is
  reachable through put/get and the signals only, and its views raise). Bounds-checked against the live size at the call
  (never later: a view stays valid for as long as it lives, as heaps only
  grow and the mapping outlives every view). Plain loads and stores through a
  view carry no ordering: publish them with :meth:`~Transport.signal` and
  observe them after :meth:`~Transport.wait_until` / :meth:`~Transport.load`.
  Not a collective; does not block.
* **put / get** of a byte range (:meth:`~Transport.put`,
  :meth:`~Transport.get`, :meth:`~Transport.get_into`,
  :meth:`~Transport.zero`): complete when the call returns (the bytes are in
  the destination, for this process); visible to another rank only after a
  later :meth:`~Transport.signal` that the reader observes (release/acquire).
  Blocking, host-synchronous; not collective.
* **Signals**: :meth:`~Transport.signal` is a release store of one int64
  word (everything this process wrote before it, through any verb or view,
  is visible to a rank that observes the value) and wakes waiters;
  :meth:`~Transport.load` is an acquire load; :meth:`~Transport.fetch_add` an
  atomic read-modify-write (acquire and release). :meth:`~Transport.wait_until`
  blocks until every named word is ``>= target`` (words are expected to only
  grow), with a timeout, checking liveness every ``liveness`` seconds: it
  raises :class:`~zbccl.errors.ZbcclRemoteError` naming a dead peer, and
  :class:`~zbccl.errors.ZbcclTimeoutError` naming exactly the ranks whose word
  never reached the target. After it returns, everything the signallers wrote
  before their signals is visible here.
* **Liveness**: :meth:`~Transport.dead_peers` never blocks; a peer whose
  process exited (even one killed with SIGKILL, even if a child it forked
  still holds its descriptors) is listed at the next call.
* **Lifecycle**: :meth:`~Transport.establish` is a collective over the ranks
  of the topology; :meth:`~Transport.grow` is the owner's alone and publishes
  the new size (a peer that learns an offset from the owner through any
  signal reads a size that covers it); :meth:`~Transport.close` is local.

Thread-safety: every verb may be called from any thread; concurrent writes to
the same bytes are the caller's race, as with plain memory. :meth:`grow` and
:meth:`close` must not race with verbs on the same rank's memory (the heap's
allocator and ``finalize`` serialise them).

Native code (the op channel, the copy kernels) runs over the same memory; it
gets what it needs (segment and pad base addresses, the liveness
descriptors) through :meth:`Transport.native`, the one method that hands
out addresses. Python above this seam never does address arithmetic itself.
"""

from __future__ import annotations

import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from ...bootstrap.base import Bootstrap
from ...bootstrap.secret import JobSecret
from ...bootstrap.topology import Topology
from ...errors import ZbcclInvalidUsageError, ZbcclOutOfMemoryError

__all__ = ["Segment", "SignalPad", "NativeHandle", "Transport", "Pending", "DONE", "ViewRelease", "pause"]


@dataclass
class Segment:
    """One rank's data segment as this process knows it.

    ``nbytes``: the live size at mapping time (a peer's may grow later: ask
    :meth:`Transport.size`); ``reserved``: the most it may grow to.
    """

    rank: int
    nbytes: int
    device: str = "cpu"
    owner: bool = False
    reserved: int = 0

    def __post_init__(self) -> None:
        self.reserved = max(self.reserved, self.nbytes)


@dataclass(frozen=True)
class SignalPad:
    """One rank's signal pad: ``nbytes`` of int64 signal words, one per ``line`` bytes where waited on."""

    rank: int
    nbytes: int
    line: int


class NativeHandle(ABC):
    """Native-core handle: only for native code that runs over this transport.

    Addresses (in this process) of every reachable rank's data segment and
    signal pad, and the liveness descriptors the native waits poll. Python
    passes these to native functions (the op channel's table, copy tables);
    it never reads or writes memory through them itself.
    """

    @abstractmethod
    def data_addr(self, rank: int, offset: int = 0, nbytes: int = 0, *, op: str = "heap") -> int:
        """Address of byte ``offset`` of ``rank``'s data segment (``[offset, offset+nbytes)`` bounds-checked)."""

    @abstractmethod
    def pad_addr(self, rank: int, line: int = 0) -> int:
        """Address of byte ``line`` of ``rank``'s signal pad."""

    @abstractmethod
    def liveness_fd(self, rank: int) -> int:
        """A descriptor that becomes readable (``POLLIN``) once ``rank``'s process exited, or -1 if none.

        Owned by the transport (closed at :meth:`Transport.close`): borrow it, never close it.
        """


class Transport(ABC):
    """Memory of the ranks one process can reach, and the verbs over it (see the module docstring)."""

    #: Registry name (``heap.transports.select`` returns transports by it).
    name: ClassVar[str] = ""
    #: Bytes of one signal line: a waited-on word sits alone on one.
    LINE: ClassVar[int] = 64
    #: Byte offset of the device kernels' signal area (``layout.kernel_pad_bytes``) in each rank's pad.
    KERNEL_LINE: ClassVar[int] = 0

    def __init__(self, *, device: torch.device | str = "cpu") -> None:
        #: The device the data segments are on (tensors from the views are on it).
        self.device = torch.device(device)
        #: The stream the verbs' device work goes on; None for host transports, whose verbs complete on the
        #: calling thread (a device transport documents whether a verb is stream-ordered or host-synchronous).
        self.stream = None
        self._tables: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}  # pointer_tables' cache

    # ------------------------------------------------------------ lifecycle
    @abstractmethod
    def establish(self, bootstrap: Bootstrap, topology: Topology, *, data_bytes: list[int], job_id: str,
                  timeout: float, reserve_bytes: list[int] | None = None) -> dict[int, Segment]:
        """Collective: create this rank's segment and signal pad, and map every reachable peer's.

        ``data_bytes`` (initial sizes) and ``reserve_bytes`` (most each may grow
        to; default: no growth) are indexed by rank. Returns the segments keyed
        by rank, this rank's included; ranks the transport cannot reach are
        absent. Fails on every rank together (a :class:`~zbccl.errors.ZbcclError`
        naming the rank that could not set up), leaving nothing behind.
        """

    def grow(self, nbytes: int) -> None:
        """Owner only: make this rank's data segment ``nbytes`` long and publish the size (release).

        Not collective. Raises :class:`~zbccl.errors.ZbcclOutOfMemoryError` with
        nothing changed when it cannot (beyond the reservation, machine full).
        """
        raise ZbcclOutOfMemoryError(f"heap: grow: the {self.name} transport cannot grow a segment")

    @abstractmethod
    def close(self, *, unmap: bool) -> None:
        """Local: drop connections and liveness descriptors; unmap only when ``unmap`` (no view is alive)."""

    # ------------------------------------------------------------ geometry
    @abstractmethod
    def reachable(self, rank: int) -> bool:
        """Whether ``rank``'s memory is mapped here."""

    def viewable(self, rank: int) -> bool:
        """Whether :meth:`view` and :meth:`pad_view` can alias ``rank``'s memory here (it is mapped in this
        process). A transport between hosts reaches a remote rank only through put/get and the signal verbs:
        ``reachable`` but not ``viewable``, and its views raise :class:`~zbccl.errors.ZbcclInvalidUsageError`."""
        return self.reachable(rank)

    @abstractmethod
    def size(self, rank: int) -> int:
        """``rank``'s live data size (acquire: covers every offset its owner signalled before)."""

    @abstractmethod
    def signal_pad(self, rank: int) -> SignalPad:
        """``rank``'s signal pad region."""

    # ------------------------------------------------------------ views
    @abstractmethod
    def view(self, rank: int, offset: int, shape: Sequence[int], dtype: torch.dtype, *,
             stride: Sequence[int] | None = None, release: Callable[[], None] | None = None,
             op: str = "view") -> torch.Tensor:
        """Zero-copy tensor over ``rank``'s data at ``offset`` (``stride`` default: contiguous).

        Raises :class:`~zbccl.errors.ZbcclInvalidUsageError` (touching nothing) unless the
        whole span lies within the rank's live size and ``offset`` is aligned to ``dtype``.
        ``release`` runs once, when the last tensor sharing this view's storage dies.
        """

    def view_bytes(self, rank: int, offset: int, nbytes: int, *, release: Callable[[], None] | None = None,
                   op: str = "view") -> torch.Tensor:
        """:meth:`view` as ``nbytes`` uint8."""
        return self.view(rank, offset, (nbytes,), torch.uint8, release=release, op=op)

    @abstractmethod
    def pad_view(self, rank: int, line: int, nbytes: int, *, op: str = "signal pad") -> torch.Tensor:
        """Zero-copy uint8 tensor over ``[line, line+nbytes)`` of ``rank``'s signal pad (bounds-checked).

        For the protocols' headers and vectors, written before a :meth:`signal` and read after
        a :meth:`wait_until`; the waited-on words themselves go through the signal verbs.
        """

    @abstractmethod
    def offset_of(self, rank: int, t: torch.Tensor) -> int:
        """Byte offset in ``rank``'s data of ``t``'s first element when ``t``'s whole storage lies in
        ``rank``'s live data (and holds at least one byte), else -1. Never raises for a foreign tensor."""

    def live_views(self) -> int:
        """Views (:meth:`view`) of peers' memory still alive (views of this rank's own memory are accounted for
        by whoever owns that memory: the allocator's blocks). ``close(unmap=True)`` is safe only when neither is."""
        return 0

    # ------------------------------------------------------------ put / get
    def put(self, rank: int, offset: int, src: torch.Tensor | bytes | bytearray | memoryview, *,
            op: str = "put") -> None:
        """Copy ``src`` (a tensor's bytes, or a bytes-like) to ``rank``'s data at ``offset`` (bounds-checked)."""
        data = _as_bytes(src)
        self.view_bytes(rank, offset, data.numel(), op=op).copy_(data)

    def put_many(self, rank: int, pieces: Sequence[tuple[int, torch.Tensor | bytes | bytearray | memoryview]], *,
                 op: str = "put") -> None:
        """Copy each ``(offset, src)`` of ``pieces`` to ``rank``'s data: every piece is bounds-checked before any
        lands, and all have landed on return. No order among the pieces is promised (a transport may move them
        at once: mooncake batches them into one round trip), so a reader that must know they landed checks
        something the writer computed over them, or waits for a :meth:`signal` written after this returns."""
        datas = [(offset, _as_bytes(src)) for offset, src in pieces]
        for offset, data in datas:
            self.check_data(rank, offset, data.numel(), op=op)
        for offset, data in datas:
            if data.numel():
                self.put(rank, offset, data, op=op)

    def put_async(self, rank: int, offset: int, src: torch.Tensor, *, op: str = "put") -> Pending:
        """Start :meth:`put` of ``src`` (a contiguous tensor) and return: the bytes have landed once the returned
        :class:`Pending` says :meth:`~Pending.done`, and ``src`` must stay alive and unchanged until then. The
        write moves on its own (an engine's threads, a copy engine, or at once); polling reports it and retries
        a failed one (or raises), so a caller that waits for a peer's answer to it polls it meanwhile (the
        mesh's waits do). Bounds are checked before anything moves.
        A transport whose put is a copy (one host) completes it here."""
        self.put(rank, offset, src, op=op)
        return DONE

    def get(self, rank: int, offset: int, nbytes: int, *, op: str = "get") -> bytes:
        """The ``nbytes`` at ``offset`` of ``rank``'s data (bounds-checked), copied out."""
        return self.view_bytes(rank, offset, nbytes, op=op).cpu().numpy().tobytes()

    def get_into(self, rank: int, offset: int, dst: torch.Tensor, *, op: str = "get") -> None:
        """Copy ``dst.nbytes`` bytes at ``offset`` of ``rank``'s data into ``dst`` (any device, contiguous or not)."""
        nbytes = dst.numel() * dst.element_size()
        src = self.view(rank, offset, (nbytes,), torch.uint8, op=op) if nbytes else None
        if src is not None:
            dst.copy_(src.view(dst.dtype).view(dst.shape))

    def zero(self, rank: int, offset: int, nbytes: int, *, op: str = "zero") -> None:
        """Zero ``[offset, offset+nbytes)`` of ``rank``'s data (bounds-checked)."""
        if nbytes:
            self.view_bytes(rank, offset, nbytes, op=op).zero_()

    def clear_pad(self, rank: int, line: int, nbytes: int) -> None:
        """Zero ``[line, line+nbytes)`` of ``rank``'s signal pad. Only before any rank waits on those words."""
        if nbytes:
            self.pad_view(rank, line, nbytes, op="clear_pad").zero_()

    # ------------------------------------------------------------ signals
    @abstractmethod
    def signal(self, rank: int, line: int, value: int) -> None:
        """Release-store ``value`` into the word at ``line`` of ``rank``'s pad; wake its waiters."""

    @abstractmethod
    def load(self, rank: int, line: int) -> int:
        """Acquire-load the word at ``line`` of ``rank``'s pad."""

    @abstractmethod
    def fetch_add(self, rank: int, line: int, delta: int) -> int:
        """Atomically add ``delta`` to the word (acquire and release; wakes waiters); return the old value."""

    @abstractmethod
    def wait_until(self, lines: Sequence[tuple[int, int]], target: int, *, timeout: float, op: str = "wait",
                   liveness: float = 1.0, labels: dict[int, int] | None = None) -> None:
        """Block until every ``(rank, line)`` word is ``>= target``, or raise.

        Checks :meth:`dead_peers` every ``liveness`` seconds among the ranks still
        awaited (:class:`~zbccl.errors.ZbcclRemoteError` naming them) and raises
        :class:`~zbccl.errors.ZbcclTimeoutError` after ``timeout`` seconds naming
        the ranks whose word never reached ``target`` (``labels`` maps a global
        rank to the number the message uses). Not collective.
        """

    # ------------------------------------------------------------ liveness
    def watch_peers(self, topology: Topology) -> None:  # noqa: B027 - optional: transports that can, do
        """Local, before :meth:`establish`: start watching the peers' processes as ``topology`` announced
        them (their pids, not yet verified), so that :meth:`dead_peers` reports a peer that dies during
        init. :meth:`establish` replaces what it watches with verified handles. Never blocks."""

    @abstractmethod
    def dead_peers(self) -> list[int]:
        """Reachable ranks whose process is gone (exited or killed). Cheap; never blocks."""

    def unreachable_peers(self) -> list[int]:
        """Ranks on other hosts whose host has not answered for the transport's stall bound (a network partition,
        a host down): reading their words would block until the transport gives up. Cheap; never blocks. None
        here: a transport within one host always gets an answer."""
        return []

    def where(self, rank: int) -> str:
        """Where ``rank`` runs, in words, for errors: ``"this host"``, or the host a transport between hosts
        reaches it on."""
        return "this host"

    # ------------------------------------------------------------ trust
    def job_secret(self, job_id: str, world_size: int) -> JobSecret | None:
        """After :meth:`establish`: the job's secret, shared by every rank through this transport and never
        through the store (:mod:`zbccl.bootstrap.secret`); None when some rank is out of this transport's
        reach. A transport between hosts agrees on it in its own authenticated handshake."""
        return None

    # ------------------------------------------------------------ native
    @abstractmethod
    def native(self) -> NativeHandle:
        """Native-core handle: only for native code that runs over this transport (see :class:`NativeHandle`)."""

    def pointer_tables(self, ranks: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Two int64 tensors ``[len(ranks)]`` on :attr:`device`: each listed rank's data base and the base of
        its kernel signal area (byte :attr:`KERNEL_LINE` of its pad), in this process's address space, for
        the device kernels (``native/triton``). Cached per rank list: growth never moves a base here (the
        mappings reserve the most a segment may grow to); a transport whose growth remaps clears
        ``self._tables``. Do not write to them. Not collective; does not block."""
        key = tuple(ranks)
        cache = self.__dict__.setdefault("_tables", {})
        hit = cache.get(key)
        if hit is not None:
            return hit
        native = self.native()
        bases = [native.data_addr(r) for r in key] + [native.pad_addr(r, self.KERNEL_LINE) for r in key]
        both = torch.tensor(bases, dtype=torch.int64).to(self.device)
        tables = cache[key] = (both[:len(key)], both[len(key):])
        return tables

    # ------------------------------------------------------------ helpers for implementations
    def check_data(self, rank: int, offset: int, nbytes: int, *, op: str) -> None:
        """Raise unless ``rank`` is reachable and ``[offset, offset+nbytes)`` lies within its live size."""
        if not self.reachable(rank):
            raise ZbcclInvalidUsageError(
                f"{op}: memory not reachable from here, expected a rank this {self.name} transport mapped, "
                f"got rank {rank} (on another host, or out of range)")
        size = self.size(rank)
        if offset < 0 or nbytes < 0 or offset + nbytes > size:
            raise ZbcclInvalidUsageError(
                f"{op}: out of bounds of rank {rank}'s heap, expected [offset, offset+nbytes) within "
                f"[0, {size}), got offset={offset} nbytes={nbytes}")

    def check_pad(self, rank: int, line: int, nbytes: int, *, op: str) -> None:
        """Raise unless ``[line, line+nbytes)`` lies within ``rank``'s signal pad (and ``line`` is 8-aligned)."""
        if not self.reachable(rank):
            raise ZbcclInvalidUsageError(
                f"{op}: signal pad not reachable from here, expected a rank this {self.name} transport mapped, "
                f"got rank {rank} (on another host, or out of range)")
        pad = self.signal_pad(rank).nbytes
        if line < 0 or nbytes < 0 or line + nbytes > pad or line % 8:
            raise ZbcclInvalidUsageError(
                f"{op}: out of bounds of rank {rank}'s signal pad, expected an 8-byte aligned range within "
                f"[0, {pad}), got line={line} nbytes={nbytes}")


class Pending:
    """A write started by :meth:`Transport.put_async`; this one has landed already."""

    __slots__ = ()

    def done(self) -> bool:
        """Whether the write has landed (never blocks). A write that failed is retried here as a blocking
        :meth:`Transport.put`, which raises what it raises (a lost peer, a timeout naming it)."""
        return True


#: The :class:`Pending` of a write that completed when it started.
DONE = Pending()


#: A polling wait's naps (seconds): the first one, and the longest one while it has waited under a millisecond;
#: later a nap may take an eighth of the time waited so far (it overshoots the wait by about 12 % at most).
NAP_FIRST, NAP_SHORT = 10e-6, 100e-6

_nap = None


def _sleep_ns(ns: int) -> None:
    time.sleep(ns / 1e9)


def pause(waited: float, pause: float, *, hot: float, left: float, cap: float = 1e-3, spin: bool = True) -> float:
    """One pause of a polling wait that has waited ``waited`` seconds; returns the next ``pause``.

    For ``hot`` seconds the wait polls back to back (yielding the core between polls with ``spin``), then naps
    (the native ``nap``: the thread's timer slack at 1 us, so a 10 us nap is not a 60 us one) doubling from
    ``NAP_FIRST`` to ``NAP_SHORT``, then to an eighth of ``waited``, never over ``cap`` nor past the deadline
    (``left`` seconds away). Short naps matter when a transport's own threads in this process land the words
    waited for (Mooncake's): a waiter that only yields keeps them off a busy core (a 64 KiB write's round trip
    between two namespace hosts took 1.4-1.8 ms against yielding polls, 0.37 ms against polls that nap after
    50 us), and a waiter that sleeps in long steps overshoots (time.sleep's 0.5 ms naps cost the mesh's
    256 KiB-4 MiB steps 1-16 %, ``docs/benchmarks.md`` A.15).
    """
    if waited < hot:
        if spin:
            os.sched_yield()
        return pause
    global _nap
    if _nap is None:
        try:
            from ... import native
            _nap = native.core().nap
        except Exception:  # noqa: BLE001 - no native core here: time.sleep's coarser naps
            _nap = _sleep_ns
    pause = min(2 * pause or NAP_FIRST, max(NAP_SHORT, waited / 8), cap)
    _nap(int(min(pause, max(0.0, left)) * 1e9))
    return pause


class ViewRelease:
    """A peer view's finalizer (the transports of one host): one view fewer alive on ``transport`` (its
    ``views`` count, which :meth:`Transport.live_views` reports), then the caller's ``release``."""

    __slots__ = ("transport", "release")

    def __init__(self, transport: Transport, release: Callable[[], None] | None) -> None:
        self.transport, self.release = transport, release

    def __call__(self) -> None:
        self.transport.views -= 1
        if self.release is not None:
            self.release()


def _as_bytes(src) -> torch.Tensor:
    """``src`` as a flat uint8 tensor (a tensor's bytes, contiguous; or a bytes-like, copied once)."""
    if isinstance(src, torch.Tensor):
        if src.dtype is torch.uint8 and src.dim() == 1 and src.is_contiguous():
            return src  # (the collectives' pieces already are: no views to make)
        t = src.contiguous()
        return t.view(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    raw = bytearray(src)
    return torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
