"""Routing of the public ops by device, at world size 2, on a machine without a GPU.

CUDA cannot run here, so the routing's device side is a recording stand-in registered for torch's
``meta`` device (tensors with shapes and no memory): the test checks which device-ops method each public
op and each process-group method reaches with which arguments, that CPU tensors never reach it (and
still give the reference result), and the errors (mixed devices, a per-op timeout, non-contiguous
operands, no heap on the device, a first use inside a capture is covered in tests/gpu). The kernels
themselves are checked under the Triton interpreter (tests/multiproc/test_triton_*.py) and on a GPU
(tests/gpu/).
"""

from __future__ import annotations

import pytest
import torch

from tests.spawn import run_world


class RecordingOps:
    """Records each call (method name and a description of its arguments) instead of launching kernels."""

    def __init__(self, comm) -> None:
        self.rank, self.calls, self.closed, self.checks = comm.rank, [], False, 0

    def _rec(self, name, *args, **kw):
        desc = [tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args]
        self.calls.append((name, *desc, *sorted(kw.items())))

    def all_reduce(self, t, op="sum", **kw):
        self._rec("all_reduce", t, op, **kw)

    def all_gather(self, out, inp, *, dim=0):
        self._rec("all_gather", out, inp, dim=dim)

    def all_gather_v(self, out, inp, sizes, *, dim=0):
        self._rec("all_gather_v", out, inp, sizes, dim=dim)

    def reduce_scatter(self, out, inp, op="sum", *, dim=0):
        self._rec("reduce_scatter", out, inp, op, dim=dim)

    def reduce_scatter_v(self, out, inp, sizes, op="sum", *, dim=0):
        self._rec("reduce_scatter_v", out, inp, sizes, op, dim=dim)

    def all_to_all(self, out, inp):
        self._rec("all_to_all", out, inp)

    def all_to_all_v(self, out, inp, out_splits, in_splits):
        self._rec("all_to_all_v", out, inp, out_splits, in_splits)

    def broadcast(self, t, src):
        self._rec("broadcast", t, src)

    def barrier(self):
        self._rec("barrier")

    def check(self):
        self.checks += 1

    def close(self):
        self.closed = True


def _errors(fn) -> str:
    import zbccl

    try:
        fn()
    except zbccl.ZbcclInvalidUsageError as exc:
        return str(exc)
    return "no error"


def _rank(ctx):
    import torch.distributed as dist

    import zbccl
    from zbccl.ops import route

    route._FAKE_DEVICES.add("meta")
    made = []
    route._factories["meta"] = lambda comm: made.append(RecordingOps(comm)) or made[-1]
    comm = ctx.init(heap_size="4M")
    W, r = ctx.world_size, ctx.rank
    m = lambda *shape: torch.empty(*shape, device="meta")  # noqa: E731

    # CPU tensors: today's path, the reference result, the device side untouched.
    x = zbccl.empty(6)
    x.copy_(torch.arange(6.0) * (r + 1))
    zbccl.all_reduce(x)
    cpu_ok = torch.equal(x, torch.arange(6.0) * sum(q + 1 for q in range(W)))
    out: dict = {"cpu_ok": cpu_ok, "made_after_cpu": len(made)}

    # Every public op with device tensors reaches its device-ops method, with its arguments.
    zbccl.all_reduce(m(5), "max")
    zbccl.all_gather_into_tensor(m(2 * W, 3), m(2, 3))
    zbccl.all_gather_into_tensor(m(2, 3 * W), m(2, 3), dim=1)
    zbccl.all_gather_v(m(1 + 2, 4), m(1 + r, 4), [1, 2])
    zbccl.reduce_scatter_tensor(m(3), m(3 * W), "avg")
    zbccl.reduce_scatter_v(m(1 + r, 2), m(3, 2), [1, 2], "sum")
    zbccl.all_to_all_single(m(2 * W), m(2 * W))
    zbccl.all_to_all_single(m(3), m(3), [1, 2], [2, 1])
    zbccl.broadcast(m(7), 1)
    zbccl.barrier(device="meta")
    ops = made[0]
    out["calls"] = list(ops.calls)
    out["same_ops"] = comm.device_ops("meta") is ops and len(made) == 1

    # torch.distributed's spellings reach the same methods (sync and async_op=True).
    dist.init_process_group("zbccl", store=ctx.store(), rank=r, world_size=W)
    ops.calls.clear()
    dist.all_reduce(m(4))
    work = dist.all_reduce(m(4), op=dist.ReduceOp.MIN, async_op=True)
    work.wait()
    dist.all_gather_into_tensor(m(2 * W), m(2))
    dist.reduce_scatter_tensor(m(2), m(2 * W))
    dist.all_to_all_single(m(2 * W), m(2 * W))
    dist.broadcast(m(3), src=0)
    out["pg_calls"] = list(ops.calls)

    # An operand on the device with another elsewhere: the device ops get it (their checks report it on
    # every rank); a per-op timeout and a missing heap are refused here, before anything is enqueued.
    ops.calls.clear()
    zbccl.all_gather_into_tensor(torch.empty(2 * W), m(2))
    zbccl.all_gather_v(m(3, 4), torch.empty(1 + r, 4), ["x", 2])  # the device ops check the sizes too
    out["mixed_calls"] = list(ops.calls)
    ops.calls.clear()
    out["timeout"] = _errors(lambda: zbccl.all_reduce(m(4), timeout=5))
    out["no_heap"] = _errors(lambda: comm.device_ops("cuda"))
    out["no_heap_op"] = _errors(lambda: route.lane(comm, "cuda", "all_reduce"))
    out["calls_after_errors"] = list(ops.calls)

    # A sub-group gets its own device ops; destroy closes them.
    g = comm.new_group(list(range(W)))
    zbccl.all_reduce(m(2), comm=g)
    sub_ops = made[-1]
    g.destroy()
    out["sub"] = (len(made), sub_ops is not ops, sub_ops.calls, sub_ops.closed, ops.closed)
    dist.destroy_process_group()  # the group adopted zbccl.init's world: it does not finalize it
    out["open_after_destroy"] = not ops.closed
    zbccl.finalize()
    out["closed_at_finalize"] = ops.closed
    return out


def test_device_tensors_reach_the_device_ops_and_cpu_tensors_do_not():
    W = 2
    for r, got in enumerate(run_world(_rank, W, timeout=100)):
        assert got["cpu_ok"] and got["made_after_cpu"] == 0
        assert got["calls"] == [
            ("all_reduce", (5,), "max"),
            ("all_gather", (2 * W, 3), (2, 3), ("dim", 0)),
            ("all_gather", (2, 3 * W), (2, 3), ("dim", 1)),
            ("all_gather_v", (3, 4), (1 + r, 4), [1, 2], ("dim", 0)),
            ("reduce_scatter", (3,), (3 * W,), "avg", ("dim", 0)),
            ("reduce_scatter_v", (1 + r, 2), (3, 2), [1, 2], "sum", ("dim", 0)),
            ("all_to_all", (2 * W,), (2 * W,)),
            ("all_to_all_v", (3,), (3,), [1, 2], [2, 1]),
            ("broadcast", (7,), 1),
            ("barrier",),
        ]
        assert got["same_ops"]
        assert got["pg_calls"] == [
            ("all_reduce", (4,), "sum"),
            ("all_reduce", (4,), "min"),
            ("all_gather", (2 * W,), (2,), ("dim", 0)),
            ("reduce_scatter", (2,), (2 * W,), "sum", ("dim", 0)),
            ("all_to_all", (2 * W,), (2 * W,)),
            ("broadcast", (3,), 0),
        ]
        assert got["mixed_calls"] == [("all_gather", (2 * W,), (2,), ("dim", 0)),
                                      ("all_gather_v", (3, 4), (1 + r, 4), ["x", 2], ("dim", 0))]
        assert "all_reduce: a per-op timeout is not supported for device tensors" in got["timeout"]
        assert "device_ops: no cuda heap in this job, expected one built at init (init(device='cuda') or " \
            "ZBCCL_DEVICE=cuda)" in got["no_heap"]
        assert "all_reduce: no cuda heap in this job" in got["no_heap_op"]
        assert got["calls_after_errors"] == []
        n, distinct, sub_calls, sub_closed, world_closed = got["sub"]
        assert n == 2 and distinct and sub_calls == [("all_reduce", (2,), "sum")] and sub_closed and not world_closed
        assert got["open_after_destroy"] and got["closed_at_finalize"]


def test_device_of_decides_by_the_operands():
    from zbccl.ops.route import device_of

    assert device_of("op", torch.ones(2), torch.ones(3)) is None  # CPU: the CPU checks' verdict stands
    assert device_of("op", "not a tensor", torch.ones(2)) is None
    # another device (no fake registered): the CPU checks refuse it on every rank (test_op_errors.py)
    assert device_of("op", torch.empty(2, device="meta")) is None


def test_single_rank_device_ops_need_no_heap(monkeypatch):
    """World size 1: the null backend's copies on the device tensors, no device ops made."""
    import zbccl
    from zbccl.ops import route

    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(route, "_FAKE_DEVICES", {"meta"})
    monkeypatch.setitem(route._factories, "meta", lambda comm: pytest.fail("no device ops at world size 1"))
    comm = zbccl.init(heap_size="2M")
    try:
        t = torch.empty(3, device="meta")
        assert zbccl.all_reduce(t) is t
        out = torch.empty(3, device="meta")
        assert zbccl.all_gather_into_tensor(out, t) is out
        assert zbccl.broadcast(t, 0) is t
        assert not comm.device_state
    finally:
        zbccl.finalize()
