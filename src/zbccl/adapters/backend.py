"""The ``zbccl`` torch.distributed backend: registration and the per-group creator.

``import zbccl`` registers the name (``"zbccl"``, and so ``"cpu:zbccl"``):
one dictionary entry in torch, nothing built or mapped. The work happens in
:func:`create`, which torch calls once per group on its members:

* the default group starts zbccl (``zbccl.init`` over the group's store), or
  adopts the communicator of an earlier ``zbccl.init`` of the same world;
* any other group becomes a zbccl sub-communicator of the world's heap
  (``Communicator.new_group``);
* every group also gets an inner gloo group from the same store: it runs the
  ops listed in ``ZBCCL_FALLBACK_OPS`` and the bitwise reduce ops, and is the
  group's registered CPU backend for torch's C++-only paths.

Devices: the backend registers ``cpu`` and ``cuda``. The process group torch
gets takes every tensor of the group (torch hands a Python process group the
whole group), and the ops route CUDA tensors to the communicator's CUDA heap
(``ops/route.py``); the gloo fallback moves CUDA tensors through host copies.

Across hosts: a group whose ranks span hosts runs on zbccl where the transport reaches every rank
(the routed transport: shm within a host, Mooncake between hosts). Each op runs on zbccl when the
public zbccl ops it is built on run across hosts (:func:`gloo_keys_across_hosts`: the ops the
``zbccl.ops.hosts`` package routes, when it is in this build), and on the group's gloo otherwise,
after one info line naming them. Point-to-point (send/recv) across hosts always runs on gloo: its
mailbox protocol (``p2p.py``) reads the peer's mailbox and payload through views of the peer's heap,
which a remote rank does not have (``Transport.viewable``); gloo's send/recv is already a one-copy
transfer over the same link. A group of ranks on one host is unchanged.

Initialisation fallback: when zbccl cannot start (``/dev/shm`` or memory too
small, ranks on different hosts with no inter-host transport, zbccl not
initialised for a sub-group), the ranks agree on it through the store and the
group runs every op on gloo, after one warning naming the reason.
``ZBCCL_STRICT=1`` raises instead.
"""

from __future__ import annotations

import logging
import sys
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

from .. import env
from ..errors import ZbcclError, ZbcclInvalidUsageError, ZbcclRemoteError

__all__ = ["BACKEND", "FALLBACK_KEYS", "register", "create", "parse_fallback_ops", "ops_across_hosts",
           "gloo_keys_across_hosts"]

_log = logging.getLogger("zbccl")

BACKEND = "zbccl"
#: What ``ZBCCL_FALLBACK_OPS`` accepts: a family name covers every spelling of that op.
FALLBACK_KEYS: dict[str, tuple[str, ...]] = {
    "allreduce": ("allreduce", "allreduce_coalesced"),
    "allreduce_coalesced": ("allreduce_coalesced",),
    "allgather": ("allgather", "all_gather_into_tensor"),
    "all_gather_into_tensor": ("all_gather_into_tensor",),
    "_allgather_base": ("all_gather_into_tensor",),
    "reduce_scatter": ("reduce_scatter", "reduce_scatter_tensor"),
    "reduce_scatter_tensor": ("reduce_scatter_tensor",),
    "_reduce_scatter_base": ("reduce_scatter_tensor",),
    "alltoall": ("alltoall", "alltoall_base"),
    "alltoall_base": ("alltoall_base",),
    "all_to_all_single": ("alltoall_base",),
    "broadcast": ("broadcast",),
    "reduce": ("reduce",),
    "gather": ("gather",),
    "scatter": ("scatter",),
    "barrier": ("barrier",),
    "send": ("send", "recv"),
    "recv": ("send", "recv"),
}
_registered = False
#: The public zbccl ops each op key is built on (``process_group.py`` and ``list_forms.py``).
_BUILT_ON: dict[str, frozenset[str]] = {
    "allreduce": frozenset({"all_reduce"}),
    "allreduce_coalesced": frozenset({"all_reduce"}),
    "allgather": frozenset({"all_gather_into_tensor", "all_gather_v"}),
    "all_gather_into_tensor": frozenset({"all_gather_into_tensor"}),
    "reduce_scatter": frozenset({"reduce_scatter_tensor", "reduce_scatter_v"}),
    "reduce_scatter_tensor": frozenset({"reduce_scatter_tensor"}),
    "alltoall": frozenset({"all_to_all_single"}),
    "alltoall_base": frozenset({"all_to_all_single"}),
    "broadcast": frozenset({"broadcast"}),
    "reduce": frozenset({"all_reduce", "reduce_scatter_v", "all_to_all_single"}),
    "gather": frozenset({"all_to_all_single"}),
    "scatter": frozenset({"all_to_all_single"}),
    "barrier": frozenset({"barrier"}),  # Communicator.barrier: the store across hosts
    "send": frozenset({"p2p"}),  # never across hosts (see the module docstring)
    "recv": frozenset({"p2p"}),
}
#: The public ops that run across hosts whatever the build.
_ALWAYS_ACROSS = frozenset({"barrier"})


def parse_fallback_ops(text: str) -> frozenset[str]:
    """The op keys ``ZBCCL_FALLBACK_OPS`` names; an unknown name raises (it would silently do nothing)."""
    keys: set[str] = set()
    for raw in text.replace(";", ",").split(","):
        name = raw.strip().lower() if not raw.strip().startswith("_") else raw.strip()
        if not name:
            continue
        if name not in FALLBACK_KEYS:
            raise ZbcclInvalidUsageError(
                f"ZBCCL_FALLBACK_OPS: unknown op, expected names from {sorted(FALLBACK_KEYS)}, got {name!r}")
        keys.update(FALLBACK_KEYS[name])
    return frozenset(keys)


def ops_across_hosts() -> frozenset[str]:
    """The public zbccl ops (``all_reduce``, ``all_gather_v``, ...) that run on a communicator spanning hosts:
    ``zbccl.ops.hosts.OPS`` where that package is in this build (all eight routed ops where it does not
    say), and ``barrier`` alone without it."""
    try:
        from ..ops import hosts  # type: ignore[attr-defined]
    except ImportError:
        return _ALWAYS_ACROSS
    routed = getattr(hosts, "OPS", ("all_reduce", "all_gather_into_tensor", "all_gather_v", "reduce_scatter_tensor",
                                    "reduce_scatter_v", "all_to_all_single", "broadcast", "barrier"))
    return _ALWAYS_ACROSS | frozenset(routed)


def gloo_keys_across_hosts(comm) -> frozenset[str]:
    """The op keys a group on ``comm`` runs on gloo because its ranks span hosts (empty on one host)."""
    if comm is None or comm._single_host:
        return frozenset()
    can = ops_across_hosts()
    return frozenset(k for k, needs in _BUILT_ON.items() if not needs <= can)


def register() -> None:
    """Register the ``zbccl`` backend with torch (idempotent, cheap: nothing is built or mapped)."""
    global _registered
    if _registered:
        return
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, create, extended_api=True, devices=["cpu", "cuda"])
    _registered = True


def _seconds(timeout) -> float:
    if env.TIMEOUT.is_set():
        return env.TIMEOUT.get()
    if isinstance(timeout, timedelta) and timeout.total_seconds() > 0:
        return min(timeout.total_seconds(), env.MAX_SECONDS)  # torch's group timeout may be longer
    return env.TIMEOUT.get()


def _start(store, rank: int, size: int, global_ranks: list[int], seconds: float):
    """``(comm, owns_world)``: the zbccl communicator this group runs on; raises why not."""
    from ..runtime.state import get_default, init

    world = get_default()
    if not global_ranks:  # the default group
        if world is not None:
            if world.world_size != size or world.rank != rank:
                raise ZbcclInvalidUsageError(
                    f"init_process_group: zbccl is already initialized with another world, expected rank "
                    f"{rank} of {size}, got rank {world.rank} of {world.world_size}")
            return world, False
        comm = init(store=store, rank=rank, world_size=size, timeout=seconds)
        transport = comm._ctx.heap.transport
        if not all(transport.reachable(r) for r in range(size)):
            hosts = len(comm.topology.hosts)
            from ..runtime.state import finalize

            finalize()
            raise ZbcclInvalidUsageError(
                f"init_process_group: the ranks span {hosts} hosts and no transport reaches them all, expected "
                f"Mooncake between hosts (pip install 'zbccl[internode]'), got transport {transport.name!r}")
        return comm, True
    if world is None:
        raise ZbcclInvalidUsageError(
            "new_group: zbccl is not initialized in this process, expected the default group to use backend "
            "'zbccl' (or zbccl.init() before init_process_group)")
    if list(global_ranks) != sorted(global_ranks):
        raise ZbcclInvalidUsageError(
            f"new_group: group ranks must follow global rank order for zbccl, got {list(global_ranks)}")
    comm = world.new_group(list(global_ranks), timeout=seconds)
    return comm, False


def _agree(store, rank: int, size: int, error: str | None, seconds: float, n: str) -> tuple[int, str] | None:
    """Every member's start verdict through the store: ``(group rank, error)`` of the first failure, or None."""
    store.set(f"zbccl-start/{n}/{rank}", (error or "").encode() or b"-")
    keys = [f"zbccl-start/{n}/{r}" for r in range(size)]
    store.wait(keys, timedelta(seconds=seconds))
    for r, value in enumerate(store.multi_get(keys)):
        if value != b"-":
            return r, value.decode(errors="replace")
    return None


def _device_of_call() -> str | None:
    """The device torch creates this backend for. Its creator API does not pass it; the caller
    (``_new_process_group_helper``, looping over ``"cpu:zbccl,cuda:nccl"``'s pairs) holds it in ``device``.
    None where another caller or a torch without that loop calls (then nothing is refused)."""
    frame = sys._getframe(2)
    if frame.f_code.co_name != "_new_process_group_helper":
        return None
    device = frame.f_locals.get("device")
    return device if isinstance(device, str) else None


def create(dist_opts, backend_opts=None):
    """torch's creator (extended API): the :class:`ProcessGroupZbccl` of one group on this member."""
    from .p2p import PointToPoint
    from .process_group import ProcessGroupZbccl

    device = _device_of_call()
    if device not in (None, "cpu", "cuda"):
        raise ZbcclInvalidUsageError(
            f"init_process_group: zbccl runs CPU and CUDA tensors, expected backend 'zbccl', 'cpu:zbccl' or "
            f"'cuda:zbccl', got 'zbccl' for device {device!r}")
    store, rank, size = dist_opts.store, dist_opts.group_rank, dist_opts.group_size
    global_ranks = list(dist_opts.global_ranks_in_group)
    seconds = _seconds(dist_opts.timeout)
    fallback = parse_fallback_ops(env.FALLBACK_OPS.get())
    strict = env.STRICT.get()
    # Fresh keys when a re-initialised job reuses the store: the n-th creation of this group name
    # with these members. torch reuses a group name for other members after a re-init, so the
    # members are in the counter (their counts agree) and in every key (the names' old keys differ).
    members = ",".join(map(str, global_ranks)) or f"world{size}"
    n = f"{members}/{store.add(f'zbccl-created/{members}/{rank}', 1)}"
    gloo = dist.ProcessGroupGloo(dist.PrefixStore(f"zbccl-gloo/{n}/", store), rank, size, dist_opts.timeout)
    comm, owns, failure = None, False, None
    try:
        comm, owns = _start(store, rank, size, global_ranks, seconds)
    except ZbcclError as exc:
        failure = exc
    # Every member learns every verdict (also under ZBCCL_STRICT: the peers of a failed rank raise too).
    verdict = _agree(store, rank, size, None if failure is None else str(failure), seconds, n)
    reason = None if verdict is None else f"rank {verdict[0]}: {verdict[1]}"
    if verdict is not None:
        if comm is not None:  # this rank started, a peer did not: nobody uses it
            _release(comm, owns)
            comm, owns = None, False
        if strict:
            if failure is not None:
                raise failure
            raise ZbcclRemoteError(f"init_process_group: zbccl could not start on {reason}",
                                   ranks=(global_ranks[verdict[0]] if global_ranks else verdict[0],))
        warnings.warn(f"zbccl: backend 'zbccl' runs every op of group {dist_opts.group_id!r} on gloo: zbccl "
                      f"could not start on {reason} (ZBCCL_STRICT=1 makes this an error)", RuntimeWarning,
                      stacklevel=2)
        if not global_ranks:  # the default group: zbccl.empty() and the rest say why they have no heap
            from ..runtime.registry import note_fallback

            note_fallback(f"zbccl could not start on {reason}")
    across = gloo_keys_across_hosts(comm)
    if across:
        _log.info("zbccl: group %r spans hosts: %s run on gloo (not across hosts in this build)",
                  dist_opts.group_id, ", ".join(sorted(across)))
        fallback = fallback | across
    # p2p's mailboxes are read through views of the peer's heap: one host only (``send``/``recv`` on gloo).
    p2p = PointToPoint(comm, incarnation=n) if comm is not None and comm._single_host else None
    if comm is not None:
        from .funcol import install

        install()  # functional all_gather / reduce_scatter of zbccl groups reach zbccl
    pg = ProcessGroupZbccl(comm, rank=rank, size=size, gloo=gloo, fallback=fallback, owns_world=owns,
                           reason=reason, p2p=p2p)
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
    return pg


def _release(comm, owns: bool) -> None:
    from ..runtime.state import finalize

    try:
        if comm.slot != 0:
            comm.destroy()
        elif owns:
            finalize()
    except ZbcclError as exc:
        _log.info("zbccl: releasing an unused communicator: %s", exc)
