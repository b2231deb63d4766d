"""Configuration edges (timeouts, cgroup v1/v2 capacity) and the op lock's order, without a world."""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch
import torch.distributed as dist

import zbccl
from zbccl import env
from zbccl.heap.capacity import cgroup_headroom, check_capacity
from zbccl.runtime.oplock import OpLock

GiB = 1 << 30


@pytest.fixture
def no_dist_env(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "ZBCCL_TIMEOUT"):
        monkeypatch.delenv(k, raising=False)


# ---------------------------------------------------------------------------- timeouts
@pytest.mark.parametrize("bad", [0, -1, math.inf, -math.inf, math.nan, "abc"])
def test_parse_seconds_refuses_unbounded_or_empty_timeouts(bad):
    with pytest.raises(ValueError, match="timeout must be"):
        env.parse_seconds(bad)


def test_parse_seconds_accepts_positive_finite():
    assert env.parse_seconds("2.5") == 2.5 and env.parse_seconds(30) == 30.0


@pytest.mark.parametrize("bad", [math.inf, math.nan, 0, -5])
def test_init_refuses_bad_timeout(no_dist_env, bad):
    with pytest.raises(zbccl.ZbcclInvalidUsageError, match=r"init: timeout must be a finite number of seconds > 0"):
        zbccl.init(store=dist.HashStore(), rank=0, world_size=1, heap_size="1M", timeout=bad)
    assert not zbccl.is_initialized()


@pytest.mark.parametrize("bad", ["0", "-3", "nan", "inf", "soon"])
def test_env_timeout_refused_with_its_name(no_dist_env, monkeypatch, bad):
    monkeypatch.setenv("ZBCCL_TIMEOUT", bad)
    with pytest.raises(zbccl.ZbcclInvalidUsageError, match="ZBCCL_TIMEOUT"):
        zbccl.init(store=dist.HashStore(), rank=0, world_size=1, heap_size="1M")
    assert not zbccl.is_initialized()


@pytest.mark.parametrize("bad", ["0", "-1", "nan"])
def test_env_liveness_interval_refused(monkeypatch, bad):
    monkeypatch.setenv("ZBCCL_LIVENESS_INTERVAL", bad)
    with pytest.raises(zbccl.ZbcclInvalidUsageError, match="ZBCCL_LIVENESS_INTERVAL"):
        env.LIVENESS_INTERVAL.get()


def test_op_timeouts_refused(no_dist_env):
    comm = zbccl.init(store=dist.HashStore(), rank=0, world_size=1, heap_size="1M")
    try:
        for bad in (math.nan, math.inf, 0):
            with pytest.raises(zbccl.ZbcclInvalidUsageError, match="barrier: timeout must be"):
                comm.barrier(timeout=bad)
            with pytest.raises(zbccl.ZbcclInvalidUsageError, match="all_gather_object: timeout must be"):
                comm.all_gather_object(1, timeout=bad)
        comm.barrier(timeout=5)
    finally:
        zbccl.finalize()


# ---------------------------------------------------------------------------- cgroups
def _write(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v1_limit_and_usage(tmp_path):
    _write(tmp_path / "self", "5:cpu:/\n4:memory:/job/rank0\n0::/\n")
    _write(tmp_path / "root/memory/job/rank0/memory.limit_in_bytes", str(4 * GiB))
    _write(tmp_path / "root/memory/job/rank0/memory.usage_in_bytes", str(1 * GiB))
    assert cgroup_headroom(str(tmp_path / "root"), str(tmp_path / "self")) == 3 * GiB


def test_cgroup_v1_parent_limit_binds_and_unlimited_is_ignored(tmp_path):
    _write(tmp_path / "self", "4:memory,hugetlb:/job/rank0\n")
    _write(tmp_path / "root/memory/job/rank0/memory.limit_in_bytes", str(0x7FFFFFFFFFFFF000))
    _write(tmp_path / "root/memory/job/rank0/memory.usage_in_bytes", str(GiB))
    _write(tmp_path / "root/memory/job/memory.limit_in_bytes", str(2 * GiB))
    _write(tmp_path / "root/memory/job/memory.usage_in_bytes", str(GiB + 5))
    _write(tmp_path / "root/memory/memory.limit_in_bytes", str(0x7FFFFFFFFFFFF000))
    assert cgroup_headroom(str(tmp_path / "root"), str(tmp_path / "self")) == GiB - 5


def test_cgroup_v1_container_path_not_mounted_uses_the_mount(tmp_path):
    # Without a cgroup namespace the container sees the host's path, but its own cgroup is the mount.
    _write(tmp_path / "self", "4:memory:/docker/abc123\n")
    _write(tmp_path / "root/memory/memory.limit_in_bytes", str(GiB))
    _write(tmp_path / "root/memory/memory.usage_in_bytes", "0")
    assert cgroup_headroom(str(tmp_path / "root"), str(tmp_path / "self")) == GiB


def test_cgroup_v2(tmp_path):
    _write(tmp_path / "self", "0::/user.slice/job\n")
    _write(tmp_path / "root/user.slice/job/memory.max", str(3 * GiB))
    _write(tmp_path / "root/user.slice/job/memory.current", str(GiB))
    _write(tmp_path / "root/user.slice/memory.max", "max")
    assert cgroup_headroom(str(tmp_path / "root"), str(tmp_path / "self")) == 2 * GiB
    _write(tmp_path / "root/user.slice/job/memory.max", "max")
    assert cgroup_headroom(str(tmp_path / "root"), str(tmp_path / "self")) is None


def test_capacity_check_honours_cgroup_v1(tmp_path):
    _write(tmp_path / "self", "4:memory:/job\n")
    _write(tmp_path / "root/memory/job/memory.limit_in_bytes", str(64 << 20))
    _write(tmp_path / "root/memory/job/memory.usage_in_bytes", str(32 << 20))
    kw = {"nranks": 2, "cgroup_root": str(tmp_path / "root"), "self_cgroup": str(tmp_path / "self")}
    check_capacity(16 << 20, **kw)
    with pytest.raises(zbccl.ZbcclOutOfMemoryError, match="left in the cgroup"):
        check_capacity(48 << 20, **kw)


# ---------------------------------------------------------------------------- op lock
def test_op_lock_is_fifo_reentrant_and_times_out():
    lock = OpLock()
    assert lock.acquire(1) and lock.acquire(1)  # reentrant
    order: list[int] = []
    started = []

    def worker(i: int) -> None:
        started.append(i)
        assert lock.acquire(30)
        order.append(i)
        lock.release()

    threads = []
    for i in range(5):
        t = threading.Thread(target=worker, args=(i,))
        t.start()
        threads.append(t)
        deadline = time.monotonic() + 10
        while len(lock.queue) < i + 1:  # each worker queued before the next starts
            assert time.monotonic() < deadline
            time.sleep(0.001)
    assert lock.busy()  # five other threads wait for it
    lock.release()
    assert lock.held_by_me() and order == []  # still held once: nobody got in
    lock.release()
    for t in threads:
        t.join(10)
    assert order == [0, 1, 2, 3, 4]
    assert lock.acquire(1)
    got = []
    t = threading.Thread(target=lambda: got.append(lock.acquire(0.05)))
    t.start()
    t.join(10)
    assert got == [False] and not lock.queue
    stop = threading.Thread(target=lambda: got.append(lock.acquire(30, stop=lambda: True)))
    stop.start()
    stop.join(10)
    assert got == [False, False]
    lock.release()


def test_finalize_keeps_the_heap_mapped_when_an_op_never_leaves(no_dist_env, caplog):
    import os

    from tests.leaks import segments_of

    comm = zbccl.init(store=dist.HashStore(), rank=0, world_size=1, heap_size="1M")
    held, done = threading.Event(), threading.Event()

    def stuck_op():  # stands for an op that never reaches a wait (and so never sees the finalize)
        assert comm._op_lock.acquire(10)
        held.set()
        done.wait(60)
        comm._op_lock.release()

    t = threading.Thread(target=stuck_op, daemon=True)
    t.start()
    assert held.wait(10)
    t0 = time.monotonic()
    with caplog.at_level("WARNING", logger="zbccl"):
        zbccl.finalize()
    took = time.monotonic() - t0
    try:
        assert 1.5 < took < 20, took  # waited its bound (>= 2 s), then gave up
        assert "keeping the heap mapped" in caplog.text
        assert segments_of(os.getpid()), "the heap was unmapped under a running op"
        assert not zbccl.is_initialized()
    finally:
        done.set()
        t.join(10)
        comm._ctx.heap.close(unmap=True)  # what finalize left mapped: no mapping outlives the test
    assert not segments_of(os.getpid())


def test_comm_of_the_wrong_kind_is_refused(no_dist_env):
    comm = zbccl.init(store=dist.HashStore(), rank=0, world_size=1, heap_size="1M")
    try:
        t = zbccl.zeros(4)
        with pytest.raises(zbccl.ZbcclInvalidUsageError, match="all_reduce: comm must be a zbccl Communicator"):
            zbccl.all_reduce(t, comm=object())
        zbccl.all_reduce(t, comm=comm)
        del t  # a live heap tensor keeps the heap mapped past finalize (the leak check would see it)
    finally:
        zbccl.finalize()
    t = torch.zeros(4)
    with pytest.raises(zbccl.ZbcclInvalidUsageError, match="all_reduce: zbccl was finalized"):
        zbccl.all_reduce(t, comm=comm)
    with pytest.raises(zbccl.ZbcclInvalidUsageError, match="barrier: zbccl was finalized"):
        comm.barrier()


class _DeadStore(dist.Store):
    """A store whose server is gone: every call fails the way torch's stores do."""

    def add(self, key, value):
        raise RuntimeError("Connection reset by peer")

    def set(self, key, value):
        raise RuntimeError("Connection reset by peer")


def test_init_on_a_dead_store_is_a_remote_error(no_dist_env):
    with pytest.raises(zbccl.ZbcclRemoteError, match="rendezvous store stopped answering.*Connection reset"):
        zbccl.init(store=_DeadStore(), rank=0, world_size=2, timeout=5)
    assert not zbccl.is_initialized()
