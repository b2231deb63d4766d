"""Which zbccl communicator a ``Buffer`` runs on: a Communicator, or a torch ProcessGroup's.

The process-group adapter sits above ``ep`` (layers flow one way), so it is never imported from
here: a zbccl process group is recognised by the communicator it carries (its ``comm``).
"""

from __future__ import annotations

from .. import env
from ..errors import ZbcclInvalidUsageError
from ..heap.capacity import shm_capacity
from ..runtime.communicator import Communicator

__all__ = ["communicator_of"]

_MAX_AUTO_HEAP = 1 << 30


def _heap_bytes(want: int, nranks: int) -> int | None:
    """Heap size for a zbccl world the Buffer starts itself: at least ``ZBCCL_HEAP_SIZE``'s default,
    up to the Buffer's requested bytes, at most 1 GiB (populating the heap at init costs time) and
    half the machine's room per rank; None: the variable is set, init reads it."""
    if env.HEAP_SIZE.is_set():
        return None
    caps = [v for v in shm_capacity().values() if v]
    room = min(caps) // (2 * max(nranks, 1)) if caps else want
    return max(env.HEAP_SIZE.get(), min(int(want), room, _MAX_AUTO_HEAP))


def _backend_communicator(group) -> Communicator | None:
    """The communicator of a zbccl process group (its ``comm`` attribute, on the group or on its CPU
    backend), else None (also when that group runs on gloo because zbccl could not start)."""
    comm = getattr(group, "comm", None)
    if isinstance(comm, Communicator):
        return comm
    try:
        import torch

        backend = group._get_backend(torch.device("cpu"))
    except (AttributeError, RuntimeError, ValueError):
        return None
    comm = getattr(backend, "comm", None)
    return comm if isinstance(comm, Communicator) else None


def communicator_of(group, want_bytes: int = 0) -> tuple[Communicator, list[int]]:
    """``(communicator, members)``: the Buffer runs on ``communicator.new_group(members)``.

    A zbccl Communicator is used with all its ranks. A torch ProcessGroup goes to its zbccl
    backend's ``comm``, else to zbccl's default
    communicator (whose global ranks are torch's when it spans torch's world, or the ranks of the group
    it was started from: a group with other ranks raises, see :func:`_torch_ranks`), and, when zbccl is
    not initialized yet, to
    ``zbccl.init(group=group)`` (heap: ``ZBCCL_HEAP_SIZE`` if set, else ``want_bytes`` within the
    machine's room, see :func:`_heap_bytes`): a gloo group works that way.
    """
    if isinstance(group, Communicator):
        return group, list(range(group.world_size))
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch without distributed
        dist = None
    if dist is None or not isinstance(group, dist.ProcessGroup):
        raise ZbcclInvalidUsageError(
            f"Buffer: group must be a zbccl Communicator or a torch ProcessGroup, got {type(group).__name__}")
    comm = _backend_communicator(group)
    if comm is not None:
        return comm, list(range(comm.world_size))
    from ..runtime.state import get_default, init

    comm = get_default()
    if comm is None:
        comm = init(group=group, heap_size=_heap_bytes(want_bytes, group.size()))
        return comm, list(range(comm.world_size))
    members = dist.get_process_group_ranks(group)
    world = _torch_ranks(comm, dist)
    if world is not None and all(m in world for m in members):
        return comm, [world.index(m) for m in members]
    raise ZbcclInvalidUsageError(
        f"Buffer: cannot map the ProcessGroup's ranks {members} onto zbccl's world, expected zbccl initialized over "
        f"torch's world or over a group holding these ranks, got a world of torch ranks "
        f"{'unknown' if world is None else list(world)} (zbccl runs one world per process: start it over torch's "
        "world first, e.g. with zbccl.init(group=torch.distributed.group.WORLD), when Buffers use several groups)")


def _torch_ranks(comm: Communicator, dist) -> list[int] | None:
    """The torch global rank of each of zbccl's world ranks: the group's ranks when zbccl was started from a
    ProcessGroup, torch's ranks when it was started otherwise over a world of torch's size, else None."""
    rdv = comm._ctx.rendezvous
    if rdv.how == "group":
        return list(rdv.members)
    return list(range(comm.world_size)) if comm.world_size == dist.get_world_size() else None
