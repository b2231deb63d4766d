"""A small wrapper over CUDA's virtual memory management (VMM) driver API, for the cuda transport.

Everything goes through ``cuda.bindings.driver`` (the ``cuda-bindings`` package,
``pip install zbccl[cuda]``), imported on first use, never at ``import zbccl``.
Every call is checked; a failure raises :class:`~zbccl.errors.ZbcclSystemError`
(:class:`~zbccl.errors.ZbcclOutOfMemoryError` for ``CUDA_ERROR_OUT_OF_MEMORY``)
naming the driver call and the CUDA error, e.g.
``"heap: cuMemMap failed: CUDA_ERROR_INVALID_VALUE (invalid argument)"``.

The sharing scheme (the one torch SymmetricMemory, UCX and FlashInfer use):

* :func:`create` makes a physical allocation on a device with
  ``cuMemCreate``, asking for a POSIX file-descriptor handle type;
  :func:`export_fd` turns it into a close-on-exec descriptor that can travel
  over a Unix socket (``SCM_RIGHTS``);
* a peer turns the received descriptor back into a handle with
  :func:`import_fd` (and closes the descriptor: the handle holds the memory);
* a :class:`Mapping` is a reserved virtual address range
  (``cuMemAddressReserve``) of a rank's maximum size, into which physical
  chunks are mapped one after another (``cuMemMap`` + ``cuMemSetAccess``):
  growth is one more chunk at the end, so the range stays linear and every
  address handed out before stays valid;
* :meth:`Mapping.close` unmaps every chunk, releases the handles and frees
  the range.

Two processes on one GPU may import each other's allocations (no peer access
between devices is involved); nothing here needs one GPU per process.
"""

from __future__ import annotations

import fcntl
import os
import threading
from dataclasses import dataclass, field
from typing import Any

from ....errors import ZbcclInvalidUsageError, ZbcclOutOfMemoryError, ZbcclSystemError

__all__ = [
    "INSTALL_HINT", "driver", "check", "ensure_context", "granularity", "round_up", "create",
    "export_fd", "import_fd", "release", "reserve", "free_va", "map_chunk", "unmap", "Chunk", "Mapping",
    "write_value64", "copy_dtoh", "stream_sync", "mem_alloc", "mem_free", "relax_capture_mode",
]

#: How to get the bindings, for every "missing" message.
INSTALL_HINT = "pip install zbccl[cuda] (the cuda-bindings package)"

_lock = threading.Lock()
_driver: Any = None
_ctx: dict[int, Any] = {}  # device ordinal -> its retained primary context


def driver() -> Any:
    """``cuda.bindings.driver``, imported and initialised (``cuInit``) on first use.

    Raises :class:`~zbccl.errors.ZbcclSystemError` saying how to install the
    bindings when they are missing, and that no driver was found when
    ``libcuda`` cannot be loaded (a machine without an NVIDIA GPU).
    """
    global _driver
    if _driver is not None:
        return _driver
    with _lock:
        if _driver is not None:
            return _driver
        try:
            from cuda.bindings import driver as drv
        except ImportError as exc:
            raise ZbcclSystemError(
                f"cuda: the CUDA driver bindings are missing, expected the cuda-bindings package, got "
                f"ImportError: {exc} ({INSTALL_HINT})") from None
        try:
            (err,) = drv.cuInit(0)
        except Exception as exc:  # noqa: BLE001 - the bindings raise their own types when libcuda is absent
            raise ZbcclSystemError(
                f"cuda: no NVIDIA driver found, expected libcuda.so to load, got {type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''} (is this a machine with a GPU?)") from None
        _raise_if(drv, err, "cuInit", "cuda")
        _driver = drv
        return drv


def _error_name(drv: Any, err: Any) -> str:
    name = getattr(err, "name", None) or str(err)
    try:
        res, text = drv.cuGetErrorString(err)
        if int(res) == 0 and text:
            return f"{name} ({text.decode() if isinstance(text, bytes) else text})"
    except Exception:  # noqa: BLE001 - the name alone is enough
        pass
    return name


def _raise_if(drv: Any, err: Any, call: str, op: str) -> None:
    if int(err) == 0:
        return
    what = _error_name(drv, err)
    cls = ZbcclOutOfMemoryError if getattr(err, "name", "") == "CUDA_ERROR_OUT_OF_MEMORY" else ZbcclSystemError
    raise cls(f"{op}: {call} failed, expected CUDA_SUCCESS, got {what}")


def check(result: tuple, call: str, *, op: str = "heap") -> Any:
    """The values of a ``cuda.bindings`` call's ``(CUresult, *values)``; raises on an error.

    Returns None for no value, the value for one, a tuple for several.
    """
    _raise_if(driver(), result[0], call, op)
    values = result[1:]
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def ensure_context(device: int) -> None:
    """Make ``device``'s primary context (the one torch uses) current on this thread if none is.

    Driver calls that copy or write (and some VMM calls) need a current
    context; a thread torch never touched has none.
    """
    drv = driver()
    cur = check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent", op="cuda")
    if cur is not None and int(cur) != 0:
        return
    ctx = _ctx.get(device)
    if ctx is None:
        with _lock:
            ctx = _ctx.get(device)
            if ctx is None:
                dev = check(drv.cuDeviceGet(device), "cuDeviceGet", op="cuda")
                ctx = _ctx[device] = check(drv.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain",
                                           op="cuda")
    check(drv.cuCtxSetCurrent(ctx), "cuCtxSetCurrent", op="cuda")


def relax_capture_mode() -> None:
    """Put this thread in the relaxed stream-capture mode: its driver calls (a mapper thread's ``cuMemMap`` and
    ``cuMemSetAccess``) are then never checked against another thread's capture in torch's default ``global``
    mode, which would invalidate that capture. These calls enqueue no stream work, so relaxing them is safe."""
    drv = driver()
    check(drv.cuThreadExchangeStreamCaptureMode(drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED),
          "cuThreadExchangeStreamCaptureMode", op="cuda")


def _prop(device: int) -> Any:
    drv = driver()
    prop = drv.CUmemAllocationProp()
    prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    prop.requestedHandleTypes = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    return prop


_gran: dict[tuple[int, bool], int] = {}


def granularity(device: int, *, recommended: bool = False) -> int:
    """Allocation granularity of ``device`` for shareable chunks (minimum, or the recommended one)."""
    key = (device, recommended)
    if key not in _gran:
        drv = driver()
        flag = (drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED if recommended
                else drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)
        _gran[key] = int(check(drv.cuMemGetAllocationGranularity(_prop(device), flag),
                               "cuMemGetAllocationGranularity"))
    return _gran[key]


def round_up(nbytes: int, align: int) -> int:
    return (nbytes + align - 1) // align * align


def create(nbytes: int, device: int) -> int:
    """A physical allocation of ``nbytes`` (a multiple of :func:`granularity`) on ``device``, exportable as an fd."""
    if nbytes <= 0 or nbytes % granularity(device):
        raise ZbcclInvalidUsageError(
            f"heap: chunk size not a multiple of the device granularity, expected a positive multiple of "
            f"{granularity(device)}, got {nbytes}")
    handle = check(driver().cuMemCreate(nbytes, _prop(device), 0), "cuMemCreate")
    return int(handle)


def export_fd(handle: int) -> int:
    """A new close-on-exec POSIX descriptor for ``handle`` (the caller owns it)."""
    drv = driver()
    fd = int(check(drv.cuMemExportToShareableHandle(
        handle, drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
        "cuMemExportToShareableHandle"))
    try:
        fcntl.fcntl(fd, fcntl.F_SETFD, fcntl.fcntl(fd, fcntl.F_GETFD) | fcntl.FD_CLOEXEC)
    except OSError as exc:
        os.close(fd)
        raise ZbcclSystemError(f"heap: cannot mark an exported descriptor close-on-exec: {exc}") from None
    return fd


def import_fd(fd: int) -> int:
    """A handle to the allocation behind ``fd`` (received from its owner). ``fd`` stays the caller's to close."""
    drv = driver()
    handle = check(drv.cuMemImportFromShareableHandle(
        fd, drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
        "cuMemImportFromShareableHandle")
    return int(handle)


def release(handle: int) -> None:
    check(driver().cuMemRelease(handle), "cuMemRelease")


def reserve(nbytes: int, alignment: int) -> int:
    """A reserved (unmapped) virtual address range of ``nbytes``."""
    return int(check(driver().cuMemAddressReserve(nbytes, alignment, 0, 0), "cuMemAddressReserve"))


def free_va(va: int, nbytes: int) -> None:
    check(driver().cuMemAddressFree(va, nbytes), "cuMemAddressFree")


def map_chunk(va: int, nbytes: int, handle: int, device: int) -> None:
    """Map ``handle`` at ``va`` and make it readable and writable from ``device`` (undone on failure)."""
    drv = driver()
    check(drv.cuMemMap(va, nbytes, 0, handle, 0), "cuMemMap")
    desc = drv.CUmemAccessDesc()
    desc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = device
    desc.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    try:
        check(drv.cuMemSetAccess(va, nbytes, [desc], 1), "cuMemSetAccess")
    except BaseException:
        drv.cuMemUnmap(va, nbytes)
        raise


def unmap(va: int, nbytes: int) -> None:
    check(driver().cuMemUnmap(va, nbytes), "cuMemUnmap")


def _stream(stream: int) -> Any:
    return driver().CUstream(int(stream))


def write_value64(stream: int, addr: int, value: int) -> None:
    """Enqueue a 64-bit store of ``value`` at device address ``addr`` on ``stream`` (a fence before it)."""
    drv = driver()
    check(drv.cuStreamWriteValue64(_stream(stream), addr, value & ((1 << 64) - 1),
                                   drv.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT),
          "cuStreamWriteValue64")


def copy_dtoh(dst: int, src: int, nbytes: int, stream: int) -> None:
    """Enqueue a device-to-host copy on ``stream`` (``dst``: pinned host memory for it to be asynchronous)."""
    check(driver().cuMemcpyDtoHAsync(dst, src, nbytes, _stream(stream)), "cuMemcpyDtoHAsync")


def stream_sync(stream: int) -> None:
    check(driver().cuStreamSynchronize(_stream(stream)), "cuStreamSynchronize")


@dataclass
class Chunk:
    """One physical allocation mapped into a :class:`Mapping` at ``offset``."""

    offset: int
    nbytes: int
    handle: int


@dataclass
class Mapping:
    """A reserved virtual range of ``reserved`` bytes on ``device`` with chunks mapped from its start.

    ``mapped`` is how many bytes from ``va`` are backed. Growing maps one more
    chunk at ``va + mapped``. Not thread-safe: its owner serialises growth.
    """

    device: int
    reserved: int
    va: int = 0
    chunks: list[Chunk] = field(default_factory=list)

    @classmethod
    def reserve(cls, device: int, nbytes: int) -> Mapping:
        gran = granularity(device)
        size = round_up(max(nbytes, gran), gran)
        return cls(device, size, reserve(size, gran))

    @property
    def mapped(self) -> int:
        last = self.chunks[-1] if self.chunks else None  # the chunks tile [0, mapped) in order
        return last.offset + last.nbytes if last is not None else 0

    def add(self, handle: int, nbytes: int) -> int:
        """Map ``handle`` (``nbytes``, granularity-aligned) at the end; returns its offset. Takes ownership
        of ``handle`` (released at :meth:`close`, or now if mapping fails)."""
        offset = self.mapped
        if offset + nbytes > self.reserved:
            release(handle)
            raise ZbcclOutOfMemoryError(
                f"heap: grow: mapping of {offset + nbytes} bytes requested, expected at most the "
                f"{self.reserved} reserved")
        try:
            map_chunk(self.va + offset, nbytes, handle, self.device)
        except BaseException:
            release(handle)
            raise
        self.chunks.append(Chunk(offset, nbytes, handle))
        return offset

    def close(self) -> None:
        """Unmap every chunk, release the handles and free the range (best effort past the first error)."""
        first: BaseException | None = None
        for c in reversed(self.chunks):
            for call in (lambda c=c: unmap(self.va + c.offset, c.nbytes), lambda c=c: release(c.handle)):
                try:
                    call()
                except BaseException as exc:  # noqa: BLE001 - go on releasing, report the first
                    first = first or exc
        self.chunks.clear()
        if self.va:
            try:
                free_va(self.va, self.reserved)
            except BaseException as exc:  # noqa: BLE001
                first = first or exc
            self.va = 0
        if first is not None:
            raise first


def mem_alloc(nbytes: int) -> int:
    """Ordinary device memory (``cuMemAlloc``) on the current context's device: a heap_scope fallback."""
    return int(check(driver().cuMemAlloc(nbytes), "cuMemAlloc"))


def mem_free(ptr: int) -> None:
    check(driver().cuMemFree(ptr), "cuMemFree")
