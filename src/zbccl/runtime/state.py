"""``zbccl.init`` / ``zbccl.finalize`` and the process's default communicator."""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta

from .. import env, native
from .._version import __version__
from ..bootstrap.rendezvous import resolve
from ..bootstrap.store import StoreBootstrap, in_range, parse_record
from ..bootstrap.topology import HostInfo, Topology, local_host_info
from ..errors import ZbcclInvalidUsageError, ZbcclOutOfMemoryError, ZbcclRemoteError
from ..heap import layout, releases, transports
from ..heap.capacity import auto_heap_max, check_capacity
from ..heap.heap import GlobalHeap
from ..heap.views import live_views
from ..sma import CachingAllocator
from . import device_heap, registry
from .communicator import Communicator
from .context import Context
from .liveness import InitBeat, init_watch, left_init
from .registry import get_default, in_forked_child, is_initialized, resolve_comm
from .threads import set_threads

__all__ = ["init", "finalize", "abort", "add_finalize_hook", "add_fork_hook", "is_initialized", "get_default",
           "resolve_comm", "in_forked_child"]

_log = logging.getLogger("zbccl")
_lock = threading.Lock()
_atexit_registered = False
_fork_hook_registered = False
_finalize_hooks: list[Callable[[GlobalHeap], None]] = []
_fork_hooks: list[Callable[[GlobalHeap], None]] = []
# Spin polls before yielding when every local rank has its own core.
_DEFAULT_SPIN = 4096
# How long a wait polls before it sleeps on a futex when every local rank has its own core: through the
# skew of a typical decode step's ranks (a wake-up from the futex costs 20-90 us, docs/benchmarks.md).
_DEFAULT_POLL_US = 2000.0
# ... and when ranks share cores: the least (the yield phase only).
_SHARED_POLL_US = 50.0
# finalize waits this long (at least) for ops of other threads to leave before it unmaps the heap.
_LEAVE_MIN_S = 2.0


def _timeout_seconds(timeout: float | timedelta | None) -> float:
    if timeout is None:
        return env.TIMEOUT.get()
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    try:
        return env.parse_seconds(seconds)
    except ValueError as exc:
        raise ZbcclInvalidUsageError(f"init: {exc}") from None


def _heap_bytes(heap_size: int | str | None) -> int:
    try:
        nbytes = env.HEAP_SIZE.get() if heap_size is None else env.parse_size(heap_size)
    except ValueError as exc:
        raise ZbcclInvalidUsageError(f"init: bad heap_size: {exc}") from None
    if nbytes < 4096:
        raise ZbcclInvalidUsageError(f"init: heap_size too small, expected >= 4096 bytes, got {nbytes}")
    return nbytes


def _heap_max(heap_max: int | str | None, nbytes: int) -> int | None:
    """The growth bound asked for: None for auto (sized at init), else bytes (0: no growth)."""
    try:
        if heap_max is None:
            limit = env.HEAP_MAX.get()
        elif isinstance(heap_max, str) and heap_max.strip().lower() == "auto":
            limit = None
        else:
            limit = env.parse_size(heap_max)
    except ValueError as exc:
        raise ZbcclInvalidUsageError(f"init: bad heap_max: {exc}") from None
    if limit is None or limit == 0:
        return nbytes if limit == 0 else None
    if limit < nbytes:
        raise ZbcclInvalidUsageError(
            f"init: heap_max below heap_size, expected 0 (no growth), auto or >= {nbytes} bytes, got {limit}")
    return limit


def init(*, rank: int | None = None, world_size: int | None = None, init_method: str | None = None,
         store=None, group=None, heap_size: int | str | None = None, heap_max: int | str | None = None,
         timeout: float | timedelta | None = None, device: str | None = None,
         cuda_heap_size: int | str | None = None, cuda_heap_max: int | str | None = None) -> Communicator:
    """Collective: join the job, build the shared heap, return the world communicator.

    With no arguments, reads the torchrun environment (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``); otherwise takes a torch ``Store``, an
    ``init_method`` URL or an existing ``ProcessGroup``. ``heap_size`` is this
    rank's heap (bytes or ``"512M"``); ranks may differ. ``heap_max`` (default
    ``ZBCCL_HEAP_MAX``: ``"auto"``) bounds how far it grows when a request does not
    fit; 0 means no growth. Blocks until every rank
    arrived or ``timeout`` (default ``ZBCCL_TIMEOUT``) expired, naming the
    missing ranks. ``device="cuda"`` (default ``ZBCCL_DEVICE``; implied by ``cuda_heap_size``) also
    builds a CUDA heap on the current CUDA device, of ``cuda_heap_size`` bytes growing to
    ``cuda_heap_max`` (see :mod:`zbccl.runtime.device_heap`); every rank must ask for it, or none.
    """
    with _lock:
        if in_forked_child():
            resolve_comm(None, op="init")  # raises: a forked child may not join (see README, Fork)
        if registry.get_default() is not None:
            raise ZbcclInvalidUsageError("init: zbccl is already initialized, expected finalize() first")
        _log.setLevel(env.LOG_LEVEL.get().upper())
        seconds = _timeout_seconds(timeout)
        nbytes = _heap_bytes(heap_size)
        max_bytes = _heap_max(heap_max, nbytes)
        dev = device_heap.request(device, cuda_heap_size, cuda_heap_max)
        for var in env.VARIABLES:
            var.get()  # a bad value fails here, before any peer waits on this rank
        rdv = resolve(rank=rank, world_size=world_size, init_method=init_method, store=store,
                      group=group, timeout=seconds)
        # Every library is ready before the first op (a JIT build of a source install happens here, not
        # inside a collective); without the core, a world of several ranks fails now, not at its first op.
        native.prepare(world_size=rdv.world_size)
        generation = _generation(rdv)
        boot = StoreBootstrap(rdv.store, rdv.rank, rdv.world_size, prefix=f"{rdv.namespace}/{generation}",
                              members=rdv.members, record=True)
        beat = InitBeat(boot)  # before the hello record: the peers on other hosts watch this rank by it
        try:
            ctx = _build_context(rdv, boot, generation, nbytes, max_bytes, seconds, dev)
        finally:
            beat.stop()
        comm = Communicator(ctx, range(rdv.world_size), 0, boot)
        boot.default_watch = comm.store_watch  # every later store wait of the world watches the liveness rule
        registry.set_default(comm)
        _register_atexit()
        return comm


def _hello(boot: StoreBootstrap, nbytes: int, max_bytes: int | None, timeout: float,
           dev: device_heap.Request | None = None) -> tuple[str, Topology, list[int], list[int | None], list]:
    info = local_host_info()
    payload = {"version": __version__, "host": info.to_dict(), "heap": nbytes, "heap_max": max_bytes,
               "job": uuid.uuid4().hex[:12] if boot.rank == 0 else None, "cuda": dev and dev.to_hello()}
    raw = boot.all_gather(json.dumps(payload).encode(), timeout=timeout, tag="hello")
    got = [parse_record(b, _hello_of, op="init", rank=boot.members[r], what="a hello record (version, host, "
                        f"heap sizes of 4096 to {env.MAX_BYTES} bytes{', job id' if r == 0 else ''})")
           for r, b in enumerate(raw)]
    versions = {g["version"] for g in got}
    if len(versions) > 1:
        raise ZbcclInvalidUsageError(f"init: ranks run different zbccl versions, expected one, got {sorted(versions)}")
    if not isinstance(got[0]["job"], str) or not re.fullmatch(r"[0-9a-f]{12}", got[0]["job"]):
        raise ZbcclRemoteError(f"init: malformed job id from rank {boot.members[0]} in the rendezvous store, "
                               f"expected 12 hex digits, got {got[0]['job']!r}", ranks=(boot.members[0],))
    topo = Topology(boot.rank, tuple(g["host"] for g in got))
    return got[0]["job"], topo, [g["heap"] for g in got], [g["heap_max"] for g in got], [g["cuda"] for g in got]


def _hello_of(d) -> dict:
    """A hello record, checked field by field (the store is not authenticated yet)."""
    if not isinstance(d["version"], str):
        raise TypeError(d["version"])
    host = HostInfo.from_dict(d["host"])
    if not (isinstance(host.host_id, str) and isinstance(host.hostname, str) and host.pid > 0 and host.cores >= 0):
        raise ValueError(host)
    heap_max = d["heap_max"]
    return {"version": d["version"], "host": host, "heap": in_range(d["heap"], 4096, env.MAX_BYTES),
            "heap_max": None if heap_max is None else in_range(heap_max, 4096, env.MAX_BYTES), "job": d["job"],
            "cuda": device_heap.parse_hello(d.get("cuda"))}


def _agree(boot: StoreBootstrap, error: str | None, *, timeout: float, tag: str) -> None:
    """Collective: if any rank reports an error, raise it on every rank."""
    raw = boot.all_gather(json.dumps(error).encode(), timeout=timeout, tag=tag)
    got = [parse_record(b, _text_or_none, op="init", rank=boot.members[r], what="null or an error text")
           for r, b in enumerate(raw)]
    for r, err in enumerate(got):
        if err is not None:
            raise ZbcclOutOfMemoryError(f"{err} (reported by rank {boot.members[r]})", ranks=(boot.members[r],))


def _generation(rdv) -> int:
    """This rank's init count on the store (a fresh key prefix per init); a dead store is a remote error."""
    try:
        return int(rdv.store.add(f"{rdv.namespace}/gen/{rdv.rank}", 1))
    except (RuntimeError, OSError) as exc:  # torch's DistError family is RuntimeError
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ZbcclRemoteError(f"init: the rendezvous store stopped answering, expected it reachable, got "
                               f"{type(exc).__name__}: {first}", ranks=(0,)) from None


def _build_context(rdv, boot: StoreBootstrap, generation: int, nbytes: int, max_bytes: int | None,
                   timeout: float, dev: device_heap.Request | None = None) -> Context:
    boot.default_watch = init_watch(boot, None)  # every wait of init watches the peers that left init
    try:
        job_id, topo, heap_sizes, asked_max, asked_dev = _hello(boot, nbytes, max_bytes, timeout, dev)
        want_dev = device_heap.check_agreement(asked_dev, boot.members)
    except BaseException as exc:
        boot.default_watch = None
        left_init(boot, exc)
        raise
    # From here the peers' pids are known: every wait of init watches their processes too (and, by their
    # heartbeats, the peers on other hosts).
    transport = transports.create(topo, "cpu", populate=env.PREFAULT.get())
    transport.watch_peers(topo)
    boot.default_watch = init_watch(boot, transport, topo)
    try:
        error = None
        if not env.SKIP_SHM_CHECK.get():
            needed = sum(layout.segment_bytes(heap_sizes[r]) for r in topo.local_ranks)
            try:
                check_capacity(needed, nranks=topo.local_world_size)
            except ZbcclOutOfMemoryError as exc:
                error = str(exc)
        _agree(boot, error, timeout=timeout, tag="capacity")
        if max_bytes is None:  # auto: sized by the same capacity the check just read, shared by the local ranks
            max_bytes = auto_heap_max(nbytes, nranks=topo.local_world_size)
        max_sizes = _exchange_max(boot, max_bytes, asked_max, timeout)
        segments = transport.establish(boot, topo, data_bytes=heap_sizes, reserve_bytes=max_sizes,
                                       job_id=job_id, timeout=timeout)
        heap = GlobalHeap(boot.rank, segments, heap_sizes, transport, max_sizes=max_sizes)
        heap.init_header()
        boot.barrier(timeout=timeout, tag="headers")
        heap.check_peer_headers()
        # From here every store value is sealed; the init records exchanged before are checked now.
        boot.adopt_secret(transport.job_secret(job_id, boot.world_size), timeout=timeout)
        dev_heaps = device_heap.build(boot, topo, job_id, asked_dev, timeout) if want_dev else {}
    except BaseException as exc:
        boot.default_watch = None
        left_init(boot, exc)  # the peers' init waits name this rank now, not at their timeout
        transport.close(unmap=True)
        raise
    spin = env.WAIT_SPIN.get()
    if spin < 0:
        spin = 0 if topo.oversubscribed else _DEFAULT_SPIN
    poll_us = env.WAIT_POLL_US.get()
    if poll_us < 0:
        poll_us = _SHARED_POLL_US if topo.oversubscribed else _DEFAULT_POLL_US
    poll_ns = int(poll_us * 1000)
    if hasattr(heap.prims, "set_wait_poll"):
        heap.prims.set_wait_poll(poll_ns)
    set_threads(frozenset(topo.infos[topo.rank].cpus), topo.local_masks)
    sma = CachingAllocator(nbytes, alignment=64, cache_limit=env.SMA_CACHE_LIMIT.get(), max_bytes=max_bytes,
                           grow=_grower(heap) if max_bytes > nbytes else None, before=releases.drain)
    return Context(rendezvous=rdv, bootstrap=boot, topology=topo, heap=heap, sma=sma, job_id=job_id,
                   generation=generation, timeout=timeout, spin=spin, poll_ns=poll_ns,
                   liveness_ns=int(env.LIVENESS_INTERVAL.get() * 1e9), heap_sizes=heap_sizes,
                   device_heaps=dev_heaps)


def _exchange_max(boot: StoreBootstrap, max_bytes: int, asked: list[int | None], timeout: float) -> list[int]:
    """Every rank's heap_max: as announced at hello, or exchanged once when some rank chose auto."""
    if all(m is not None for m in asked):
        return [int(m) for m in asked]
    got = boot.all_gather(json.dumps(max_bytes).encode(), timeout=timeout, tag="heap-max")
    return [parse_record(b, lambda v: in_range(v, 4096, env.MAX_BYTES), op="init", rank=boot.members[r],
                         what=f"a heap_max of 4096 to {env.MAX_BYTES} bytes") for r, b in enumerate(got)]


def _text_or_none(value) -> str | None:
    if value is not None and not isinstance(value, str):
        raise TypeError(value)
    return value


def _grower(heap: GlobalHeap) -> Callable[[int], None]:
    """The SMA's grow callback: the capacity check (as at init), then the heap grows and publishes."""

    def grow(nbytes: int) -> None:
        if not env.SKIP_SHM_CHECK.get():
            check_capacity(layout.segment_bytes(nbytes) - layout.segment_bytes(heap.heap_bytes), nranks=1,
                           op="grow")
        heap.grow(nbytes)

    return grow


def finalize() -> None:
    """Tear down the default communicator, its sub-groups and the heap. Idempotent.

    Does not wait for peers (a dead peer must not hang shutdown). Peers still
    waiting on this rank get :class:`~zbccl.errors.ZbcclRemoteError`. Ops that
    other threads of this rank still run get a :class:`~zbccl.errors.ZbcclError`
    ("finalize() was called on this rank while the op waited"); the heap is
    unmapped only after they left (waited for a few seconds; one that never
    leaves keeps the heap mapped, and that is logged). If heap tensors are still
    alive their memory stays mapped until the process exits (no segment can
    outlive the job: they are memfds). In a forked child it touches nothing shared.
    """
    with _lock:
        comm = registry.get_default()
        registry.set_default(None)
        if comm is None:
            return
        ctx = comm._ctx
        if ctx.finalized:
            return
        ctx.finalized = True
        heap = ctx.heap
        if not ctx.forked:  # the parent's heap and header are not ours to touch (see _after_fork_in_child)
            try:  # first: in-flight waits (native and Python) and the peers notice it, whatever happens next
                heap.set_header(layout.H_STATE, layout.STATE_FINALIZED)
            except Exception:  # noqa: BLE001 - best effort on a broken heap
                pass
        for c in list(ctx.comms):
            c._live = False
            if getattr(c.op_state, "disable", None) is not None:
                c.op_state.disable(0)  # the native hot entry serves no more calls (it skips _live)
            registry.close_device_state(c)  # before any device heap goes
        if ctx.forked:
            return
        left = _wait_ops_left(ctx)
        for release in ctx.after_ops if left else ():  # (else an op may still use them: they stay)
            try:
                release()
            except Exception as exc:  # noqa: BLE001 - teardown goes on
                _log.warning("zbccl: finalize: %s failed: %s", release, exc)
        ctx.after_ops.clear()
        for hook in list(_finalize_hooks):
            try:
                hook(heap)
            except Exception as exc:  # noqa: BLE001 - teardown goes on
                _log.warning("zbccl: finalize hook %r failed: %s", hook, exc)
        device_heap.close_all(ctx.device_heaps, may_unmap=left)
        if not left:
            return  # an op still runs on the heap: leave it mapped (and its sockets open)
        live = ctx.sma.stats()["active_blocks"] > 0 or live_views(heap) > 0
        if live:
            _log.info("zbccl: heap tensors still alive at finalize; keeping their memory mapped")
        heap.close(unmap=not live)


def _wait_ops_left(ctx: Context) -> bool:
    """Wait (bounded) until no other thread runs or queues an op on any communicator of ``ctx``.

    Their waits see this rank's FINALIZED state within one liveness interval and
    raise; the bound leaves room for many of them. False if one never left (or
    this very thread is inside an op, e.g. finalize from a signal handler).
    """
    bound = min(max(_LEAVE_MIN_S, 20 * ctx.liveness_ns / 1e9), env.MAX_SECONDS)  # a wait must represent it
    deadline = time.monotonic() + bound
    comms = list(ctx.comms)
    for c in comms:
        c._op_lock.wake()
    mine = [c for c in comms if c._op_lock.held_by_me()]
    stuck = [c for c in comms if not c._op_lock.wait_idle(deadline)]
    stuck += [c for c in comms if c not in stuck and getattr(c.op_state, "disable", None) is not None
              and not c.op_state.disable(max(0.0, deadline - time.monotonic()))]  # hot calls left too
    if mine or stuck:
        _log.warning("zbccl: finalize: ops still running on communicators %s after %.1fs; keeping the heap "
                     "mapped so that they cannot fault", [list(c.ranks) for c in mine + stuck],
                     bound)
        return False
    return True


def add_finalize_hook(hook: Callable[[GlobalHeap], None]) -> None:
    """Call ``hook(heap)`` at every :func:`finalize`, before the heap is unmapped.

    Upper layers (the allocator hook) use it to detach from a heap without the
    runtime importing them.
    """
    if hook not in _finalize_hooks:
        _finalize_hooks.append(hook)


def add_fork_hook(hook: Callable[[GlobalHeap], None]) -> None:
    """Call ``hook(heap)`` in a child forked from an initialized process, right after the fork.

    Upper layers use it to stop handing out the parent's heap memory (the
    allocator hook). It must take no lock another thread could have held at fork.
    """
    if hook not in _fork_hooks:
        _fork_hooks.append(hook)


def _register_atexit() -> None:
    global _atexit_registered, _fork_hook_registered
    if not _atexit_registered:
        atexit.register(finalize)
        _atexit_registered = True
    if not _fork_hook_registered:  # at init, never at import
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _fork_hook_registered = True


def _after_fork_in_child() -> None:
    """Disown the parent's communicators: the child shares the parent's heap mappings.

    Its SMA is a copy of the parent's, so it would hand out blocks the parent
    also hands out; its header is the parent's, so its finalize would tell the
    peers "rank r called finalize"; its op sequence numbers would desynchronise
    the parent's group. So the child may not use zbccl at all, and touches
    nothing shared. The inherited liveness sockets are closed here, so that a
    parent's death is not hidden by a child holding its connections open.
    No lock is taken: another thread of the parent may have held one at fork.
    """
    comm = registry.get_default()
    if comm is None or comm._ctx.finalized:
        return
    ctx = comm._ctx
    ctx.forked = True
    for c in list(ctx.comms):
        c._live = False
    registry.mark_forked_child(os.getppid())
    registry.set_default(None)
    # Inherited heap tensors still die in the child (finalizers call sma.free on the child's private
    # copy of the allocator). A thread that held the allocator's lock at fork does not exist here,
    # so that lock would block those frees forever: re-arm it (nothing else uses this copy).
    for sma in [ctx.sma] + [dh.sma for dh in ctx.device_heaps.values()]:
        sma.after_fork_in_child()
    try:
        for t in [ctx.heap.transport] + [dh.transport for dh in ctx.device_heaps.values()]:
            t.close(unmap=False)
    except Exception as exc:  # noqa: BLE001 - the child goes on without zbccl
        _log.warning("zbccl: forked child could not close the inherited sockets: %s", exc)
    for hook in list(_fork_hooks):
        try:
            hook(ctx.heap)
        except Exception as exc:  # noqa: BLE001
            _log.warning("zbccl: fork hook %r failed: %s", hook, exc)


def abort(reason: str = "aborted") -> None:
    """Mark this rank failed so that peers waiting on it raise :class:`ZbcclRemoteError` at once.

    Does not block and does not tear the heap down (call :func:`finalize` for that).
    """
    comm = registry.get_default()
    if comm is not None:
        _log.error("zbccl: rank %d aborts: %s", comm.global_rank, reason)
        comm._ctx.heap.set_header(layout.H_STATE, layout.STATE_FAILED)
