"""Device heaps: a CUDA heap beside the CPU heap, built collectively at ``zbccl.init``.

Asked for with ``init(device="cuda")`` (or ``ZBCCL_DEVICE=cuda``), sized by
``cuda_heap_size`` (``ZBCCL_CUDA_HEAP_SIZE``), bounded by ``cuda_heap_max``
(``ZBCCL_CUDA_HEAP_MAX``; default ``auto``: the device's memory, as address
space only; 0: no growth). Every rank must ask, or none (checked at init, refused
on every rank). A growth returns once every local peer mapped it (the transport's
handshake), as the CPU heap's growth is visible to every peer when it returns.
The CPU heap stays: barriers, the op channel and the store-based ops use it.

The heap lives on each rank's current CUDA device at init (``torch.cuda.set_device``
first). It is a :class:`~zbccl.heap.transports.cuda.transport.CudaTransport`
established over the local ranks, a :class:`~zbccl.heap.heap.GlobalHeap` over
it (bounds checks, growth; no header: the device signal pad belongs to the
kernels) and its own :class:`~zbccl.sma.CachingAllocator` (512-byte
alignment, as torch's CUDA blocks). Set-up fails on every rank together (the
transport's agree steps), leaving nothing mapped; ``finalize`` unmaps it after
the CPU heap (kept mapped while a tensor of it is alive).

Accessor for the device-op layer and the adapters::

    dh = comm.device_heap("cuda")        # or ctx.device_heaps["cuda"]; a clear error if the job has none
    transport, heap, sma = dh            # dh.device: the torch.device it lives on
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .. import env
from ..bootstrap.store import StoreBootstrap, in_range, parse_record
from ..bootstrap.topology import Topology
from ..errors import ZbcclError, ZbcclInvalidUsageError, ZbcclSystemError
from ..heap import releases, transports
from ..heap.heap import GlobalHeap
from ..heap.transports.base import Transport
from ..heap.transports.handout import agree
from ..sma import CachingAllocator

__all__ = ["DeviceHeap", "Request", "request", "check_agreement", "build", "close_all", "KINDS"]

_log = logging.getLogger("zbccl")
#: Device heaps init() can build (keys of ``Context.device_heaps``).
KINDS = ("cuda",)
#: Block alignment of a device heap's SMA (torch's CUDA caching allocator rounds blocks to 512 bytes).
ALIGNMENT = 512


@dataclass
class DeviceHeap:
    """One device heap of this process: ``transport, heap, sma = dh`` unpacks it."""

    device: torch.device
    transport: Transport
    heap: GlobalHeap
    sma: CachingAllocator

    def __iter__(self):
        return iter((self.transport, self.heap, self.sma))


@dataclass(frozen=True)
class Request:
    """What this rank asked for at init: a CUDA heap of ``size`` bytes growing to ``max`` (None: auto)."""

    kind: str
    size: int
    max: int | None

    def to_hello(self) -> list:
        return [self.size, self.max]


def request(device: str | torch.device | None, size: int | str | None, max_bytes: int | str | None) -> Request | None:
    """The device heap this rank asks for (arguments, else the environment), checked; no CUDA call."""
    try:
        kind = env.DEVICE.get() if device is None else torch.device(device).type
    except (RuntimeError, TypeError) as exc:
        raise ZbcclInvalidUsageError(f"init: bad device, expected 'cpu' or 'cuda', got {device!r} ({exc})") from None
    if size is not None and device is None:
        kind = "cuda"  # a CUDA heap size asks for the CUDA heap
    if kind == "cpu":
        return None
    if kind not in KINDS:
        raise ZbcclInvalidUsageError(f"init: no heap for device {kind}, expected 'cpu' or 'cuda', got {device!r}")
    try:
        nbytes = env.CUDA_HEAP_SIZE.get() if size is None else env.parse_size(size)
    except ValueError as exc:
        raise ZbcclInvalidUsageError(f"init: bad cuda_heap_size: {exc}") from None
    if nbytes < 4096:
        raise ZbcclInvalidUsageError(f"init: cuda_heap_size too small, expected >= 4096 bytes, got {nbytes}")
    try:
        if max_bytes is None:
            limit = env.CUDA_HEAP_MAX.get()
        elif isinstance(max_bytes, str) and max_bytes.strip().lower() == "auto":
            limit = None
        else:
            limit = env.parse_size(max_bytes)
    except ValueError as exc:
        raise ZbcclInvalidUsageError(f"init: bad cuda_heap_max: {exc}") from None
    if limit == 0:
        limit = nbytes
    if limit is not None and limit < nbytes:
        raise ZbcclInvalidUsageError(
            f"init: cuda_heap_max below cuda_heap_size, expected 0 (no growth), auto or >= {nbytes} bytes, "
            f"got {limit}")
    return Request(kind, nbytes, limit)


def parse_hello(value) -> list | None:
    """The ``cuda`` field of a hello record, checked (the store is not authenticated yet)."""
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != 2:
        raise ValueError(value)
    size, top = value
    return [in_range(size, 4096, env.MAX_BYTES), None if top is None else in_range(top, 4096, env.MAX_BYTES)]


def check_agreement(asked: list[list | None], members: list[int]) -> bool:
    """True when every rank asked for a CUDA heap, False when none did; raises (on every rank alike) otherwise."""
    yes = [members[r] for r, a in enumerate(asked) if a is not None]
    if yes and len(yes) != len(asked):
        no = [members[r] for r, a in enumerate(asked) if a is None]
        raise ZbcclInvalidUsageError(
            f"init: ranks disagree about the cuda heap, expected every rank or none to ask for one "
            f"(init(device='cuda') or ZBCCL_DEVICE=cuda), got ranks {yes} asking and {no} not")
    return bool(yes)


def _local_setup(rank: int, asked: list) -> tuple[int, int]:
    """This rank's device ordinal and heap_max (auto resolved), or raises (a ZbcclError naming this rank)."""
    from ..heap.transports.cuda import vmm

    if not torch.cuda.is_available():
        raise ZbcclSystemError(
            f"init: the cuda heap needs a GPU, expected torch.cuda.is_available(), got False (torch "
            f"{torch.__version__}, built for CUDA {torch.version.cuda})", ranks=(rank,))
    vmm.driver()
    index = torch.cuda.current_device()
    size, top = asked
    if top is None:  # auto: as much as the device holds (address space only; memory as the heap grows)
        top = max(size, int(torch.cuda.get_device_properties(index).total_memory))
    return index, top


def build(boot: StoreBootstrap, topo: Topology, job_id: str, asked: list[list], timeout: float) -> dict[str, DeviceHeap]:
    """Collective: every rank's CUDA heap established over the local ranks (all asked, see check_agreement)."""
    rank = boot.rank
    error, index, top = None, -1, 0
    try:
        index, top = _local_setup(rank, asked[rank])
    except ZbcclError as exc:
        error = exc
    except Exception as exc:  # noqa: BLE001 - torch's CUDA errors too: every rank must hear it
        error = ZbcclSystemError(f"init: the cuda heap cannot be set up here: {type(exc).__name__}: {exc}",
                                 ranks=(rank,))
    got = agree(boot, {"max": top, "device": index}, error, timeout=timeout, tag="cuda-heap")
    maxes = [parse_record(b, lambda d: in_range(d["max"], 4096, env.MAX_BYTES), op="init", rank=boot.members[r],
                          what="a cuda heap_max of 4096 to 2^62 bytes") for r, b in enumerate(got)]
    sizes = [a[0] for a in asked]
    transport = transports.create(topo, torch.device("cuda", index))
    try:
        segments = transport.establish(boot, topo, data_bytes=sizes, reserve_bytes=maxes, job_id=job_id,
                                       timeout=timeout)
        heap = GlobalHeap(rank, segments, sizes, transport, max_sizes=maxes)
    except BaseException:
        transport.close(unmap=True)
        raise
    sma = CachingAllocator(sizes[rank], alignment=ALIGNMENT, cache_limit=env.SMA_CACHE_LIMIT.get(),
                           max_bytes=maxes[rank], grow=heap.grow if maxes[rank] > sizes[rank] else None,
                           before=releases.drain)
    return {"cuda": DeviceHeap(torch.device("cuda", index), transport, heap, sma)}


def close_all(heaps: dict[str, DeviceHeap], *, may_unmap: bool) -> None:
    """Tear down every device heap (finalize): unmapped unless a tensor of it is alive or ``not may_unmap``."""
    for name, dh in list(heaps.items()):
        try:
            live = dh.sma.stats()["active_blocks"] > 0 or dh.transport.live_views() > 0
            if live and may_unmap:
                _log.info("zbccl: %s heap tensors still alive at finalize; keeping their memory mapped", name)
            dh.heap.close(unmap=may_unmap and not live)
        except Exception as exc:  # noqa: BLE001 - teardown goes on
            _log.warning("zbccl: closing the %s heap failed: %s", name, exc)
