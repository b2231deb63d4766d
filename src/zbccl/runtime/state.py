"""``zbccl.init`` / ``zbccl.finalize`` and the process's default communicator."""

from __future__ import annotations

import atexit
import json
import logging
import threading
import uuid
from collections.abc import Callable
from datetime import timedelta

from .. import env
from .._version import __version__
from ..bootstrap.rendezvous import resolve
from ..bootstrap.store import StoreBootstrap
from ..bootstrap.topology import HostInfo, Topology, local_host_info
from ..errors import ZbcclInvalidUsageError, ZbcclOutOfMemoryError
from ..heap import layout
from ..heap.capacity import check_capacity
from ..heap.heap import GlobalHeap
from ..heap.shm import ShmTransport
from ..heap.views import live_views
from ..sma import CachingAllocator
from .communicator import Communicator
from .context import Context
from .threads import set_threads

__all__ = ["init", "finalize", "abort", "add_finalize_hook", "is_initialized", "get_default", "resolve_comm"]

_log = logging.getLogger("zbccl")
_lock = threading.Lock()
_default: Communicator | None = None
_atexit_registered = False
_finalize_hooks: list[Callable[[GlobalHeap], None]] = []
# Spin polls before yielding when every local rank has its own core.
_DEFAULT_SPIN = 4096


def is_initialized() -> bool:
    return _default is not None


def get_default() -> Communicator | None:
    return _default


def resolve_comm(comm: Communicator | None) -> Communicator:
    """``comm``, or the default communicator; raises if zbccl is not initialized."""
    if comm is not None:
        if comm._ctx.finalized:
            raise ZbcclInvalidUsageError("zbccl: this communicator was finalized")
        return comm
    if _default is None:
        raise ZbcclInvalidUsageError("zbccl: not initialized, expected zbccl.init() first")
    return _default


def _timeout_seconds(timeout: float | timedelta | None) -> float:
    if timeout is None:
        return env.TIMEOUT.get()
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if seconds <= 0:
        raise ZbcclInvalidUsageError(f"init: timeout must be > 0 seconds, got {seconds}")
    return seconds


def _heap_bytes(heap_size: int | str | None) -> int:
    try:
        nbytes = env.HEAP_SIZE.get() if heap_size is None else env.parse_size(heap_size)
    except ValueError as exc:
        raise ZbcclInvalidUsageError(f"init: bad heap_size: {exc}") from None
    if nbytes < 4096:
        raise ZbcclInvalidUsageError(f"init: heap_size too small, expected >= 4096 bytes, got {nbytes}")
    return nbytes


def init(*, rank: int | None = None, world_size: int | None = None, init_method: str | None = None,
         store=None, group=None, heap_size: int | str | None = None,
         timeout: float | timedelta | None = None) -> Communicator:
    """Collective: join the job, build the shared heap, return the world communicator.

    With no arguments, reads the torchrun environment (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``); otherwise takes a torch ``Store``, an
    ``init_method`` URL or an existing ``ProcessGroup``. ``heap_size`` is this
    rank's heap (bytes or ``"512M"``); ranks may differ. Blocks until every rank
    arrived or ``timeout`` (default ``ZBCCL_TIMEOUT``) expired, naming the
    missing ranks.
    """
    global _default
    with _lock:
        if _default is not None:
            raise ZbcclInvalidUsageError("init: zbccl is already initialized, expected finalize() first")
        _log.setLevel(env.LOG_LEVEL.get().upper())
        seconds = _timeout_seconds(timeout)
        nbytes = _heap_bytes(heap_size)
        rdv = resolve(rank=rank, world_size=world_size, init_method=init_method, store=store,
                      group=group, timeout=seconds)
        generation = int(rdv.store.add(f"{rdv.namespace}/gen/{rdv.rank}", 1))
        boot = StoreBootstrap(rdv.store, rdv.rank, rdv.world_size, prefix=f"{rdv.namespace}/{generation}",
                              members=rdv.members)
        ctx = _build_context(rdv, boot, generation, nbytes, seconds)
        _default = Communicator(ctx, range(rdv.world_size), 0, boot)
        _register_atexit()
        return _default


def _hello(boot: StoreBootstrap, nbytes: int, timeout: float) -> tuple[str, Topology, list[int]]:
    info = local_host_info()
    payload = {"version": __version__, "host": info.to_dict(), "heap": nbytes,
               "job": uuid.uuid4().hex[:12] if boot.rank == 0 else None}
    got = [json.loads(b) for b in boot.all_gather(json.dumps(payload).encode(), timeout=timeout, tag="hello")]
    versions = {g["version"] for g in got}
    if len(versions) > 1:
        raise ZbcclInvalidUsageError(f"init: ranks run different zbccl versions, expected one, got {sorted(versions)}")
    topo = Topology(boot.rank, tuple(HostInfo.from_dict(g["host"]) for g in got))
    return got[0]["job"], topo, [int(g["heap"]) for g in got]


def _agree(boot: StoreBootstrap, error: str | None, *, timeout: float, tag: str) -> None:
    """Collective: if any rank reports an error, raise it on every rank."""
    got = [json.loads(b) for b in boot.all_gather(json.dumps(error).encode(), timeout=timeout, tag=tag)]
    for r, err in enumerate(got):
        if err is not None:
            raise ZbcclOutOfMemoryError(f"{err} (reported by rank {boot.members[r]})", ranks=(boot.members[r],))


def _build_context(rdv, boot: StoreBootstrap, generation: int, nbytes: int, timeout: float) -> Context:
    job_id, topo, heap_sizes = _hello(boot, nbytes, timeout)
    error = None
    if not env.SKIP_SHM_CHECK.get():
        needed = sum(layout.segment_bytes(heap_sizes[r]) for r in topo.local_ranks)
        try:
            check_capacity(needed, nranks=topo.local_world_size)
        except ZbcclOutOfMemoryError as exc:
            error = str(exc)
    _agree(boot, error, timeout=timeout, tag="capacity")
    transport = ShmTransport(populate=env.PREFAULT.get())
    try:
        segments = transport.establish(boot, topo, segment_bytes=[layout.segment_bytes(h) for h in heap_sizes],
                                       job_id=job_id, timeout=timeout)
        heap = GlobalHeap(boot.rank, segments, heap_sizes, transport)
        heap.init_header()
        boot.barrier(timeout=timeout, tag="headers")
        heap.check_peer_headers()
    except BaseException:
        transport.close(unmap=True)
        raise
    spin = env.WAIT_SPIN.get()
    if spin < 0:
        spin = 0 if topo.oversubscribed else _DEFAULT_SPIN
    set_threads(topo.local_world_size)
    sma = CachingAllocator(nbytes, alignment=64, cache_limit=env.SMA_CACHE_LIMIT.get())
    return Context(rendezvous=rdv, bootstrap=boot, topology=topo, heap=heap, sma=sma, job_id=job_id,
                   generation=generation, timeout=timeout, spin=spin,
                   liveness_ns=int(env.LIVENESS_INTERVAL.get() * 1e9), heap_sizes=heap_sizes)


def finalize() -> None:
    """Tear down the default communicator, its sub-groups and the heap. Idempotent.

    Does not wait for peers (a dead peer must not hang shutdown). Peers still
    waiting on this rank get :class:`~zbccl.errors.ZbcclRemoteError`. If heap
    tensors are still alive their memory stays mapped until the process exits
    (no segment can outlive the job: they are memfds).
    """
    global _default
    with _lock:
        comm, _default = _default, None
        if comm is None:
            return
        ctx = comm._ctx
        if ctx.finalized:
            return
        ctx.finalized = True
        heap = ctx.heap
        try:
            heap.set_header(layout.H_STATE, layout.STATE_FINALIZED)
        except Exception:  # noqa: BLE001 - best effort on a broken heap
            pass
        for hook in list(_finalize_hooks):
            try:
                hook(heap)
            except Exception as exc:  # noqa: BLE001 - teardown goes on
                _log.warning("zbccl: finalize hook %r failed: %s", hook, exc)
        live = ctx.sma.stats()["active_blocks"] > 0 or live_views(heap) > 0
        if live:
            _log.info("zbccl: heap tensors still alive at finalize; keeping their memory mapped")
        heap.close(unmap=not live)


def add_finalize_hook(hook: Callable[[GlobalHeap], None]) -> None:
    """Call ``hook(heap)`` at every :func:`finalize`, before the heap is unmapped.

    Upper layers (the allocator hook) use it to detach from a heap without the
    runtime importing them.
    """
    if hook not in _finalize_hooks:
        _finalize_hooks.append(hook)


def _register_atexit() -> None:
    global _atexit_registered
    if not _atexit_registered:
        atexit.register(finalize)
        _atexit_registered = True


def abort(reason: str = "aborted") -> None:
    """Mark this rank failed so that peers waiting on it raise :class:`ZbcclRemoteError` at once.

    Does not block and does not tear the heap down (call :func:`finalize` for that).
    """
    if _default is not None:
        _log.error("zbccl: rank %d aborts: %s", _default.global_rank, reason)
        _default._ctx.heap.set_header(layout.H_STATE, layout.STATE_FAILED)
