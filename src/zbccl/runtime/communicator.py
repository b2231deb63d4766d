"""``Communicator``: a set of ranks over the one shared heap.

The world communicator uses comm slot 0 of every segment's control area; each
sub-communicator from :meth:`Communicator.new_group` gets a fresh slot, so its
barrier epochs and (later) op headers never mix with another group's.

Barrier: an op of the communicator's op channel (``ops/barrier.py``: header, ``ARRIVE``,
``DONE``, the native waits), so it shares the collectives' sequence numbers, liveness rule,
ABORT marking and error texts (:mod:`.liveness`). The runtime sits below the ops layer, so the
ops hand it that engine (:attr:`Communicator.barrier_engine`) when :mod:`zbccl.ops` is imported;
a communicator spanning hosts runs it through the pad words (``ops/hosts``), or meets in the store
when no transport reaches the other hosts. The store ops (``all_gather_object``,
``new_group``, ``destroy``) watch the same liveness rule at each poll of the store.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from .. import env
from ..bootstrap.store import StoreBootstrap
from ..errors import ZbcclInvalidUsageError, ZbcclRemoteError, ZbcclSystemError
from ..heap import layout
from ..heap.views import HeapHandle, view_heap
from ..native.abi import WHERE_BARRIER, WHERE_STORE
from .liveness import store_watch
from .oplock import OpLock
from .registry import check_usable, close_device_state, device_ops_factory, guarded
from .slots import acquire_slot, check_slot_free, parse_slot_record, release_slot, reset_slot

if TYPE_CHECKING:
    import torch

    from .context import Context

__all__ = ["Communicator", "NonMember"]


def _seconds(timeout: float | None, default: float, op: str) -> float:
    if timeout is None:
        return default
    try:
        return env.parse_seconds(timeout)
    except ValueError as exc:
        raise ZbcclInvalidUsageError(f"{op}: {exc}") from None


class Communicator:
    """Ranks ``0..world_size-1`` of one group; ``ranks[i]`` is group rank ``i``'s global rank."""

    #: False only for the :class:`NonMember` placeholder ``new_group`` returns to non-members.
    is_member = True
    #: ``engine(comm, timeout)``: the barrier as an op of the op channel (``ops/barrier.py`` ``run_barrier``),
    #: installed by the ops layer when it is imported (``import zbccl`` does); this layer may not import it.
    barrier_engine: ClassVar[Callable[[Communicator, float | None], None] | None] = None

    def __init__(self, ctx: Context, ranks: Sequence[int], slot: int, bootstrap: StoreBootstrap) -> None:
        self._ctx = ctx
        self.ranks: tuple[int, ...] = tuple(ranks)
        self.slot = slot
        self.bootstrap = bootstrap
        self.rank = self.ranks.index(ctx.rank)
        self.destroyed = False
        self._op_lock = OpLock()
        #: The ops layer's per-communicator state (its op channel), created by the ops on first use.
        #: :meth:`destroy` calls its ``close()`` and drops it; this layer never looks inside.
        self.op_state: Any = None
        #: The ops layer's device ops of this communicator, by device type (``"cuda"``): made on first use by
        #: :meth:`device_ops` through the factory the ops layer registers (``registry.set_device_ops_factory``).
        self.device_state: dict[str, Any] = {}
        #: The protocol its ops belong to when a rank leaves one half-way (``native/abi.py`` ``ABORT_WHERE``;
        #: 0: each op's own). EP's Buffer sets it on its private communicator.
        self.role = 0
        ctx.comms.add(self)
        #: False once finalize, a fork (in the child) or destroy ended this communicator: the one flag
        #: the ops' fast path reads. Set after joining ``ctx.comms`` so a concurrent finalize sees it.
        self._live = not (ctx.finalized or ctx.forked)
        #: The liveness check of this communicator's store waits (bootstrap/store.py ``watch``).
        self.store_watch = store_watch(ctx, self.ranks)
        self._single_host = all(ctx.heap.reachable(r) for r in self.ranks)
        #: Ranks on other hosts that no transport reaches (no Mooncake): the barrier meets in the store.
        self._store_barrier = not all(ctx.heap.transport.reachable(r) for r in self.ranks)

    # ----------------------------------------------------------------- identity
    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def global_rank(self) -> int:
        return self._ctx.rank

    @property
    def local_ranks(self) -> tuple[int, ...]:
        """Group ranks that share this rank's host."""
        topo = self._ctx.topology
        return tuple(i for i, g in enumerate(self.ranks) if topo.is_local(g))

    @property
    def local_rank(self) -> int:
        return self.local_ranks.index(self.rank)

    @property
    def local_world_size(self) -> int:
        return len(self.local_ranks)

    @property
    def job_id(self) -> str:
        return self._ctx.job_id

    @property
    def topology(self):
        return self._ctx.topology

    @property
    def timeout(self) -> float:
        return self._ctx.timeout

    # ------------------------------------------------------------------ memory
    @property
    def heap(self):
        return self._ctx.heap

    @property
    def sma(self):
        """This rank's heap allocator (shared by every communicator of the process)."""
        return self._ctx.sma

    @property
    def heap_base(self) -> int:
        return self._ctx.heap.heap_base

    @property
    def heap_bytes(self) -> int:
        return self._ctx.heap.heap_bytes

    @property
    def heap_max_bytes(self) -> int:
        """Most bytes this rank's heap may grow to (``ZBCCL_HEAP_MAX``)."""
        return self._ctx.heap.heap_max_bytes

    def heap_size_of(self, rank: int) -> int:
        """Heap bytes of group rank ``rank`` now (sizes may differ per rank, and grow)."""
        return self._ctx.heap.heap_size(self._global(rank, "heap_size_of"))

    def _global(self, rank: int, op: str) -> int:
        if not 0 <= rank < len(self.ranks):
            raise ZbcclInvalidUsageError(f"{op}: rank out of range, expected [0, {len(self.ranks)}), got {rank}")
        return self.ranks[rank]

    def peer_tensor(self, rank: int, handle: HeapHandle) -> torch.Tensor:
        """A zero-copy view of ``handle``'s bytes in group rank ``rank``'s heap.

        ``handle`` comes from :func:`zbccl.export` on any rank; its offset is
        applied to ``rank``'s heap (so a rank may view its own export at a peer
        when both allocated symmetrically). The view is bounds-checked against
        that rank's real heap size; an out-of-bounds handle raises
        :class:`~zbccl.errors.ZbcclInvalidUsageError` and touches nothing.
        Not collective; does not block. A handle of a CUDA tensor (``handle.device == "cuda"``)
        is applied to the job's CUDA heap, and the view is a CUDA tensor.
        """
        rank = self._global(rank, "peer_tensor")
        kind = getattr(handle, "device", "cpu")
        heap = self._ctx.heap if kind == "cpu" else self.device_heap(kind, op="peer_tensor").heap
        return view_heap(heap, rank, handle)

    def device_heap(self, device: str | torch.device = "cuda", *, op: str = "device_heap"):
        """This job's heap on ``device`` (``"cuda"``): a :class:`~zbccl.runtime.device_heap.DeviceHeap`,
        ``transport, heap, sma = comm.device_heap("cuda")`` (shared by every communicator of the process).

        Raises :class:`~zbccl.errors.ZbcclInvalidUsageError` when init built none (``init(device="cuda")``
        or ``ZBCCL_DEVICE=cuda`` builds it) or ``device`` names another GPU than the heap's. Not collective.
        """
        import torch

        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ZbcclInvalidUsageError(f"{op}: bad device, expected 'cuda', got {device!r} ({exc})") from None
        dh = self._ctx.device_heaps.get(dev.type)
        if dh is None:
            raise ZbcclInvalidUsageError(
                f"{op}: no {dev.type} heap in this job, expected one built at init (init(device='{dev.type}') or "
                f"ZBCCL_DEVICE={dev.type}), got heaps for {['cpu', *self._ctx.device_heaps]}")
        if dev.index is not None and dev.index != dh.device.index:
            raise ZbcclInvalidUsageError(
                f"{op}: the {dev.type} heap is on another device, expected {dh.device}, got {dev}")
        return dh

    def device_ops(self, device: str = "cuda", *, op: str = "device_ops") -> Any:
        """This communicator's collectives over the ``device`` heap (``zbccl.ops.device.DeviceOps``): made on
        first use, then cached. Collective on first use (every member zeroes its kernel slot, then a host
        barrier): the first device collective of the communicator makes it on every rank. Each of its ops is enqueued on the current stream and
        never blocks the host. Raises :class:`~zbccl.errors.ZbcclInvalidUsageError` when zbccl was initialized
        without a heap on that device, or when first made inside a CUDA graph capture (make it before: the
        capture may not allocate its pointer tables)."""
        ops = self.device_state.get(device)
        if ops is None:
            check_usable(self, op)
            ops = self.device_state[device] = device_ops_factory()(self, device, op)
        return ops

    # -------------------------------------------------------------------- sync
    def _stopped(self) -> bool:
        """True once no new op may start here (queued ops give up waiting for the op lock)."""
        return not self._live

    @guarded("barrier", WHERE_BARRIER)
    def barrier(self, timeout: float | None = None) -> None:
        """Collective: return once every member has entered this barrier.

        Blocks the host. An op of the communicator's op channel (``ops/barrier.py``): raises
        :class:`~zbccl.errors.ZbcclTimeoutError` naming the ranks that never arrived,
        :class:`~zbccl.errors.ZbcclRemoteError` within about a liveness interval once a member
        died, finalized or left any op half-way, and :class:`~zbccl.errors.ZbcclInvalidUsageError`
        on every rank when a member runs another op (or passed a bad ``timeout``).
        """
        if self._store_barrier:
            self.bootstrap.barrier(timeout=_seconds(timeout, self._ctx.timeout, "barrier"), watch=self.store_watch)
            return
        engine = Communicator.barrier_engine
        if engine is None:
            raise ZbcclSystemError("barrier: the ops layer is not loaded, expected 'import zbccl' before any op")
        engine(self, timeout)

    @guarded("all_gather_object", WHERE_STORE)
    def all_gather_object(self, obj: object, *, timeout: float | None = None) -> list:
        """Collective: every member's picklable ``obj``, indexed by group rank.

        Goes through the bootstrap store (for handles and small metadata, never
        for tensor data). Blocks until all members contributed or ``timeout``.
        Each value is sealed with the job's secret (HMAC-SHA256, see
        :mod:`zbccl.bootstrap.secret`) and unpickled only once its MAC verified:
        a value someone else wrote into the store raises
        :class:`~zbccl.errors.ZbcclRemoteError` naming its key and is never unpickled.
        Without a secret (a rank on another host) it refuses to run.
        """
        import pickle

        timeout = _seconds(timeout, self._ctx.timeout, "all_gather_object")
        if self.bootstrap.secret is None:
            raise ZbcclInvalidUsageError(
                "all_gather_object: no job secret to authenticate the store with, expected every rank's "
                "segment mapped here or, across hosts, ZBCCL_JOB_COOKIE set on every rank, got "
                f"ranks {[r for r in self.ranks if not self._ctx.heap.reachable(r)]} out of reach")
        try:
            got = self.bootstrap.all_gather(pickle.dumps(obj), timeout=timeout, tag="object", watch=self.store_watch)
        except ZbcclRemoteError as exc:
            raise type(exc)(f"all_gather_object: {exc}", ranks=exc.ranks) from None
        return [pickle.loads(b) for b in got]  # authenticated: written by a holder of the job's secret

    @guarded("new_group", WHERE_STORE)
    def new_group(self, ranks: Sequence[int], *, timeout: float | None = None) -> Communicator | NonMember:
        """A sub-communicator of ``ranks`` (this group's numbering) over the same heap.

        Collective over the *members* only. Non-members may call it too, as torch
        requires, and get a :class:`NonMember` without communicating: it is falsy
        and every op given it raises :class:`~zbccl.errors.ZbcclInvalidUsageError`
        (it never falls back to the world, as ``comm=None`` would). Members must
        create groups with the same member list in the same order. The group holds
        one of the job's ~120 comm slots until :meth:`destroy`.
        """
        ctx = self._ctx
        timeout = _seconds(timeout, ctx.timeout, "new_group")
        members = sorted({self._global(int(r), "new_group") for r in ranks})
        if len(members) != len(list(ranks)):
            raise ZbcclInvalidUsageError(f"new_group: duplicate ranks, got {list(ranks)}")
        if ctx.rank not in members:
            return NonMember(members, ctx.rank)
        key = "-".join(map(str, members))
        with ctx.groups_lock:
            n = ctx.group_counts.get(key, 0)
            ctx.group_counts[key] = n + 1
        leader = members[0]
        slot_key = f"group/{key}/{n}"
        if ctx.rank == leader:
            got = acquire_slot(ctx.bootstrap)
            slot, use = got if got is not None else (-1, 0)
            # The nonce makes the group's key prefix unique even if the store's counters were reset.
            nonce = secrets.token_hex(8)
            ctx.bootstrap.set(slot_key, f"{slot}:{use}:{nonce}".encode())
        else:
            raw = ctx.bootstrap.get(slot_key, timeout=timeout, owner=leader, watch=self.store_watch)
            slot, use, nonce = parse_slot_record(raw, key=ctx.bootstrap._key(slot_key))
        if slot < 0:
            raise ZbcclInvalidUsageError(
                f"new_group: too many communicators, expected at most {layout.MAX_COMMS - 1} live groups "
                "(destroy() returns a group's slot), got all of them in use")
        check_slot_free(slot, [c for c in ctx.comms if c._live], key=ctx.bootstrap._key(slot_key))
        reset_slot(ctx.heap, slot)  # a reused slot holds the previous group's flags
        boot = StoreBootstrap(ctx.bootstrap.store, members.index(ctx.rank), len(members),
                              prefix=f"{ctx.key_prefix}/g{slot}.{use}.{nonce}", members=tuple(members),
                              secret=ctx.bootstrap.secret)
        comm = Communicator(ctx, members, slot, boot)
        boot.default_watch = comm.store_watch  # its store waits that name no watch watch the liveness rule too
        boot.barrier(timeout=timeout, watch=comm.store_watch)  # every member reset its lines before anyone waits
        return comm

    @guarded("destroy", WHERE_STORE)
    def destroy(self, *, timeout: float | None = None) -> None:
        """Collective over the members: end this sub-communicator and return its comm slot.

        Blocks until every member called it (a store barrier: once all arrived, no
        member is still inside an op of this group). Later ops on it raise
        :class:`~zbccl.errors.ZbcclInvalidUsageError`. The world communicator ends
        with ``zbccl.finalize()`` instead; ``finalize`` also ends every sub-group on
        its rank (locally: it never waits for peers, and slots are per ``init``).
        """
        if self.slot == 0:
            raise ZbcclInvalidUsageError(
                "destroy: expected a sub-communicator from new_group, got the world communicator "
                "(it ends with zbccl.finalize())")
        self.bootstrap.barrier(timeout=_seconds(timeout, self._ctx.timeout, "destroy"), tag="destroy",
                               watch=self.store_watch)
        self.destroyed = True
        self._live = False
        state, self.op_state = self.op_state, None
        if state is not None:  # the ops layer's channel: free its native half now
            state.close()
        close_device_state(self)
        self._op_lock.wake()
        if self.rank == 0:
            release_slot(self._ctx.bootstrap, self.slot)

    def __repr__(self) -> str:
        return (f"Communicator(rank={self.rank}, world_size={self.world_size}, ranks={list(self.ranks)}, "
                f"local_rank={self.local_rank}, local_world_size={self.local_world_size}, job={self.job_id})")


class NonMember:
    """What :meth:`Communicator.new_group` returns on a rank outside the group.

    Falsy (``if not g:`` reads as "not in this group", like code written for
    ``None``), but not ``None``: ``comm=None`` means the whole world, so a
    ``None`` passed on to an op would silently become a world collective. Every
    op, method or attribute of a communicator used on it raises
    :class:`~zbccl.errors.ZbcclInvalidUsageError`; ``is_member`` is False.
    """

    is_member = False

    def __init__(self, ranks: Sequence[int], global_rank: int) -> None:
        self.group_ranks = tuple(ranks)
        self.global_rank = global_rank

    def __bool__(self) -> bool:
        return False

    def _refuse(self, op: str) -> None:
        raise ZbcclInvalidUsageError(
            f"{op}: this rank (global rank {self.global_rank}) is not a member of the group "
            f"{list(self.group_ranks)}, expected a communicator it belongs to, got the non-member placeholder "
            "that new_group returned")

    def __getattr__(self, name: str):
        if name.startswith("_"):  # private and dunder lookups (the op guard's fast path, pickle) just miss
            raise AttributeError(name)
        self._refuse(name)

    def __repr__(self) -> str:
        return f"NonMember(global_rank={self.global_rank}, group={list(self.group_ranks)})"
