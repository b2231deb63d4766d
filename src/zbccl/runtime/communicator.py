"""``Communicator``: a set of ranks over the one shared heap.

The world communicator uses comm slot 0 of every segment's control area; each
sub-communicator from :meth:`Communicator.new_group` gets a fresh slot, so its
barrier epochs and (later) op headers never mix with another group's.

Barrier protocol (one flag line per rank per communicator, in the owner's
segment): rank ``r`` raises its own epoch flag to ``e`` (release store, futex
wake if someone sleeps), then waits until every other member's flag is
``>= e``. Epochs only grow, so flags are never reset and back-to-back barriers
cannot confuse one another; a fast rank may already be at ``e+1``, which still
satisfies ``>= e``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..bootstrap.store import StoreBootstrap
from ..errors import ZbcclInvalidUsageError
from ..heap import layout
from ..heap.views import HeapHandle, view_heap
from .waits import FlagSet, wait_flags

if TYPE_CHECKING:
    import torch

    from .context import Context

__all__ = ["Communicator"]


class Communicator:
    """Ranks ``0..world_size-1`` of one group; ``ranks[i]`` is group rank ``i``'s global rank."""

    def __init__(self, ctx: Context, ranks: Sequence[int], slot: int, bootstrap: StoreBootstrap) -> None:
        self._ctx = ctx
        self.ranks: tuple[int, ...] = tuple(ranks)
        self.slot = slot
        self.bootstrap = bootstrap
        self.rank = self.ranks.index(ctx.rank)
        self._epoch = 0
        self._single_host = all(ctx.heap.reachable(r) for r in self.ranks)
        if self._single_host:
            line = layout.slot_line(slot, layout.SLOT_BARRIER)
            self._my_flag = ctx.heap.ctrl_addr(ctx.rank, line)
            peers = [r for r in self.ranks if r != ctx.rank]
            self._peer_flags = FlagSet(peers, [ctx.heap.ctrl_addr(r, line) for r in peers],
                                       [self.ranks.index(r) for r in peers])

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

    def heap_size_of(self, rank: int) -> int:
        """Heap bytes of group rank ``rank`` (sizes may differ per rank)."""
        return self._ctx.heap_sizes[self._global(rank, "heap_size_of")]

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
        Not collective; does not block.
        """
        return view_heap(self._ctx.heap, self._global(rank, "peer_tensor"), handle)

    # -------------------------------------------------------------------- sync
    def barrier(self, timeout: float | None = None) -> None:
        """Collective: return once every member has entered this barrier.

        Blocks the host. Raises :class:`~zbccl.errors.ZbcclTimeoutError` naming
        the ranks that never arrived, or :class:`~zbccl.errors.ZbcclRemoteError`
        as soon as a member is found dead.
        """
        ctx = self._ctx
        if ctx.finalized:
            raise ZbcclInvalidUsageError("barrier: zbccl was finalized")
        timeout = ctx.timeout if timeout is None else float(timeout)
        if not self._single_host:
            self.bootstrap.barrier(timeout=timeout)
            return
        self._epoch += 1
        ctx.prims.signal(self._my_flag, self._epoch)
        wait_flags(ctx, self._peer_flags, self._epoch, timeout=timeout, op="barrier")

    def all_gather_object(self, obj: object, *, timeout: float | None = None) -> list:
        """Collective: every member's picklable ``obj``, indexed by group rank.

        Goes through the bootstrap store (for handles and small metadata, never
        for tensor data). Blocks until all members contributed or ``timeout``.
        """
        import pickle

        timeout = self._ctx.timeout if timeout is None else float(timeout)
        got = self.bootstrap.all_gather(pickle.dumps(obj), timeout=timeout, tag="object")
        return [pickle.loads(b) for b in got]

    def new_group(self, ranks: Sequence[int]) -> Communicator | None:
        """A sub-communicator of ``ranks`` (this group's numbering) over the same heap.

        Collective over the *members* only (non-members may call it too, as
        torch requires, and get ``None`` without communicating). Members must
        create groups with the same member list in the same order.
        """
        ctx = self._ctx
        members = sorted({self._global(int(r), "new_group") for r in ranks})
        if len(members) != len(list(ranks)):
            raise ZbcclInvalidUsageError(f"new_group: duplicate ranks, got {list(ranks)}")
        if ctx.rank not in members:
            return None
        key = "-".join(map(str, members))
        n = ctx.group_counts.get(key, 0)
        ctx.group_counts[key] = n + 1
        leader = members[0]
        slot_key = f"group/{key}/{n}"
        if ctx.rank == leader:
            slot = ctx.bootstrap.add("slots", 1)
            ctx.bootstrap.set(slot_key, str(slot).encode())
        else:
            slot = int(ctx.bootstrap.get(slot_key, timeout=ctx.timeout, owner=leader))
        if slot >= layout.MAX_COMMS:
            raise ZbcclInvalidUsageError(
                f"new_group: too many communicators, expected at most {layout.MAX_COMMS - 1} groups, got {slot}")
        boot = StoreBootstrap(ctx.bootstrap.store, members.index(ctx.rank), len(members),
                              prefix=f"{ctx.key_prefix}/g{slot}", members=tuple(members))
        comm = Communicator(ctx, members, slot, boot)
        boot.barrier(timeout=ctx.timeout)
        return comm

    def __repr__(self) -> str:
        return (f"Communicator(rank={self.rank}, world_size={self.world_size}, ranks={list(self.ranks)}, "
                f"local_rank={self.local_rank}, local_world_size={self.local_world_size}, job={self.job_id})")
