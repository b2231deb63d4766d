"""The SGLang plugin's routing table against a stand-in ``GroupCoordinator``, two ranks, no SGLang.

Each rank makes a gloo world through the parent's store, applies the plugin's hooks to
:class:`FakeGC` with SGLang's ``HookRegistry`` semantics (AFTER ``__init__``: :func:`group.attach`;
AROUND each of :data:`group.ROUTES`: :func:`group.around`), and builds a routed ``tp`` group and an
unrouted ``world`` group as SGLang's ``GroupCoordinator.__init__`` does (gloo ``cpu_group`` and
``device_group``). Every routed op is compared with a plain-torch reference on payloads that encode
their source (f(rank, index)); the stand-in's own methods raise, so an op that silently kept
SGLang's path fails. Also: the start handshake (one rank cannot start zbccl: both ranks keep SGLang's
path, one warning each) and ``destroy``.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist

from tests.spawn import run_world


class FakeGC:
    """What the plugin reads of SGLang's ``GroupCoordinator``; its own ops are SGLang's gloo path for
    ``all_reduce``/``barrier`` (the unrouted ``world`` group uses them) and raise for the rest."""

    def __init__(self, group_ranks, local_rank, backend, *args, group_name=None, **kwargs):
        self.unique_name = f"{group_name}:0"
        self.rank = dist.get_rank()
        for ranks in group_ranks:
            cpu = dist.new_group(ranks, backend="gloo")
            if self.rank in ranks:
                self.ranks, self.world_size, self.rank_in_group = ranks, len(ranks), ranks.index(self.rank)
                self.cpu_group = self.device_group = cpu
        self.mq_broadcaster = None
        self.destroyed = False

    def all_reduce(self, input_):
        dist.all_reduce(input_, group=self.device_group)
        self.own = getattr(self, "own", 0) + 1
        return input_

    def destroy(self):
        self.destroyed = True


def _own(name):
    def op(self, *args, **kwargs):
        raise AssertionError(f"{name}: SGLang's own path was taken on {self.unique_name}")
    return op


def _apply_hooks():
    """HookRegistry's wrapper semantics (sglang/srt/plugins/hook_registry.py ``_wrap_fn``)."""
    from zbccl.integrations.sglang import group

    for name in group.ROUTES:
        original = FakeGC.__dict__.get(name) or _own(name)
        hook = group.around(name)
        setattr(FakeGC, name, (lambda o, h: lambda *a, **k: h(o, *a, **k))(original, hook))
    init = FakeGC.__init__

    def wrapped(*a, **k):
        result = init(*a, **k)
        group.attach(result, *a, **k)
        return result

    FakeGC.__init__ = wrapped


def f(r, shape, dtype=torch.float32, k=10):
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n, dtype=torch.float32) * k + r).reshape(shape).to(dtype)


def _ops(ctx):
    from zbccl.integrations.sglang import group

    rank = ctx.rank
    dist.init_process_group("gloo", store=dist.PrefixStore("torch/", ctx.store()), rank=rank, world_size=2)
    _apply_hooks()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        world = FakeGC([[0, 1]], rank, "gloo", group_name="world")
        tp = FakeGC([[0, 1]], rank, "gloo", group_name="tp")
        solo = FakeGC([[0], [1]], rank, "gloo", group_name="pp")  # one member: nothing to route
    assert group.group_of(world) is None and group.group_of(solo) is None
    assert group.group_of(tp) is not None and group.running()
    other = 1 - rank
    x = f(rank, (3, 4))
    assert world.all_reduce(x.clone()) is not None and world.own == 1  # unrouted: SGLang's own
    y = f(rank, (3, 4), torch.bfloat16)
    assert tp.all_reduce(y) is y and torch.equal(y, f(0, (3, 4), torch.bfloat16) + f(1, (3, 4), torch.bfloat16))
    for _ in range(3):  # the hot entry's repeated calls on the same tensor
        z = f(rank, (5, 8))
        assert torch.equal(tp.all_reduce(z), f(0, (5, 8)) + f(1, (5, 8)))
    both = lambda shape, dim, dt=torch.float32: torch.cat([f(0, shape, dt), f(1, shape, dt)], dim)  # noqa: E731
    assert torch.equal(tp.all_gather(f(rank, (2, 3), torch.bfloat16)), both((2, 3), -1, torch.bfloat16))
    assert torch.equal(tp.all_gather(f(rank, (2, 3)), dim=0), both((2, 3), 0))
    outs = [torch.empty(4), torch.empty(4)]
    assert tp.all_gather(f(rank, (4,)), output_tensor_list=outs) is None
    assert torch.equal(outs[0], f(0, (4,))) and torch.equal(outs[1], f(1, (4,)))
    out = torch.empty(4, 3)
    tp.all_gather_into_tensor(out, f(rank, (2, 3)))
    assert torch.equal(out, both((2, 3), 0))
    sizes = [2, 3]
    got = tp.all_gatherv(f(rank, (sizes[rank], 5)), sizes=sizes)
    assert isinstance(got, list) and torch.equal(got[0], torch.cat([f(0, (2, 5)), f(1, (3, 5))]))
    got = tp.all_gatherv([f(rank, (2, 2)), f(rank, (2, 1), torch.int32)])
    assert torch.equal(got[1], both((2, 1), 0, torch.int32))
    full = f(0, (4, 6)) + f(1, (4, 6))
    out = torch.empty(2, 6)
    tp.reduce_scatter_tensor(out, f(rank, (4, 6)))
    assert torch.equal(out, full.chunk(2)[rank])
    out = torch.empty(3)
    assert torch.equal(tp.reduce_scatter(out, [f(rank, (3,)), f(rank, (3,), k=7)]),
                       [f(0, (3,)) + f(1, (3,)), f(0, (3,), k=7) + f(1, (3,), k=7)][rank])
    assert torch.equal(tp.reduce_scatterv(f(rank, (4, 6)), sizes=[1, 3]), full.split([1, 3])[rank])
    assert torch.equal(tp.reduce_scatterv(f(rank, (4, 6))), full.chunk(2)[rank])
    out = torch.empty(6)
    tp.all_to_all_single(out, f(rank, (6,)))
    assert torch.equal(out, torch.cat([f(0, (6,))[3 * rank:3 * rank + 3], f(1, (6,))[3 * rank:3 * rank + 3]]))
    got = tp.gather(f(rank, (2, 2)), dst=1, dim=-1)
    assert (got is None) if rank == 0 else torch.equal(got, both((2, 2), -1))
    b = f(rank, (7,))
    assert tp.broadcast(b, src=1) is b and torch.equal(b, f(1, (7,)))
    obj = {"rank": rank, "ids": list(range(rank + 3))}
    assert tp.broadcast_object(obj if rank == 1 else None, src=1) == {"rank": 1, "ids": [0, 1, 2, 3]}
    lst = [obj, "x"] if rank == 0 else [None, None]
    assert tp.broadcast_object_list(lst, src=0) == [{"rank": 0, "ids": [0, 1, 2]}, "x"]
    assert tp.all_gather_object(("r", rank, "y" * (rank * 50))) == [("r", 0, ""), ("r", 1, "y" * 50)]
    d = {"h": f(rank, (2, 8), torch.bfloat16), "e": torch.empty(0, 4), "step": 5 + rank}
    got = tp.broadcast_tensor_dict(d if rank == 0 else None, src=0)
    assert torch.equal(got["h"], f(0, (2, 8), torch.bfloat16)) and got["e"].shape == (0, 4) and got["step"] == 5
    if rank == 0:
        assert tp.send_object({"a": 1}, dst=1) == []
        works = tp.send_object(["later"], dst=1, async_send=True, tag=3)
        for w in works:
            w.work.wait()
        tp.send(f(0, (3, 3)), 1)
        tp.send_tensor_dict({"h": f(0, (2, 8), torch.bfloat16), "n": 9}, 1)
    else:
        assert tp.recv_object(0, tag=3) == ["later"] and tp.recv_object(0) == {"a": 1}  # tags match apart
        assert torch.equal(tp.recv(torch.Size([3, 3]), torch.float32, 0), f(0, (3, 3)))
        got = tp.recv_tensor_dict(0)
        assert torch.equal(got["h"], f(0, (2, 8), torch.bfloat16)) and got["n"] == 9
    # both ranks exchange at once: send then receive, never waiting on each other
    got2 = tp.send_recv_tensor_dict({"t": f(rank, (3,), torch.int64)}, send_dst=other, recv_src=other)
    assert torch.equal(got2["t"], f(other, (3,), torch.int64))
    tp.barrier()
    calls = group.stats()["tp:0"]["calls"]
    assert calls["all_reduce"] == 4 and calls["broadcast_tensor_dict"] == 1 and calls["barrier"] == 1, calls
    tp.destroy()
    assert tp.destroyed and group.group_of(tp) is None and "tp:0" not in group.stats()
    import zbccl

    zbccl.finalize()
    dist.destroy_process_group()
    return True


@pytest.mark.slow
def test_routed_ops_match_references():
    assert run_world(_ops, 2, timeout=240) == [True, True]


def _fallback(ctx):
    from zbccl.integrations.sglang import group

    if ctx.rank == 1:
        os.environ["ZBCCL_HEAP_SIZE"] = "64T"  # more shared memory than any host has: this rank cannot start
    dist.init_process_group("gloo", store=dist.PrefixStore("torch/", ctx.store()), rank=ctx.rank, world_size=2)
    _apply_hooks()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tp = FakeGC([[0, 1]], ctx.rank, "gloo", group_name="tp")
        pp = FakeGC([[0, 1]], ctx.rank, "gloo", group_name="pp")
    ours = [str(w.message) for w in caught if "zbccl" in str(w.message)]
    assert group.group_of(tp) is None and group.group_of(pp) is None and not group.running()
    assert len(ours) == 1 and "falls back to SGLang's own communication" in ours[0], ours
    x = f(ctx.rank, (3, 4))
    assert torch.equal(tp.all_reduce(x), f(0, (3, 4)) + f(1, (3, 4))) and tp.own == 1
    import zbccl.runtime.registry as reg

    assert reg.get_default() is None
    dist.destroy_process_group()
    return ours[0]


@pytest.mark.slow
def test_a_rank_that_cannot_start_zbccl_sends_every_rank_back_to_sglang():
    msgs = run_world(_fallback, 2, timeout=240, env={"ZBCCL_TIMEOUT": "20"})
    assert all("falls back" in m for m in msgs), msgs
