"""The CUDA heap's host-side glue, without a GPU: init's request parsing and the MemPool allocator callbacks.

The callbacks are driven through their C function pointers, exactly as torch's pluggable allocator calls
them; only the device memory behind them is absent (a made-up base address, a fake ``cuMemAlloc`` for the
fallback), so the SMA bookkeeping, strictness and fallback are real.
"""

from __future__ import annotations

import ctypes
import threading

import pytest

from zbccl.adapters import cuda_scope
from zbccl.errors import ZbcclInvalidUsageError
from zbccl.runtime import device_heap
from zbccl.sma import CachingAllocator


# ---------------------------------------------------------------- init's request
def test_request_reads_arguments_then_environment(monkeypatch):
    for var in ("ZBCCL_DEVICE", "ZBCCL_CUDA_HEAP_SIZE", "ZBCCL_CUDA_HEAP_MAX"):
        monkeypatch.delenv(var, raising=False)
    assert device_heap.request(None, None, None) is None  # default: no CUDA heap
    assert device_heap.request("cpu", None, None) is None
    # growth by default, up to the device's memory (auto: resolved at init), as the CPU heap's
    assert device_heap.request("cuda", None, None) == device_heap.Request("cuda", 256 << 20, None)
    assert device_heap.request("cuda:0", "1G", "4G") == device_heap.Request("cuda", 1 << 30, 4 << 30)
    assert device_heap.request(None, "64M", 0) == device_heap.Request("cuda", 64 << 20, 64 << 20)  # size implies cuda
    assert device_heap.request("cuda", "64M", "auto").max is None
    monkeypatch.setenv("ZBCCL_DEVICE", "cuda")
    monkeypatch.setenv("ZBCCL_CUDA_HEAP_SIZE", "32M")
    monkeypatch.setenv("ZBCCL_CUDA_HEAP_MAX", "0")
    assert device_heap.request(None, None, None) == device_heap.Request("cuda", 32 << 20, 32 << 20)
    assert device_heap.request("cpu", None, None) is None  # the argument wins


@pytest.mark.parametrize("args, match", [
    (("cuda", "1K", None), "cuda_heap_size too small, expected >= 4096 bytes, got 1024"),
    (("cuda", "lots", None), "bad cuda_heap_size"),
    (("cuda", "64M", "32M"), "cuda_heap_max below cuda_heap_size, expected 0 .* got 33554432"),
    (("cuda", "64M", "much"), "bad cuda_heap_max"),
    (("npu", None, None), "bad device|no heap for device"),
    (("meta", None, None), "no heap for device meta, expected 'cpu' or 'cuda'"),
])
def test_request_refuses_bad_values(monkeypatch, args, match):
    monkeypatch.delenv("ZBCCL_CUDA_HEAP_MAX", raising=False)
    with pytest.raises(ZbcclInvalidUsageError, match=match):
        device_heap.request(*args)


def test_hello_field_and_agreement():
    assert device_heap.parse_hello(None) is None
    assert device_heap.parse_hello([8192, None]) == [8192, None]
    for bad in ([1, None], "x", [8192], [8192, 1]):
        with pytest.raises((ValueError, TypeError)):
            device_heap.parse_hello(bad)
    assert device_heap.check_agreement([None, None], [0, 1]) is False
    assert device_heap.check_agreement([[8192, None]] * 2, [0, 1]) is True
    with pytest.raises(ZbcclInvalidUsageError, match=r"got ranks \[5\] asking and \[7\] not"):
        device_heap.check_agreement([[8192, None], None], [5, 7])


# ---------------------------------------------------------------- the MemPool allocator callbacks
BASE = 0x7F00_0000_0000  # where the heap would be mapped (never dereferenced: the callbacks only do arithmetic)


class _Fallback:
    def __init__(self):
        self.next, self.live = 0x1000_0000, {}

    def alloc(self, size):
        ptr, self.next = self.next, self.next + size
        self.live[ptr] = size
        return ptr

    def free(self, ptr):
        del self.live[ptr]


def _c(pair):
    """The two callbacks as torch holds them: bare C function pointers."""
    c_alloc, c_free = pair
    alloc = cuda_scope.ALLOC_FN(ctypes.cast(c_alloc, ctypes.c_void_p).value)
    free = cuda_scope.FREE_FN(ctypes.cast(c_free, ctypes.c_void_p).value)
    return alloc, free


@pytest.fixture
def pool():
    sma = CachingAllocator(8 << 20, alignment=512)
    fb = _Fallback()
    p = cuda_scope._Pool(sma, BASE, 0)
    alloc, free = _c(cuda_scope.callbacks(p, fallback_alloc=fb.alloc, fallback_free=fb.free))
    return p, sma, fb, alloc, free


def test_segments_come_from_the_sma_and_go_back(pool):
    p, sma, fb, alloc, free = pool
    a = alloc(2 << 20, 0, None)
    b = alloc(4 << 20, 0, None)
    assert BASE <= a < BASE + (8 << 20) and BASE <= b < BASE + (8 << 20) and abs(a - b) >= 2 << 20
    assert sma.owns(a - BASE) and sma.owns(b - BASE) and sma.stats()["active_blocks"] == 2
    assert cuda_scope.POOL_COUNTERS == tuple(p.counts)
    free(a, 2 << 20, 0, None)
    free(b, 4 << 20, 0, None)
    assert sma.stats()["active_blocks"] == 0
    assert p.counts["segments"] == 2 and p.counts["segment_bytes"] == 6 << 20 and not p.live and not fb.live


def test_full_heap_falls_back_unless_strict(pool):
    p, sma, fb, alloc, free = pool
    big = alloc(8 << 20, 0, None)  # the whole heap
    assert sma.owns(big - BASE) and sma.stats()["free_bytes"] == 0
    over = alloc(2 << 20, 0, None)  # non-strict: ordinary device memory, counted
    assert over in fb.live and sma.stats()["fallback_allocs"] == 1 and sma.stats()["fallback_bytes"] == 2 << 20
    cuda_scope._strict.stack = [[True]]
    try:
        assert alloc(2 << 20, 0, None) is None  # strict: NULL, torch raises its OOM error
    finally:
        cuda_scope._strict.stack = []
    assert p.counts["refused"] == 1 and p.counts["fallback_segments"] == 1
    free(over, 2 << 20, 0, None)
    assert not fb.live and sma.stats()["active_blocks"] == 1  # a fallback free never reaches the SMA
    free(big, 8 << 20, 0, None)
    assert sma.stats()["active_blocks"] == 0


def test_other_devices_and_retired_pools_get_ordinary_memory(pool):
    p, sma, fb, alloc, free = pool
    other = alloc(1 << 20, 1, None)  # the heap lives on device 0: device 1's request is ordinary memory
    assert other in fb.live and sma.stats()["active_blocks"] == 0
    a = alloc(1 << 20, 0, None)
    p.retired = True  # finalize: later frees of heap segments are dropped (the heap may be gone) ...
    late = alloc(1 << 20, 0, None)  # ... and a scope still open gets ordinary memory
    assert late in fb.live and sma.stats()["fallback_allocs"] == 0  # not the closed heap's fallback
    free(a, 1 << 20, 0, None)
    free(late, 1 << 20, 0, None)
    free(other, 1 << 20, 0, None)
    assert sma.stats()["active_blocks"] == 1 and not fb.live and p.counts["fallback_segments"] == 2
    free(0, 0, 0, None)  # torch may free NULL: nothing happens


def test_a_failing_sma_is_out_of_memory_not_a_crash(pool, caplog):
    p, sma, fb, alloc, free = pool

    def boom(*a, **k):
        raise RuntimeError("boom")

    p.sma = type("S", (), {"try_malloc": boom, "free": boom})()
    assert alloc(4096, 0, None) is None
    assert "treating it as out of memory" in caplog.text


def test_strict_flags_are_per_thread():
    cuda_scope._strict.stack = [[True]]
    seen = []
    t = threading.Thread(target=lambda: seen.append(cuda_scope._thread_strict()))
    t.start()
    t.join()
    try:
        assert seen == [False] and cuda_scope._thread_strict() is True
    finally:
        cuda_scope._strict.stack = []


def test_pool_stats_are_zero_before_any_scope():
    assert cuda_scope.pool_stats(object()) == dict.fromkeys(cuda_scope.POOL_COUNTERS, 0)


def test_heap_scope_device_argument_is_checked():
    import zbccl

    with pytest.raises(ZbcclInvalidUsageError, match="heap_scope: bad device, expected None .* got 'gpu'"):
        zbccl.heap_scope(device="gpu")


def test_signal_pad_holds_the_kernel_area_and_the_host_lines():
    from zbccl.heap import layout
    from zbccl.heap.transports.cuda.transport import CudaTransport, signal_pad_bytes

    for world in (1, 2, 4, layout.KMAX_WORLD, layout.KMAX_WORLD + 1, 64):  # beyond KMAX_WORLD: no kernels, still a pad
        pad = signal_pad_bytes(world)
        assert pad >= layout.kernel_pad_bytes(min(world, layout.KMAX_WORLD)) and pad >= layout.COMM_BYTES
        assert pad >= layout.slot_line(1, 13) + 8  # the conformance suite's lines
        # the kernels' area follows the host lines: a host signal never lands in a kernel slot
        assert CudaTransport.KERNEL_LINE == layout.KERNEL_AREA >= layout.slot_line(layout.MAX_COMMS - 1, 127) + 64
        assert pad == CudaTransport.KERNEL_LINE + layout.kernel_pad_bytes(min(world, layout.KMAX_WORLD))


def test_heap_handles_name_their_heap_and_pickle():
    import pickle

    from zbccl.heap.views import HeapHandle

    h = HeapHandle(rank=1, offset=512, shape=(2, 3), stride=(3, 1), dtype="bfloat16", device="cuda")
    assert pickle.loads(pickle.dumps(h)) == h and h.span_bytes() == 12
    assert HeapHandle(rank=0, offset=0, shape=(1,), stride=(1,), dtype="int8").device == "cpu"  # old handles


def test_signals_fall_back_to_a_fill_where_stream_writes_are_unsupported(monkeypatch):
    """cuStreamWriteValue64 refused (CUDA_ERROR_NOT_SUPPORTED): the store becomes a one-element fill, once
    and for all; any other CUDA error is raised. (Device memory and streams are host stand-ins here.)"""
    import contextlib

    import torch

    from zbccl.errors import ZbcclSystemError
    from zbccl.heap.transports.cuda import words
    from zbccl.heap.transports.shm.mapping import tensor_at

    calls = []

    def refuse(stream, addr, value):
        calls.append(value)
        raise ZbcclSystemError("heap: cuStreamWriteValue64 failed, expected CUDA_SUCCESS, got CUDA_ERROR_NOT_SUPPORTED")

    monkeypatch.setattr(words.vmm, "write_value64", refuse)
    monkeypatch.setattr(words.vmm, "stream_sync", lambda s: None)
    monkeypatch.setattr(words, "device_tensor", lambda addr, n, device, release=None: tensor_at(addr, n, release))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    stream = type("S", (), {"cuda_stream": 0})()
    dw = words.DeviceWords(torch.device("cpu"), stream, contextlib.nullcontext)
    cell = torch.zeros(2, dtype=torch.int64)
    dw.signal(cell.data_ptr(), 7)
    dw.signal(cell.data_ptr() + 8, 9)
    assert cell.tolist() == [7, 9] and calls == [7]  # asked once, then the fill for good

    def broken(stream, addr, value):
        raise ZbcclSystemError("heap: cuStreamWriteValue64 failed, expected CUDA_SUCCESS, got CUDA_ERROR_INVALID_VALUE")

    monkeypatch.setattr(words.vmm, "write_value64", broken)
    dw2 = words.DeviceWords(torch.device("cpu"), stream, contextlib.nullcontext)
    with pytest.raises(ZbcclSystemError, match="CUDA_ERROR_INVALID_VALUE"):
        dw2.signal(cell.data_ptr(), 1)


def test_scopes_route_through_use_mem_pool_and_close_in_any_order(monkeypatch):
    """enter/exit_scope drive torch's use_mem_pool (a stand-in here: torch without CUDA has none) and keep
    this thread's strictness right when scopes close out of order."""
    import contextlib

    log = []

    @contextlib.contextmanager
    def use_mem_pool(pool, device=None):
        log.append(("enter", pool, str(device)))
        yield
        log.append(("exit", pool))

    p = cuda_scope._Pool(CachingAllocator(1 << 20, alignment=512), BASE, 0, pool="the-pool")
    monkeypatch.setattr(cuda_scope, "_pool_of", lambda dh: p)
    monkeypatch.setattr(cuda_scope, "_torch_pool_api", lambda: (None, use_mem_pool, None))
    strict = cuda_scope.enter(object(), True)
    lax = cuda_scope.enter(object(), False)
    assert cuda_scope._thread_strict() is False  # the innermost scope decides
    cuda_scope.exit_scope(strict)  # the outer one closes first
    assert cuda_scope._thread_strict() is False
    cuda_scope.exit_scope(lax)
    assert cuda_scope._thread_strict() is False and cuda_scope._strict.stack == []
    assert log == [("enter", "the-pool", "cuda:0"), ("enter", "the-pool", "cuda:0"), ("exit", "the-pool"),
                   ("exit", "the-pool")]
    only = cuda_scope.enter(object(), True)
    assert cuda_scope._thread_strict() is True
    cuda_scope.exit_scope(only)


def test_a_torch_without_cuda_pools_is_a_clear_error(monkeypatch):
    import torch

    monkeypatch.delattr(torch._C, "_cuda_customAllocator", raising=False)
    with pytest.raises(Exception, match=r"heap_scope: CUDA allocations cannot be routed to the heap, expected "
                                        r"torch >= 2.6 built with CUDA.*_cuda_customAllocator"):
        cuda_scope._torch_pool_api()
