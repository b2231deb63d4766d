"""A repeated device call (``DeviceOps._repeat``): the same call again skips its checks and plan and launches
what it launched before; anything else about it takes the long way, with every check.

On a GPU a direct launch returns the binary and its arguments, and ``launch.fire`` launches them again.
Under the interpreter no launch is direct, so here ``Replaying`` stands in for the launch module: each
launch runs the real kernel and returns its call, and ``fire`` runs that call again. The kernels really
run (two ranks, the shm heap), so a repeat that launched stale arguments gives a wrong result here.
"""

from __future__ import annotations

import pytest
import torch

from tests.multiproc.triton_cases import ENV, device_ops, needs_triton, payload
from tests.spawn import run_world

pytestmark = needs_triton

_LAUNCHERS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")


class Replaying:
    """The launch module, whose launchers return their call and whose ``fire`` runs that call again;
    ``long``/``fired`` count each path, ``refuse``: ``fire`` launches nothing and says so."""

    def __init__(self, real) -> None:
        self.real, self.INTERPRET = real, real.INTERPRET
        self.long, self.fired, self.refuse = 0, 0, False

    def __getattr__(self, name: str):
        fn = getattr(self.real, name)
        if name not in _LAUNCHERS:
            return fn

        def launch(*args, **kwargs):
            self.long += 1
            fn(*args, **kwargs)
            return name, args, kwargs
        return launch

    def fire(self, launched) -> bool:
        if self.refuse:
            return False
        name, args, kwargs = launched
        self.fired += 1
        getattr(self.real, name)(*args, **kwargs)
        return True


def _counts(k: Replaying, fn) -> tuple[int, int]:
    long, fired = k.long, k.fired
    fn()
    return k.long - long, k.fired - fired


def _repeats(ctx):
    import zbccl
    from zbccl import ZbcclInvalidUsageError, ZbcclRemoteError
    from zbccl.ops.reference import all_reduce_ref

    comm, dev = device_ops(ctx)
    W, me = comm.world_size, comm.rank
    k = dev._k = Replaying(dev._k)
    n = 1000

    # in place: the first call the long way, its repeats fired, each with the data of its step
    t = zbccl.empty(n, dtype=torch.float32)
    for i in range(4):
        t.copy_(payload(me, n, torch.float32, salt=i))
        assert _counts(k, lambda: dev.all_reduce(t)) == ((1, 0) if i == 0 else (0, 1)), i
        assert torch.equal(t, all_reduce_ref([payload(r, n, torch.float32, salt=i) for r in range(W)], 0)), i

    # out of place, gather, scatter, exchange, broadcast: each repeat fired, each result exact
    out = torch.empty(n, dtype=torch.float32)
    gathered = torch.empty(W * n, dtype=torch.float32)
    part = torch.empty(n // W, dtype=torch.float32)
    swapped = torch.empty(n, dtype=torch.float32)
    b = zbccl.empty(n, dtype=torch.float32)
    for i in range(3):
        t.copy_(payload(me, n, torch.float32, salt=i))
        b.copy_(payload(me, n, torch.float32, salt=i))
        want = (1, 0) if i == 0 else (0, 1)
        assert _counts(k, lambda: dev.all_reduce(t, "max", out=out)) == want
        assert _counts(k, lambda: dev.all_gather(gathered, t)) == want
        assert _counts(k, lambda: dev.reduce_scatter(part, t)) == want
        assert _counts(k, lambda: dev.all_to_all(swapped, t)) == want
        assert _counts(k, lambda: dev.broadcast(b, 1)) == want
        ins = [payload(r, n, torch.float32, salt=i) for r in range(W)]
        assert torch.equal(out, all_reduce_ref(ins, 2)), i  # 2: max
        assert torch.equal(gathered, torch.cat(ins)), i
        assert torch.equal(part, all_reduce_ref(ins, 0)[me * (n // W):(me + 1) * (n // W)]), i
        rows = n // W
        assert torch.equal(swapped, torch.cat([x[me * rows:(me + 1) * rows] for x in ins])), i
        assert torch.equal(b, ins[1]), i

    # the same address with another shape, dtype, op or algo: the long way (and the right result)
    t.copy_(payload(me, n, torch.float32))
    assert _counts(k, lambda: dev.all_reduce(t.view(10, 100))) == (1, 0)
    assert _counts(k, lambda: dev.all_reduce(t, "min")) == (1, 0)
    assert _counts(k, lambda: dev.all_reduce(t, algo="one_shot")) == (1, 0)
    h = t.view(torch.int32)
    h.copy_(payload(me, n, torch.int32))
    assert _counts(k, lambda: dev.all_reduce(h)) == (1, 0)
    assert torch.equal(h, all_reduce_ref([payload(r, n, torch.int32) for r in range(W)], 0))

    # a freed tensor's address, reused by a new one of the same size: the same call, fired, on the new data
    addr = t.data_ptr()
    t = h = None  # freed (the lambdas above hold the name, not the tensor)
    t2 = zbccl.empty(n, dtype=torch.float32)
    assert t2.data_ptr() == addr, "the heap's cache gives the freed block back"
    t2.copy_(payload(me, n, torch.float32, salt=9))
    assert _counts(k, lambda: dev.all_reduce(t2)) == (0, 1)
    assert torch.equal(t2, all_reduce_ref([payload(r, n, torch.float32, salt=9) for r in range(W)], 0))

    # where fire launches nothing (another device current, a profiler hook): the long way
    k.refuse = True
    assert _counts(k, lambda: dev.all_reduce(t2)) == (1, 0)
    k.refuse = False

    # a wrong call at a repeated call's address: rank 0 passes a strided view of the same first element,
    # rank 1 repeats its call (fired). Rank 0 is refused by its checks, rank 1 hears of it from the kernel.
    wide = zbccl.empty(n, 2, dtype=torch.float32)
    flat = wide.view(-1)[:n]
    dev.all_reduce(flat)
    dev.all_reduce(flat)
    if me == 0:
        with pytest.raises(ZbcclInvalidUsageError, match="contiguous"):
            dev.all_reduce(wide[:, 0])
    else:
        with pytest.raises(ZbcclRemoteError, match="group rank 0"):
            before = k.fired
            try:
                dev.all_reduce(flat)
            finally:
                assert k.fired == before + 1, "rank 1 repeated its call"

    # an unhashable argument: the long way, refused on this rank, reported on the peer
    if me == 0:
        with pytest.raises(ZbcclInvalidUsageError, match="src out of range"):
            dev.broadcast(b, [1])
    else:
        with pytest.raises(ZbcclRemoteError, match="group rank 0"):
            dev.broadcast(b, 1)
    dev.barrier()
    return k.fired


def test_a_repeated_call_launches_again_and_anything_else_is_checked():
    fired = run_world(_repeats, 2, env=ENV, timeout=180)
    assert all(f > 10 for f in fired), fired
