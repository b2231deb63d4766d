"""The cuda transport's protocol on a machine without a GPU, over simulated device memory.

Only the device layer is replaced, in each rank (``_simulate``): VMM chunks become memfds mapped into
reserved host ranges (create, export, import, map, unmap, release keep their meaning), device copies
become host copies, streams and device synchronisation become no-ops, and the transport's device is
the host. Everything else is the real transport: the authenticated multi-descriptor handout,
control blocks and cookies, importing and mapping peers, growth by new chunks that peers fetch on
demand, bounds, signals and waits with liveness, the Triton ``fetch_add`` (under
``TRITON_INTERPRET=1``, on host memory by address), close. The conformance suite's own cases run
over it unchanged. On a GPU, ``tests/transports`` and ``tests/gpu`` run the same code for real.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import mmap
import os
import signal

import pytest
import torch

from tests.spawn import run_world
from tests.transports import test_conformance as conformance

GRAN = 64 << 10  # the simulated allocation granularity: small, so that growth needs new chunks
ENV = {"TRITON_INTERPRET": "1"}

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: tests/transports runs it for real")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FIXED, _MAP_ANON, _PROT_NONE = 0x10, 0x20, 0
_RW = mmap.PROT_READ | mmap.PROT_WRITE


def _mmap(addr, n, prot, flags, fd):
    got = _libc.mmap(addr, n, prot, flags, fd, 0)
    if got in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap")
    return got


def _simulate() -> None:
    """Replace the device layer of the cuda transport in this (rank) process; see the module docstring."""
    from zbccl.heap import flags
    from zbccl.heap.transports.cuda import segments, transport, vmm, words
    from zbccl.heap.transports.shm.mapping import tensor_at

    prims = flags.primitives()

    def create(nbytes, device):
        assert nbytes > 0 and nbytes % GRAN == 0, nbytes
        fd = os.memfd_create("zbccl-sim-chunk", os.MFD_CLOEXEC)
        os.ftruncate(fd, nbytes)
        return fd

    sim = {
        "driver": lambda: None, "ensure_context": lambda device: None,
        "granularity": lambda device, recommended=False: GRAN, "create": create,
        "export_fd": lambda h: os.dup(h), "import_fd": lambda fd: os.dup(fd), "release": os.close,
        "reserve": lambda n, align: _mmap(None, n, _PROT_NONE, mmap.MAP_PRIVATE | _MAP_ANON, -1),
        "free_va": lambda va, n: _libc.munmap(va, n),
        "map_chunk": lambda va, n, h, device: _mmap(va, n, _RW, mmap.MAP_SHARED | _MAP_FIXED, h),
        "unmap": lambda va, n: _mmap(va, n, _PROT_NONE, mmap.MAP_PRIVATE | _MAP_ANON | _MAP_FIXED, -1),
        "write_value64": lambda stream, addr, value: prims.signal(addr, value),
        "copy_dtoh": lambda dst, src, n, stream: ctypes.memmove(dst, src, n),
        "stream_sync": lambda stream: None, "relax_capture_mode": lambda: None,
    }
    for name, fn in sim.items():
        setattr(vmm, name, fn)

    def host_tensor(addr, nbytes, device, release=None):
        return tensor_at(addr, nbytes, release)

    segments.device_tensor = host_tensor
    transport.device_tensor = host_tensor
    words.device_tensor = host_tensor

    class Stream:
        cuda_stream = 0

        def wait_stream(self, other):
            pass

        def synchronize(self):
            pass

    def open_device(self):
        self.index, self.device, self.stream = 0, torch.device("cpu"), Stream()
        self.words = words.DeviceWords(self.device, self.stream, self._on_device)

    transport.CudaTransport._open_device = open_device
    transport.CudaTransport._on_device = lambda self: contextlib.nullcontext()
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.stream = lambda s: contextlib.nullcontext()
    torch.cuda.current_stream = lambda device=None: Stream()
    torch.cuda.is_initialized = lambda: False


def _case(ctx, case, **kwargs):
    _simulate()
    return getattr(conformance, case)(ctx, "cuda", **kwargs)


@pytest.mark.parametrize("case, world, kwargs", [
    ("_views_and_put_get", 2, {}),
    ("_views_and_put_get", 3, {}),
    ("_message_passing", 2, {"iters": 300}),
    ("_timeout_names_late", 3, {}),
    ("_growth", 2, {}),
    ("_bounds", 2, {}),
])
def test_conformance_cases_over_simulated_device_memory(case, world, kwargs):
    assert run_world(_case, world, case=case, env=ENV, timeout=240, **kwargs) == ["ok"] * world


def test_peer_death_over_simulated_device_memory():
    out = run_world(_case, 2, case="_peer_death", env=ENV, timeout=120, expect_exit={1: -signal.SIGKILL})
    assert out[0] == "ok"


def _chunks(ctx):
    """Growth by new chunks (what a GPU's 2 MiB granularity makes rare in the suite), fetched by the peer."""
    _simulate()
    from tests.transports.world import line, open_transport, payload
    from zbccl.heap.transports.cuda import kernels
    from zbccl.heap.transports.cuda.segments import ACKS

    t, boot = open_transport(ctx, "cuda", data=GRAN, reserve=64 * GRAN)
    me, W = ctx.rank, ctx.world_size
    try:
        data, pads = t.pointer_tables(range(W))
        assert data.dtype == torch.int64 and data.shape == (W,) and int(data[me]) == t.native().data_addr(me)
        boot.barrier(timeout=60)
        t.view(me, 0, (512,), torch.int64).copy_(payload(me, 512))
        for step, size in enumerate((3 * GRAN, 10 * GRAN - 4096, 10 * GRAN, 40 * GRAN), 1):
            t.grow(size)  # one more chunk each time, but the third (within the last chunk)
            # grow returned: every peer has mapped it (their mapper threads: this rank's main thread did nothing)
            assert all(t._prims.load_acquire(t._peers[p].ctrl_addr + ACKS + 64 * me) >= size for p in t._peers)
            t.view(me, size - 8 * 512, (512,), torch.int64).copy_(payload(me, 512, step))
            # the store's barrier: nothing in this thread mapped the peers' growth, and all of it is mapped here
            boot.barrier(timeout=60)
            views = {p: (m.published(t._prims), m.mapped) for p, m in t._peers.items()}
            assert all(pub == size and mapped >= size for pub, mapped in views.values()), (step, views)
            t.signal(me, line(step), 1)
            t.wait_until([(p, line(step)) for p in range(W)], 1, timeout=60, op="grown")
            for p in range(W):
                assert t.size(p) == size, (p, t.size(p), size)
                got = torch.frombuffer(bytearray(t.get(p, size - 8 * 512, 8 * 512)), dtype=torch.int64)
                assert torch.equal(got, payload(p, 512, step)), (step, p, got[:4])
            boot.barrier(timeout=60)  # every rank read this step's sizes before anyone grows again
        chunks = [len(t._peers[p].data.chunks) for p in range(W) if p != me]
        assert chunks == [4] * (W - 1), chunks  # the first chunk and three grown ones, imported here
        rows = kernels.gather_rows(data, 512)  # a kernel through the pointer table (interpreter, host memory)
        assert all(torch.equal(rows[p], payload(p, 512)) for p in range(W))
        again = t.pointer_tables(range(W))
        assert again[0] is data and again[1] is pads
        with pytest.raises(Exception, match="expected at most the"):
            t.grow(64 * GRAN + 1)
        boot.barrier(timeout=60)
        return "ok"
    finally:
        t.close(unmap=True)


def test_growth_by_new_chunks_over_simulated_device_memory():
    assert run_world(_chunks, 2, env=ENV, timeout=240) == ["ok"] * 2


def _device_ops(ctx):
    """The device collectives (``zbccl.ops.device``) over this transport's pointer tables and pads: the kernels
    (interpreter) find every rank's data and kernel area where the transport says they are."""
    _simulate()
    from tests.transports.world import open_transport
    from zbccl.ops.device import DeviceOps

    t, boot = open_transport(ctx, "cuda", data=1 << 20)
    me, W = ctx.rank, ctx.world_size
    try:
        dev = DeviceOps(me, range(W), t, slot=0, timeout_s=30, barrier=lambda: boot.barrier(timeout=30))
        vals = [torch.arange(1000, dtype=torch.float32) * (r + 1) + r for r in range(W)]
        x = t.view(me, 4096, (1000,), torch.float32)
        x.copy_(vals[me])
        dev.all_reduce(x, "sum", algo="one_shot")
        assert torch.equal(x, sum(vals[1:], vals[0])), x[:4]
        src = t.view(me, 64 << 10, (333,), torch.int64)
        src.copy_(torch.arange(333) + 1000 * me)
        out = torch.empty(W * 333, dtype=torch.int64)
        dev.all_gather(out, src)
        assert torch.equal(out, torch.cat([torch.arange(333) + 1000 * r for r in range(W)]))
        dev.barrier()
        dev.check()
        boot.barrier(timeout=60)
        return "ok"
    finally:
        t.close(unmap=True)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_device_collectives_over_the_simulated_cuda_transport():
    assert run_world(_device_ops, 2, env=ENV, timeout=300) == ["ok"] * 2


def _grow_mid_op(ctx):
    """``world.grow_during_op`` over simulated device memory: without the growth handshake rank 0's kernel reads
    the unmapped (PROT_NONE) part of the simulated reservation and the rank dies of SIGSEGV."""
    _simulate()
    from tests.transports.world import grow_during_op

    return grow_during_op(ctx, "cuda", data=GRAN, grow_to=16 * GRAN, offset=12 * GRAN)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_a_growth_during_a_peers_op_is_mapped_before_its_kernel_reads_it():
    assert run_world(_grow_mid_op, 2, env=ENV, timeout=300) == ["ok"] * 2


def _grow_together(ctx):
    """Every rank grows several times at once, with no barrier between the steps: each ``grow`` waits for the
    others' mappers while its own mapper serves their growth, so nobody deadlocks and, when all are done, every
    rank has mapped (and reads) every peer's last chunk."""
    _simulate()
    from tests.transports.world import open_transport, payload

    t, boot = open_transport(ctx, "cuda", data=GRAN, reserve=64 * GRAN)
    me = ctx.rank
    sizes = [(2 + 3 * step + me) * GRAN for step in range(5)]  # different steps on every rank
    try:
        boot.barrier(timeout=60)
        for step, size in enumerate(sizes):
            t.grow(size)
            t.view(me, size - 4096, (512,), torch.int64).copy_(payload(me, 512, step))
        boot.barrier(timeout=60)
        for p, mem in t._peers.items():
            last = (2 + 3 * 4 + p) * GRAN
            assert mem.mapped >= last, (p, mem.mapped, last)  # mapped by this rank's mapper, before p's grow returned
            got = torch.frombuffer(bytearray(t.get(p, last - 4096, 4096)), dtype=torch.int64)
            assert torch.equal(got, payload(p, 512, 4)), (p, got[:4])
        boot.barrier(timeout=60)
        return "ok"
    finally:
        t.close(unmap=True)


def test_ranks_growing_at_once_map_each_other():
    assert run_world(_grow_together, 3, env=ENV, timeout=240) == ["ok"] * 3


def _grow_after_a_failed_map(ctx):
    """A peer whose mapping fails makes ``grow`` raise, naming it (not after the timeout); that failure does not
    fail the next attempt, which the peer maps."""
    _simulate()
    from tests.transports.world import open_transport
    from zbccl.errors import ZbcclRemoteError, ZbcclSystemError

    t, boot = open_transport(ctx, "cuda", data=GRAN, reserve=64 * GRAN, timeout=60)
    me = ctx.rank
    try:
        if me == 1:
            real, fails = t._refresh, [1]

            def refresh(rank, mem):
                if fails:
                    fails.pop()
                    raise ZbcclSystemError("heap: cuMemMap failed (simulated)")
                real(rank, mem)

            t._refresh = refresh
        boot.barrier(timeout=60)
        if me == 0:
            with pytest.raises(ZbcclRemoteError, match=r"heap: grow: ranks \[1\] could not map") as info:
                t.grow(4 * GRAN)
            assert info.value.ranks == (1,)
            t.grow(4 * GRAN)  # the same size again: the earlier attempt's failure does not count
            t.grow(6 * GRAN)
        boot.barrier(timeout=60)
        if me == 1:
            assert t._peers[0].mapped >= 6 * GRAN
        return "ok"
    finally:
        t.close(unmap=True)


def test_a_failed_map_names_the_peer_and_the_next_growth_goes_through():
    assert run_world(_grow_after_a_failed_map, 2, env=ENV, timeout=120) == ["ok"] * 2


def _grow_beside_dead_and_closed(ctx):
    """``grow`` waits for every peer's acknowledgement: a closed peer acknowledged everything as it closed (no
    wait for it); a dead one that never mapped makes it raise within a liveness slice, naming it."""
    _simulate()
    import time

    from tests.transports.world import open_transport
    from zbccl.errors import ZbcclRemoteError
    from zbccl.heap.transports.cuda import segments

    t, boot = open_transport(ctx, "cuda", data=GRAN, reserve=64 * GRAN, timeout=60)
    me = ctx.rank
    try:
        if me == 2:
            t.close(unmap=True)  # finalized early: growth elsewhere must not wait for it
        if me == 1:
            t._stopping = True  # a mapper that no longer maps, then the process dies without closing
            t._prims.fetch_add_signal(t._own.ctrl_addr + segments.BELL, 1)
            t._mapper.join(10)
        boot.barrier(timeout=60)
        if me == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        if me == 2:
            return "closed"
        t0 = time.monotonic()
        with pytest.raises(ZbcclRemoteError, match=r"heap: grow: ranks \[1\] died before mapping") as info:
            t.grow(8 * GRAN)
        assert info.value.ranks == (1,) and time.monotonic() - t0 < 30
        return "ok"
    finally:
        t.close(unmap=True)


def test_growth_waits_for_no_closed_peer_and_names_a_dead_one():
    out = run_world(_grow_beside_dead_and_closed, 3, env=ENV, timeout=120, expect_exit={1: -signal.SIGKILL})
    assert out[0] == "ok" and out[2] == "closed"


def _runtime(ctx):
    """The runtime's CUDA heap end to end over simulated device memory: init's agreement and set-up, its own
    SMA, empty/export/peer_tensor, growth through the SMA into new chunks the peers map, stats, finalize."""
    _simulate()
    import zbccl
    from tests.transports.world import payload
    from zbccl.runtime import device_heap

    device_heap._local_setup = lambda rank, asked: (0, asked[1] or 64 << 20)  # no torch.cuda to ask
    comm = ctx.init(heap_size="4M", device="cuda", cuda_heap_size=GRAN, cuda_heap_max=256 * GRAN)
    me, W = ctx.rank, ctx.world_size
    dh = comm.device_heap("cuda")
    transport, heap, sma = dh
    assert transport.name == "cuda" and heap.heap_bytes == GRAN and sma.stats()["heap_bytes"] == GRAN
    small = zbccl.empty(512, dtype=torch.int64, device="cuda")
    small.copy_(payload(me, 512))
    big = zbccl.empty(40 * GRAN // 8, dtype=torch.int64, device="cuda")  # beyond the heap: it grows
    big[-512:].copy_(payload(me, 512, 1))
    assert zbccl.is_heap_tensor(small) and zbccl.is_heap_tensor(big) and not zbccl.is_heap_tensor(torch.ones(2))
    stats = zbccl.memory_stats(device="cuda")
    assert stats["grow_count"] >= 1 and stats["active_blocks"] == 2 and stats["heap_bytes"] >= 40 * GRAN, stats
    assert zbccl.memory_stats()["active_blocks"] == 0  # the CPU heap is another heap
    handles = comm.all_gather_object((zbccl.export(small), zbccl.export(big[-512:])))
    assert all(h.device == "cuda" for pair in handles for h in pair)
    comm.barrier()
    for p in range(W):
        assert torch.equal(comm.peer_tensor(p, handles[p][0]), payload(p, 512))
        assert torch.equal(comm.peer_tensor(p, handles[p][1]), payload(p, 512, 1))  # a grown chunk, mapped here
    del small, big
    comm.barrier()
    zbccl.finalize()
    return transport.segments == {}


def test_runtime_cuda_heap_over_simulated_device_memory():
    assert run_world(_runtime, 3, env=ENV, timeout=240) == [True] * 3


def _failing_setup(ctx):
    """A torch/CUDA error while one rank sets up is heard by every rank at once, naming that rank."""
    _simulate()
    from tests.transports.world import open_transport
    from zbccl.errors import ZbcclError
    from zbccl.heap.transports.cuda import transport

    if ctx.rank == 1:
        def broken(self):
            raise RuntimeError("CUDA error: out of resources (simulated)")

        transport.CudaTransport._open_device = broken
    try:
        open_transport(ctx, "cuda", timeout=60)
    except ZbcclError as exc:
        return type(exc).__name__, exc.ranks, str(exc)
    return "no error", (), ""


def test_a_cuda_error_in_one_ranks_setup_fails_every_rank_at_once():
    out = run_world(_failing_setup, 2, env=ENV, timeout=60)
    assert out[1][0] == "ZbcclSystemError" and out[1][1] == (1,) and "out of resources" in out[1][2], out[1]
    assert out[0][0] == "ZbcclRemoteError" and out[0][1] == (1,) and "out of resources" in out[0][2], out[0]
