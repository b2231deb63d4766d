"""A heap that grows, at world 1 (in-process): zbccl.empty, heap_scope, the max, the issue 7 repro, no leak."""

from __future__ import annotations

import os

import pytest
import torch

import zbccl
from tests import leaks
from zbccl.heap.capacity import auto_heap_max, shm_capacity

MIB = 1 << 20


@pytest.fixture
def no_dist_env(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "ZBCCL_HEAP_MAX"):
        monkeypatch.delenv(k, raising=False)


def test_issue7_doubling_sizes_through_empty(no_dist_env):
    # 192 MiB, no growth: before the placement fix empty(128 MiB) raised at n = 64 MiB with
    # free_bytes=134217728, largest_free_block=68157440 (one live block at offset 65 MiB).
    zbccl.init(heap_size="192M", heap_max=0)
    try:
        n = 4096
        while n <= 64 * MIB:
            del_me = zbccl.empty(n, dtype=torch.uint8)
            del del_me
            a, b = zbccl.empty(n, dtype=torch.uint8), zbccl.empty(2 * n, dtype=torch.uint8)
            del a, b
            n *= 2
        s = zbccl.memory_stats()
        assert (s["oom_count"], s["grow_count"], s["heap_bytes"]) == (0, 0, 192 * MIB)
    finally:
        zbccl.finalize()


def test_empty_grows_the_heap_and_finalize_unmaps_it(no_dist_env):
    comm = zbccl.init(heap_size="4M", heap_max="1G")
    try:
        assert (comm.heap_bytes, comm.heap_max_bytes) == (4 * MIB, 1 << 30)
        first = zbccl.empty(3 * MIB, dtype=torch.uint8)
        t = zbccl.empty(16 * MIB, dtype=torch.uint8)  # does not fit in 4 MiB: the heap grows
        s = zbccl.memory_stats()
        assert s["grow_count"] == 1 and s["heap_bytes"] == 4 * MIB + 64 * MIB and s["heap_max_bytes"] == 1 << 30
        assert comm.heap_bytes == comm.heap_size_of(0) == s["heap_bytes"]
        handle = zbccl.export(t)
        assert handle.offset >= 4 * MIB, "the tensor lives in the grown range"
        assert zbccl.is_heap_tensor(t)
        t.copy_(torch.arange(t.numel(), dtype=torch.int64).to(torch.uint8))
        view = comm.peer_tensor(0, handle)  # bounds-checked against the live size
        assert torch.equal(view, t)
        too_far = zbccl.HeapHandle(rank=0, offset=s["heap_bytes"] - 8, shape=(16,), stride=(1,), dtype="uint8")
        with pytest.raises(zbccl.ZbcclInvalidUsageError, match="out of bounds"):
            comm.peer_tensor(0, too_far)
        del first, t, view
        assert leaks.segments_of(os.getpid())
    finally:
        zbccl.finalize()
    assert not leaks.segments_of(os.getpid()), "a grown heap stays mapped after finalize"


def test_growth_refused_beyond_heap_max(no_dist_env):
    zbccl.init(heap_size="4M", heap_max="16M")
    try:
        keep = zbccl.empty(2 * MIB, dtype=torch.uint8)
        with pytest.raises(zbccl.ZbcclOutOfMemoryError) as info:
            zbccl.empty(15 * MIB, dtype=torch.uint8)
        message = str(info.value)
        for part in ("requested 15728640", "free_bytes=2097152", "heap_max_bytes=16777216", "growth refused"):
            assert part in message, message
        with pytest.raises(zbccl.ZbcclOutOfMemoryError, match="exceeds heap_max_bytes=16777216"):
            zbccl.empty(64 * MIB, dtype=torch.uint8)
        grown = zbccl.empty(12 * MIB, dtype=torch.uint8)  # up to the max it grows (exactly to it)
        assert zbccl.memory_stats()["heap_bytes"] == 16 * MIB
        del keep, grown
    finally:
        zbccl.finalize()


def test_no_growth_with_heap_max_0_and_bad_values(no_dist_env, monkeypatch):
    zbccl.init(heap_size="4M", heap_max=0)
    try:
        assert zbccl.memory_stats()["heap_max_bytes"] == 4 * MIB
        with pytest.raises(zbccl.ZbcclOutOfMemoryError, match="heap_max_bytes=4194304"):
            zbccl.empty(8 * MIB, dtype=torch.uint8)
    finally:
        zbccl.finalize()
    with pytest.raises(zbccl.ZbcclInvalidUsageError, match="heap_max below heap_size"):
        zbccl.init(heap_size="8M", heap_max="4M")
    monkeypatch.setenv("ZBCCL_HEAP_MAX", "plenty")
    with pytest.raises(zbccl.ZbcclInvalidUsageError, match="ZBCCL_HEAP_MAX"):
        zbccl.init(heap_size="8M")
    assert not zbccl.is_initialized()


def test_default_auto_grows(no_dist_env):
    comm = zbccl.init(heap_size="4M")
    try:
        assert comm.heap_max_bytes >= 4 * MIB
        if comm.heap_max_bytes < 4 * MIB + 64 * MIB:
            pytest.skip("this host has too little free shared memory for a growth step")
        t = zbccl.zeros(8 * MIB, dtype=torch.uint8)
        assert zbccl.is_heap_tensor(t) and zbccl.memory_stats()["grow_count"] == 1
        del t
    finally:
        zbccl.finalize()


def test_heap_scope_allocations_grow_the_heap(no_dist_env):
    comm = zbccl.init(heap_size="4M", heap_max="256M")
    try:
        with zbccl.heap_scope(strict=True):
            x = torch.ones(4 * MIB // 4)  # 4 MiB: needs growth; strict, so no fallback allowed
            y = x * 2  # an op output, in the grown heap too
        assert zbccl.is_heap_tensor(x) and zbccl.is_heap_tensor(y)
        assert float(y.sum()) == 2.0 * x.numel()
        s = zbccl.memory_stats()
        assert s["grow_count"] >= 1 and s["fallback_allocs"] == 0 and comm.heap_bytes > 4 * MIB
        del x, y
    finally:
        zbccl.finalize()


def test_auto_heap_max_is_a_share_of_the_tightest_limit(tmp_path, monkeypatch):
    (tmp_path / "self").write_text("0::/job\n")
    (tmp_path / "root/job").mkdir(parents=True)
    (tmp_path / "root/job/memory.max").write_text(str(1 << 30))
    (tmp_path / "root/job/memory.current").write_text(str(200 * MIB))
    kw = {"cgroup_root": str(tmp_path / "root"), "self_cgroup": str(tmp_path / "self")}
    limits = shm_capacity(**kw)
    assert limits["cgroup"] == (1 << 30) - 200 * MIB
    room = min(v for v in limits.values() if v is not None)  # the cgroup, unless this host is tighter
    assert auto_heap_max(4 * MIB, nranks=2, **kw) == max(4 * MIB, room // 2 // (2 * MIB) * (2 * MIB))
    assert auto_heap_max(900 * MIB, nranks=2, **kw) == 900 * MIB, "never below the heap: no growth"
    import resource

    monkeypatch.setattr(resource, "getrlimit", lambda what: (256 * MIB + _vm_bytes(), resource.RLIM_INFINITY))
    assert auto_heap_max(4 * MIB, nranks=2, **kw) <= 64 * MIB, "bounded by ulimit -v (RLIMIT_AS)"


def _vm_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
