"""heap_scope and the native CPU allocator hook, over a fake communicator.

The fake comm is an anonymous mmap plus the real SMA (``CachingAllocator``);
it has the three attributes heap_scope needs: ``sma``, ``heap_base``, ``heap_bytes``.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
import warnings

import pytest
import torch

from zbccl.adapters import scope
from zbccl.adapters.scope import heap_scope, hook_stats, unregister_heap
from zbccl.errors import ZbcclInvalidUsageError
from zbccl.sma import CachingAllocator


class FakeComm:
    def __init__(self, nbytes: int) -> None:
        self.mm = mmap.mmap(-1, nbytes)
        self.heap_base = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))
        self.heap_bytes = nbytes
        self.sma = CachingAllocator(nbytes, alignment=64)

    def holds(self, t: torch.Tensor) -> bool:
        return self.heap_base <= t.data_ptr() < self.heap_base + self.heap_bytes


@pytest.fixture
def comm():
    c = FakeComm(64 << 20)
    yield c
    unregister_heap(c.heap_base)  # the mmap outlives every tensor: tests delete theirs first


def test_ops_inside_scope_land_in_heap(comm: FakeComm) -> None:
    x = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32)  # payload identifies its source
    w = torch.ones(32, 16)
    with heap_scope(comm):
        outs = {"matmul": x @ w, "cat": torch.cat([x, x]), "empty": torch.empty(1000), "clone": x.clone()}
    for name, t in outs.items():
        assert comm.holds(t), name
    assert torch.equal(outs["matmul"], x.sum(1, keepdim=True).expand(64, 16))
    assert torch.equal(outs["cat"][64:], x) and torch.equal(outs["clone"], x)
    after = [x @ w, torch.cat([x, x]), torch.empty(1000), x.clone()]
    assert not any(comm.holds(t) for t in after) and not comm.holds(x)
    del outs, t
    assert hook_stats(comm)["live_blocks"] == 0


def test_other_threads_unaffected(comm: FakeComm) -> None:
    inside = threading.Event()
    done = threading.Event()
    seen: dict[str, bool] = {}

    def other() -> None:
        inside.wait(10)
        seen["during"] = comm.holds(torch.empty(4096))
        with heap_scope(comm):
            seen["own_scope"] = comm.holds(torch.empty(4096))
        done.set()

    t = threading.Thread(target=other)
    t.start()
    with heap_scope(comm):
        inside.set()
        done.wait(10)
        seen["main"] = comm.holds(torch.empty(4096))
    t.join(10)
    assert seen == {"during": False, "own_scope": True, "main": True}


def test_free_returns_memory_and_tier_counts_cached(comm: FakeComm) -> None:
    base = comm.sma.stats()
    with heap_scope(comm):
        ts = [torch.empty(n, dtype=torch.uint8) for n in (100, 5000, 1 << 20, 3 << 20)]
    mid = comm.sma.stats()
    assert mid["allocated_bytes"] >= sum(t.numel() for t in ts) + base["allocated_bytes"]
    del ts
    after, native = comm.sma.stats(), hook_stats(comm)
    assert after["allocated_bytes"] == base["allocated_bytes"] and after["active_blocks"] == 0
    assert native["live_blocks"] == native["live_bytes"] == 0 and native["cached_blocks"] == 4
    assert after["cached_bytes"] == native["cached_bytes"] + base["cached_bytes"] > 0
    with heap_scope(comm):
        again = torch.empty(5000, dtype=torch.uint8)  # a hit: no Python, same class
    assert hook_stats(comm)["hits"] == 1 and comm.holds(again)
    del again
    comm.sma.check()


def test_threads_stress_counters_stay_exact(comm: FakeComm) -> None:
    """Four threads allocate in their own scopes and free each other's tensors."""
    import queue
    import random

    handoff: queue.Queue = queue.Queue()
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            with heap_scope(comm):
                for _ in range(300):
                    t = torch.empty(rng.choice((64, 4096, 70_000, 1 << 20)), dtype=torch.uint8)
                    assert comm.holds(t)
                    handoff.put(t)
                    del t
                    while handoff.qsize() > 8:  # at most ~9 MiB in flight: never full
                        try:
                            handoff.get_nowait()  # dropped here: often another thread's tensor
                        except queue.Empty:
                            break
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    while not handoff.empty():
        handoff.get_nowait()
    assert not errors and not any(th.is_alive() for th in threads)
    s = hook_stats(comm)
    assert s["live_blocks"] == 0 and s["live_bytes"] == 0 and s["fallback_allocs"] == 0
    assert comm.sma.stats()["active_blocks"] == 0
    comm.sma.check()


def test_free_on_another_thread(comm: FakeComm) -> None:
    with heap_scope(comm):
        t = torch.full((1000,), 7.0)
    box = [t]
    del t
    th = threading.Thread(target=box.clear)
    th.start()
    th.join(10)
    s = hook_stats(comm)
    assert s["live_blocks"] == 0 and s["cached_blocks"] == 1


def test_heap_full_non_strict_falls_back(comm: FakeComm) -> None:
    small = FakeComm(1 << 20)
    try:
        with heap_scope(small):
            big = torch.full((1 << 20,), 3.0)  # 4 MiB > heap
            y = big * 2
        assert not small.holds(big) and torch.all(y == 6.0)
        s = hook_stats(small)
        assert s["fallback_allocs"] == 2 and s["fallback_bytes"] == 2 * (4 << 20)
        assert small.sma.stats()["fallback_allocs"] == 2
        del big, y
    finally:
        unregister_heap(small.heap_base)


def test_heap_full_strict_raises(comm: FakeComm) -> None:
    with heap_scope(comm, strict=True):
        ok = torch.empty(1024)
        with pytest.raises(RuntimeError, match=r"heap_scope: heap out of memory \(strict=True\), requested"):
            torch.empty(128 << 20, dtype=torch.uint8)
    assert comm.holds(ok) and hook_stats(comm)["strict_failures"] == 1
    del ok


def test_oom_drains_native_cache(comm: FakeComm) -> None:
    with heap_scope(comm):
        ts = [torch.empty(8 << 20, dtype=torch.uint8) for _ in range(3)]
    del ts
    assert hook_stats(comm)["cached_blocks"] >= 2
    off = comm.sma.malloc(60 << 20)  # needs the blocks the native cache holds
    assert hook_stats(comm)["cached_blocks"] == 0
    comm.sma.free(off)


def test_unregister_then_free_and_allocate(comm: FakeComm) -> None:
    with heap_scope(comm):
        t = torch.ones(1000)
        unregister_heap(comm.heap_base)
        u = torch.ones(1000)  # scope still open on a dead heap: ordinary memory
    assert comm.holds(t) and not comm.holds(u)
    reg = scope._retired[-1]
    del t, u
    assert reg.counters()["dropped_frees"] == 1
    unregister_heap(comm.heap_base)  # idempotent


def test_new_heap_at_old_address_gets_no_old_blocks() -> None:
    old = FakeComm(8 << 20)
    with heap_scope(old):
        t = torch.empty(4096, dtype=torch.uint8)
    new_sma = CachingAllocator(old.heap_bytes, alignment=64)
    old.sma = new_sma  # same address, new SMA: re-registration replaces the old one
    with heap_scope(old):
        u = torch.empty(64, dtype=torch.uint8)
    del t  # the old registration's block must not enter the new cache
    assert hook_stats(old)["cached_blocks"] == 0
    del u
    assert hook_stats(old)["cached_blocks"] == 1
    unregister_heap(old.heap_base)


def test_nesting_reentrance_and_state(comm: FakeComm) -> None:
    lib = scope._hook()
    s = heap_scope(comm)
    outer_state = lib.zbh_scope_state()
    with s:
        with s:
            with heap_scope(comm, strict=True):
                assert lib.zbh_scope_state() & 1 == 1
            assert lib.zbh_scope_state() & 1 == 0
            a = torch.empty(10)
        b = torch.empty(10)
    assert lib.zbh_scope_state() == outer_state
    assert comm.holds(a) and comm.holds(b)
    del a, b


def test_refill_exception_treated_as_full(comm: FakeComm) -> None:
    class Broken(CachingAllocator):
        def try_malloc(self, nbytes, *, kind="explicit"):
            raise RuntimeError("boom")

    bad = FakeComm(4 << 20)
    bad.sma = Broken(bad.heap_bytes, alignment=64)
    try:
        with heap_scope(bad):
            t = torch.ones(100)
        assert not bad.holds(t) and torch.all(t == 1)
        assert hook_stats(bad)["fallback_allocs"] == 1
    finally:
        unregister_heap(bad.heap_base)


def test_resize_and_copy_on_write_clone(comm: FakeComm) -> None:
    with heap_scope(comm):
        t = torch.arange(10.0)
        t.resize_(100_000)  # reallocates through the hook, copies with copy_data
    assert comm.holds(t) and torch.equal(t[:10], torch.arange(10.0))
    # copy-on-write needs context == data pointer, which heap blocks have
    c = t._lazy_clone()
    assert torch._C._is_cow_tensor(c) and torch._C._is_cow_tensor(t)  # shared until written
    c[0] = -1.0
    assert t[0] == 0 and c[0] == -1 and not comm.holds(c)  # materialized outside the scope
    assert torch.equal(c[1:10], torch.arange(1.0, 10.0))
    del c, t
    assert hook_stats(comm)["live_blocks"] == 0


def test_raw_allocate_inside_scope(comm: FakeComm) -> None:
    """torch's raw_allocate (oneDNN scratch, ``to_mkldnn``) asserts context == data."""
    x = torch.arange(4 * 3 * 8 * 8, dtype=torch.float32).reshape(4, 3, 8, 8)
    a = torch.arange(4 * 64 * 64).reshape(4, 64, 64).remainder(7).bfloat16()
    before = hook_stats(comm)["misses"] + hook_stats(comm)["hits"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # bf16 bmm warns and falls back when oneDNN's allocation fails
        with heap_scope(comm):
            back = x.to_mkldnn().to_dense()  # raw_allocate / raw_deallocate through the hook
            prod = a @ a
    assert torch.equal(back, x)
    assert torch.equal(prod.float(), (a.float() @ a.float()).bfloat16().float())
    assert hook_stats(comm)["misses"] + hook_stats(comm)["hits"] > before
    del back, prod
    assert hook_stats(comm)["live_blocks"] == 0  # raw frees found their heap blocks
    # outside a scope the raw API serves and frees ordinary memory as before
    assert torch.equal(x.to_mkldnn().to_dense(), x)


def test_heap_scope_configuration_is_keyword_only(comm: FakeComm) -> None:
    with pytest.raises(TypeError):
        heap_scope(comm, True)  # type: ignore[misc]


def test_default_comm_requires_init() -> None:
    import zbccl

    assert not zbccl.is_initialized()  # every test finalizes (the leak check enforces it)
    with pytest.raises(ZbcclInvalidUsageError):
        with heap_scope():
            pass


def _scoped(scope_obj):
    """A generator holding ``scope_obj`` open from its first ``next`` until it is closed."""
    with scope_obj:
        yield


def test_scopes_exited_out_of_order_restore_what_is_still_open(comm: FakeComm) -> None:
    lib = scope._hook()
    none = lib.zbh_scope_state()
    outer, inner = _scoped(heap_scope(comm, strict=True)), _scoped(heap_scope(comm))
    next(outer)
    next(inner)
    outer.close()  # the outer scope ends first: the inner one is still open and non-strict
    t = torch.empty(1000)
    assert comm.holds(t), "a still-open inner scope stopped placing tensors in the heap"
    assert lib.zbh_scope_state() & 1 == 0, "the closed outer scope's strictness came back"
    inner.close()
    u = torch.empty(1000)
    assert not comm.holds(u), "the thread kept allocating into the heap after every scope closed"
    assert lib.zbh_scope_state() == none
    # ... and in the usual order, through an ExitStack
    import contextlib

    with contextlib.ExitStack() as stack:
        stack.enter_context(heap_scope(comm))
        stack.enter_context(heap_scope(comm, strict=True))
        assert lib.zbh_scope_state() & 1 == 1
    assert lib.zbh_scope_state() == none and not comm.holds(torch.empty(10))
    del t, u


def test_out_of_order_exits_stay_in_their_thread(comm: FakeComm) -> None:
    lib = scope._hook()
    none = lib.zbh_scope_state()
    opened, closed, done = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, object] = {}

    def other() -> None:
        a, b = _scoped(heap_scope(comm)), _scoped(heap_scope(comm, strict=True))
        next(a)
        next(b)
        opened.set()
        closed.wait(10)
        b.close()  # LIFO here, while the main thread closed out of order
        seen["inner_closed"] = comm.holds(torch.empty(100))
        a.close()
        seen["all_closed"] = comm.holds(torch.empty(100))
        seen["state"] = lib.zbh_scope_state()
        done.set()

    t = threading.Thread(target=other)
    t.start()
    opened.wait(10)
    x, y = _scoped(heap_scope(comm)), _scoped(heap_scope(comm))
    next(x)
    next(y)
    x.close()
    assert comm.holds(torch.empty(100))
    closed.set()
    done.wait(10)
    y.close()
    t.join(10)
    assert seen == {"inner_closed": True, "all_closed": False, "state": none}, seen
    assert lib.zbh_scope_state() == none and not comm.holds(torch.empty(100))


def test_a_scope_cannot_be_exited_from_another_thread(comm: FakeComm) -> None:
    s = heap_scope(comm)
    s.__enter__()
    seen: list[BaseException] = []

    def other() -> None:
        try:
            s.__exit__(None, None, None)
        except ZbcclInvalidUsageError as exc:
            seen.append(exc)

    t = threading.Thread(target=other)
    t.start()
    t.join(10)
    assert seen and "did not enter" in str(seen[0])
    assert comm.holds(torch.empty(10))  # still open here
    s.__exit__(None, None, None)
    assert not comm.holds(torch.empty(10))
