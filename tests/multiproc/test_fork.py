"""Fork after init: the child is disowned (ops, init and the heap refuse; nothing shared is written),
the parent keeps working, a parent's death stays visible, the allocator lock is re-armed.

Payloads encode their source (value = f(rank, index)) and every result is
compared with the plain-torch reference.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from tests.spawn import run_world

MiB = 1 << 20


# ------------------------------------------------------------------ item 3: fork after init
def _in_child(fn) -> dict:
    """Run ``fn()`` in a forked child that exits the normal way (atexit handlers, status 0); its result."""
    import atexit
    import json

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the test's frames
        os.close(r)
        try:
            out = {"ok": fn()}
        except BaseException as exc:  # noqa: BLE001
            out = {"error": f"{type(exc).__name__}: {exc}"}
        try:
            atexit._run_exitfuncs()  # what a normal interpreter exit runs (zbccl's finalize among them)
        except BaseException as exc:  # noqa: BLE001
            out["atexit"] = f"{type(exc).__name__}: {exc}"
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 1 << 16):
        chunks.append(chunk)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return json.loads(b"".join(chunks))


def _fork_after_init(ctx):
    import zbccl
    from zbccl.heap import layout

    comm = ctx.init(heap_size=4 * MiB)
    W, me = comm.world_size, comm.rank
    base, size = comm.heap_base, comm.heap_bytes
    keep = zbccl.empty(3)
    keep.fill_(100 + me)
    t = zbccl.empty(64)
    t.fill_(me + 1)
    zbccl.all_reduce(t)

    def child():
        seen = {}
        for name, fn in [("empty", lambda: zbccl.empty(3)),
                         ("all_reduce", lambda: zbccl.all_reduce(t)),
                         ("all_reduce_comm", lambda: zbccl.all_reduce(t, comm=comm)),
                         ("barrier", lambda: comm.barrier()),
                         ("init", lambda: ctx.init(heap_size=MiB))]:
            try:
                fn()
                seen[name] = "no error"
            except zbccl.ZbcclInvalidUsageError as exc:
                seen[name] = str(exc)
        with zbccl.heap_scope():
            x = torch.empty(4096)
            x.fill_(666)
        seen["scope_in_heap"] = base <= x.data_ptr() < base + size
        seen["liveness_fds"] = [comm.heap.native.liveness_fd(r) for r in range(W) if r != ctx.rank]
        seen["keep"] = keep.tolist()  # inherited heap tensors stay readable
        return seen

    # A scope open across the fork: the child's allocations in it must not come from the heap.
    with zbccl.heap_scope():
        seen = _in_child(child)
    assert "ok" in seen and "atexit" not in seen, seen
    seen = seen["ok"]
    for name in ("empty", "all_reduce", "all_reduce_comm", "barrier", "init"):
        assert "in a forked child" in seen[name], (name, seen[name])
    assert seen["scope_in_heap"] is False
    assert all(fd == -1 for fd in seen["liveness_fds"]), seen["liveness_fds"]
    assert seen["keep"] == [100.0 + me] * 3
    # The parent is intact: its header still says READY (the child's atexit wrote nothing), its
    # blocks are its own, and the group is in step.
    assert comm.heap.header(ctx.rank, layout.H_STATE) == layout.STATE_READY
    assert keep.tolist() == [100.0 + me] * 3
    for k in range(5):
        t.fill_(me + 1 + k)
        zbccl.all_reduce(t)
        assert torch.equal(t, torch.full((64,), float(sum(r + 1 + k for r in range(W)))))
    comm.barrier()
    zbccl.finalize()
    return True


def test_fork_after_init_disowns_the_child_and_keeps_the_parent_intact():
    assert run_world(_fork_after_init, 2, timeout=120) == [True, True]


def _parent_killed_with_a_forked_child(ctx):
    import signal

    import zbccl

    comm = ctx.init(heap_size=2 * MiB, timeout=60)
    zbccl.all_reduce(zbccl.zeros(16))
    store = ctx.store()
    if ctx.rank == 1:
        pid = os.fork()
        if pid == 0:  # the child outlives its parent, holding whatever it inherited, until released
            try:
                ctx.store().wait(["zbccl-test/release"])
            finally:
                os._exit(0)
        store.set("zbccl-test/forked", b"1")
        os.kill(os.getpid(), signal.SIGKILL)
    store.wait(["zbccl-test/forked"])
    t0 = time.monotonic()
    try:
        with pytest.raises(zbccl.ZbcclRemoteError, match="died"):
            for _ in range(100_000):
                comm.barrier()
        took = time.monotonic() - t0
    finally:
        store.set("zbccl-test/release", b"1")
    zbccl.finalize()
    return took


def test_forked_child_does_not_hide_its_parents_death():
    import signal

    took = run_world(_parent_killed_with_a_forked_child, 2, expect_exit={1: -signal.SIGKILL}, timeout=90)[0]
    assert took < 20, f"the death was noticed after {took:.1f}s (timeout 60 s)"


# ------------------------------------------------------------------ item 7: group slots are returned
def _fork_while_allocator_busy(ctx):
    import zbccl

    comm = ctx.init(heap_size=2 * MiB)
    t = zbccl.empty(100)
    held, done = threading.Event(), threading.Event()

    def hold():  # another thread is inside an allocator operation at the moment of the fork
        comm.sma._acquire("test")
        held.set()
        done.wait(60)
        comm.sma._release()

    th = threading.Thread(target=hold, daemon=True)
    th.start()
    assert held.wait(30)

    def child():
        nonlocal t
        del t  # the inherited tensor dies in the child: its finalizer frees into the child's allocator
        import gc

        gc.collect()
        return True

    try:
        seen = _in_child(child)  # would block forever on the lock of a thread that does not exist here
    finally:
        done.set()
        th.join(30)
    assert seen == {"ok": True}, seen
    zbccl.finalize()
    return True


def test_fork_while_another_thread_holds_the_allocator_lock():
    assert run_world(_fork_while_allocator_busy, 1, timeout=60) == [True]
