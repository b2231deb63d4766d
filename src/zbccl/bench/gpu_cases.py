"""The per-rank work of the GPU check (``bench/gpu.py``): the ranks' handles and the per-op cases.

Runs inside each spawned rank, all ranks on GPU 0 (``cuda:0``). Every case fills heap tensors with
:func:`payload` (value = f(rank, index, iteration), small integers, exact in every dtype and in every
sum of 4 ranks), runs the op, waits for it on the host with a bound (an event polled with back-off,
never an unbounded synchronize), and compares bit-exactly with a plain-torch reference computed from
every rank's payload. After each case the ranks agree through their gloo group whether any of them
hit a device-side error (a timeout, a lost peer): then the rest of the world's cases are skipped on
every rank, so no rank waits for a peer that stopped.
"""

from __future__ import annotations

import os
import time
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from ..ops.dtypes import DTYPE_CODES

__all__ = ["payload", "reduce_ref", "Rank", "run_case", "diff", "correctness", "a2a_part", "dtype_name"]

DEV = "cuda:0"
FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
#: Every dtype the collectives serve (``ops/dtypes.py``; fp8 is EP's), bool only where nothing is reduced.
MOVE_DTYPES = tuple(DTYPE_CODES)
REDUCE_DTYPES = tuple(d for d in MOVE_DTYPES if d != torch.bool)
ODD_SIZES = (1, 3, 1001, 65537)
#: The dtypes avg/max/min run on (sum runs on every dtype).
OTHER_REDUCE_DTYPES = (torch.float32, torch.bfloat16, torch.int32)


def payload(rank: int, shape, dtype: torch.dtype, *, it: int = 0, device="cpu") -> torch.Tensor:
    """Rank ``rank``'s values: ``(7 i + 13 rank + 5 it) mod 31`` (minus 15 for signed dtypes): every value
    encodes its source, and every sum of up to 4 ranks is exact in every dtype (fp8 and bool included)."""
    n = 1
    for s in shape:
        n *= s
    v = (torch.arange(n, dtype=torch.int64, device=device) * 7 + rank * 13 + it * 5) % 31
    if dtype == torch.bool:
        return (v % 2 == 1).reshape(shape)
    if dtype not in (torch.uint8,):
        v = v - 15
    if dtype == torch.float8_e4m3fn:
        return (v % 17).to(torch.float32).to(dtype).reshape(shape)  # 0..16: exact in e4m3
    return v.to(dtype).reshape(shape)


def reduce_ref(parts: list[torch.Tensor], op: str, dtype: torch.dtype) -> torch.Tensor:
    x = torch.stack([p.to(torch.float64) for p in parts])
    if op == "sum":
        r = x.sum(0)
    elif op == "avg":
        r = x.sum(0) / len(parts)
    elif op == "max":
        r = x.amax(0)
    else:
        r = x.amin(0)
    return r.to(dtype)


class Rank:
    """One rank's handles: its zbccl communicator (CUDA heap), its gloo group, and the agreement step."""

    def __init__(self, rank: int, world_size: int, store, *, heap_bytes: int, timeout: float,
                 device: str = DEV, deadline: float = float("inf")) -> None:
        import zbccl

        from .baselines import silence_deprecations

        silence_deprecations()  # torch 2.13's FutureWarnings for the *_tensor spellings (and funcol's)
        warnings.filterwarnings("ignore", message=r".*all_gather_tensor.*", category=FutureWarning)
        #: Wall-clock time (``time.time()``) after which the ranks agree to run no more cases.
        self.deadline = deadline
        #: ``device="interpret"``: the device path (``ops/route.py`` -> ``DeviceOps`` -> the Triton kernels) under
        #: ``TRITON_INTERPRET=1`` over the shm heap, no GPU: a rehearsal of the GPU cases (see :class:`DeviceRoute`).
        self.interpret = device == "interpret"
        self.device = torch.device("cpu" if self.interpret else device)
        self.rank, self.world = rank, world_size
        dist.init_process_group("gloo", store=dist.PrefixStore("gloo", store), rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout * 3))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            if os.environ.get("CUDA_MPS_PIPE_DIRECTORY"):  # MPS: the ranks' kernels share GPU 0's SMs at once
                from ..ops.device import DeviceOps

                sms = torch.cuda.get_device_properties(self.device).multi_processor_count
                DeviceOps.max_blocks = max(1, min(DeviceOps.max_blocks, sms // world_size))
            self.comm = init_cuda(store, rank, world_size, heap_bytes=heap_bytes, timeout=timeout)
        else:  # the CPU dry run of the cases (tests/multiproc/test_gpu_cases_cpu.py)
            self.comm = zbccl.init(store=dist.PrefixStore("zbccl", store), rank=rank, world_size=world_size,
                                   heap_size=heap_bytes, timeout=timeout)
        self.timeout = timeout
        self.zbccl = DeviceRoute(self.comm) if self.interpret else zbccl
        self.broken: str | None = None

    def empty(self, shape, dtype) -> torch.Tensor:
        return self.zbccl.empty(*shape, dtype=dtype, device=self.device)

    def finish(self) -> None:
        """Wait for the op on the host (bounded) and raise what the kernels reported."""
        from ..adapters.device_work import wait_event

        if self.device.type != "cuda":
            return  # CPU ops complete inside the call
        ev = torch.cuda.Event()
        ev.record()
        ops = self.comm.device_state.get("cuda")
        wait_event(ev, self.timeout + 10, check=getattr(ops, "check", None) or (lambda: None), op="gpu_check")

    def agree(self, failed: str | None) -> str | None:
        """Every rank learns whether any rank broke (device error) or ran out of its time budget: the first
        reason, or None. The ranks stop at the same case, so none waits for a peer that stopped."""
        late = time.time() > self.deadline
        flag = torch.tensor([1 if failed else 0, 1 if late else 0], dtype=torch.int32)
        dist.all_reduce(flag)
        if self.broken is None and flag[0].item():
            self.broken = failed or "a peer hit a device-side error"
        if self.broken is None and flag[1].item():
            self.broken = "skipped: the world's time budget is spent"
        return self.broken

    def close(self) -> None:
        try:
            self.zbccl.finalize()
        finally:
            dist.destroy_process_group()


class DeviceRoute:
    """The public collectives the cases call, sent down the device path as a CUDA tensor is
    (``ops/route.py``: the lane, then the communicator's ``DeviceOps``), but for CPU heap tensors, whose
    DeviceOps run the Triton kernels under ``TRITON_INTERPRET=1`` over the shm heap. Everything else
    (``empty``, ``heap_scope``, ``memory_stats`` ...) is zbccl's. The public functions' own argument handling
    before they route is a few lines (``ops/allreduce.py`` etc.), the same for every device."""

    def __init__(self, comm) -> None:
        import zbccl
        from zbccl.ops import route

        if not os.environ.get("TRITON_INTERPRET"):
            raise RuntimeError("the interpret rehearsal needs TRITON_INTERPRET=1 set before triton is imported")
        self._zb, self._route, self._comm = zbccl, route, comm

        def factory(c):
            from zbccl.ops.device import DeviceOps

            ops = DeviceOps(c.rank, c.ranks, c._ctx.heap.transport, slot=c.slot, timeout_s=c.timeout,
                            barrier=c.barrier)
            ops.gpu_plan = True  # the GPU's launch shapes (grid up to GPU_BLOCKS, 8 KiB tiles), interpreted
            return ops

        route._factories["cpu"] = factory

    def __getattr__(self, name: str):
        return getattr(self._zb, name)

    def all_reduce(self, t, op="sum"):
        return self._route.all_reduce(self._comm, "cpu", t, op, None)

    def reduce_scatter_tensor(self, out, inp, op="sum", *, dim=0):
        return self._route.reduce_scatter(self._comm, "cpu", out, inp, op, dim, None)

    def reduce_scatter_v(self, out, inp, sizes, op="sum", *, dim=0):
        return self._route.reduce_scatter_v(self._comm, "cpu", out, inp, sizes, op, dim, None)

    def all_gather_into_tensor(self, out, inp, *, dim=0):
        return self._route.all_gather(self._comm, "cpu", out, inp, dim, None)

    def all_gather_v(self, out, inp, sizes, *, dim=0):
        return self._route.all_gather_v(self._comm, "cpu", out, inp, sizes, dim, None)

    def all_to_all_single(self, out, inp, out_splits=None, in_splits=None):
        return self._route.all_to_all(self._comm, "cpu", out, inp, out_splits, in_splits, None)

    def broadcast(self, t, src):
        return self._route.broadcast(self._comm, "cpu", t, src, None)

    def barrier(self, device=None):
        return self._route.barrier(self._comm, "cpu", None)


def init_cuda(store, rank: int, world_size: int, *, heap_bytes: int, timeout: float):
    """``zbccl.init`` with a CUDA heap of ``heap_bytes`` (a small CPU heap beside it)."""
    import zbccl

    return zbccl.init(store=dist.PrefixStore("zbccl", store), rank=rank, world_size=world_size, heap_size="8M",
                      device="cuda", cuda_heap_size=heap_bytes, timeout=timeout)


def run_case(rk: Rank, name: str, fn: Callable[[], str | None], results: list) -> None:
    """Run one case (``fn`` returns None when right, else what is wrong) unless the world broke."""
    if rk.broken:
        results.append((name, False, rk.broken if rk.broken.startswith("skipped") else f"skipped: {rk.broken}"))
        return
    device_error = None
    try:
        wrong = fn()
    except Exception as exc:  # noqa: BLE001 - the case fails, the check goes on
        wrong = f"{type(exc).__name__}: {exc}"
        if "Zbccl" not in type(exc).__name__:
            wrong += "\n" + traceback.format_exc(limit=8)
        # Anything but a usage error may have left the peers waiting for this rank (a kernel that failed to
        # compile or launch here, a CUDA error): the world is out of step, so every rank stops here.
        # (The CPU dry run's ops complete in the call, and its captures fail there by design: it goes on.)
        if type(exc).__name__ in ("ZbcclTimeoutError", "ZbcclRemoteError") or (
                type(exc).__name__ != "ZbcclInvalidUsageError" and (rk.device.type == "cuda" or rk.interpret)):
            device_error = f"{name}: {wrong.splitlines()[0]}"
    results.append((name, wrong is None, wrong or ""))
    rk.agree(device_error)


def diff(got: torch.Tensor, want: torch.Tensor) -> str | None:
    got, want = got.cpu(), want.cpu()
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    if got.dtype == torch.float8_e4m3fn:
        got, want = got.view(torch.uint8), want.view(torch.uint8)
    if torch.equal(got, want):
        return None
    bad = (got != want).reshape(-1).nonzero()
    i = int(bad[0])
    return f"{bad.numel()} wrong elements, first at {i}: got {got.reshape(-1)[i].item()}, want {want.reshape(-1)[i].item()}"


#: The dtypes checked first (then the graph cases, then the rest: a world out of time still covered these).
CORE_DTYPES = (torch.float32, torch.bfloat16)


def correctness(rk: Rank, *, quick: bool, core: bool | None = None,
                dtypes: tuple[torch.dtype, ...] | None = None) -> list[tuple[str, bool, str]]:
    """Every op, every dtype it serves, odd sizes, eager: ``[(name, ok, detail)]``. ``core``: True only the
    :data:`CORE_DTYPES` (and the device barrier), False only the others, None all; ``dtypes``: only those
    of the selection."""
    W, r, zb, res = rk.world, rk.rank, rk.zbccl, []
    pick = lambda dts: [d for d in dts if (core is None or (d in CORE_DTYPES) == core)  # noqa: E731
                        and (dtypes is None or d in dtypes)]
    sizes = ODD_SIZES[:3] if quick else ODD_SIZES
    P = lambda q, shape, dt, it=0: payload(q, shape, dt, it=it)  # noqa: E731

    def run(name, op):
        run_case(rk, name, op, res)

    for dt in pick(REDUCE_DTYPES):
        for n in sizes:
            for red in ("sum", "avg", "max", "min") if dt in FLOATS else ("sum", "max", "min"):
                if red != "sum" and (n != sizes[-1] or dt not in OTHER_REDUCE_DTYPES):
                    continue  # every reduce op, on a few dtypes: each (op, dtype) is one more kernel to compile

                def ar(n=n, dt=dt, red=red):
                    t = rk.empty((n,), dt)
                    t.copy_(P(r, (n,), dt))
                    zb.all_reduce(t, red)
                    rk.finish()
                    return diff(t, reduce_ref([P(q, (n,), dt) for q in range(W)], red, dt))

                run(f"all_reduce/{red}/{dtype_name(dt)}/n={n}", ar)
            for n2 in (n,):
                def rs(n=n2, dt=dt):
                    inp, out = rk.empty((W * n,), dt), rk.empty((n,), dt)
                    inp.copy_(P(r, (W * n,), dt))
                    zb.reduce_scatter_tensor(out, inp)
                    rk.finish()
                    full = reduce_ref([P(q, (W * n,), dt) for q in range(W)], "sum", dt)
                    return diff(out, full[r * n:(r + 1) * n])

                run(f"reduce_scatter/{dtype_name(dt)}/n={n2}", rs)

        def rsv(dt=dt):
            sizes_v = [2 + q for q in range(W)]
            inp, out = rk.empty((sum(sizes_v), 3), dt), rk.empty((sizes_v[r], 3), dt)
            inp.copy_(P(r, (sum(sizes_v), 3), dt))
            zb.reduce_scatter_v(out, inp, sizes_v)
            rk.finish()
            full = reduce_ref([P(q, (sum(sizes_v), 3), dt) for q in range(W)], "sum", dt)
            lo = sum(sizes_v[:r])
            return diff(out, full[lo:lo + sizes_v[r]])

        run(f"reduce_scatter_v/{dtype_name(dt)}", rsv)

        def rs_dim(dt=dt):
            inp, out = rk.empty((3, W * 5), dt), rk.empty((3, 5), dt)
            inp.copy_(P(r, (3, W * 5), dt))
            zb.reduce_scatter_tensor(out, inp, dim=1)
            rk.finish()
            full = reduce_ref([P(q, (3, W * 5), dt) for q in range(W)], "sum", dt)
            return diff(out, full[:, r * 5:(r + 1) * 5])

        run(f"reduce_scatter/dim1/{dtype_name(dt)}", rs_dim)
    for dt in pick(MOVE_DTYPES):
        _movement(rk, dt, sizes, res)
    if core is not False and (dtypes is None or torch.float32 in dtypes):
        run("barrier/device", lambda: (zb.barrier(device=rk.device.type), rk.finish())[1])
    return res


def _movement(rk: Rank, dt: torch.dtype, sizes, res: list) -> None:
    """all_gather(v), all_to_all(v) and broadcast of ``dt``."""
    W, r, zb = rk.world, rk.rank, rk.zbccl
    P = lambda q, shape, it=0: payload(q, shape, dt, it=it)  # noqa: E731
    for n in sizes:
        def ag(n=n):
            inp, out = rk.empty((n,), dt), rk.empty((W * n,), dt)
            inp.copy_(P(r, (n,)))
            zb.all_gather_into_tensor(out, inp)
            rk.finish()
            return diff(out, torch.cat([P(q, (n,)) for q in range(W)]))

        run_case(rk, f"all_gather/{dtype_name(dt)}/n={n}", ag, res)

        def a2a(n=n):
            inp, out = rk.empty((W * n,), dt), rk.empty((W * n,), dt)
            inp.copy_(P(r, (W * n,)))
            zb.all_to_all_single(out, inp)
            rk.finish()
            return diff(out, torch.cat([P(q, (W * n,))[r * n:(r + 1) * n] for q in range(W)]))

        run_case(rk, f"all_to_all/{dtype_name(dt)}/n={n}", a2a, res)

        def bc(n=n):
            t = rk.empty((n,), dt)
            t.copy_(P(r, (n,)))
            zb.broadcast(t, W - 1)
            rk.finish()
            return diff(t, P(W - 1, (n,)))

        run_case(rk, f"broadcast/{dtype_name(dt)}/n={n}", bc, res)

    def ag_dim():
        inp, out = rk.empty((3, 5), dt), rk.empty((3, 5 * W), dt)
        inp.copy_(P(r, (3, 5)))
        zb.all_gather_into_tensor(out, inp, dim=1)
        rk.finish()
        return diff(out, torch.cat([P(q, (3, 5)) for q in range(W)], dim=1))

    run_case(rk, f"all_gather/dim1/{dtype_name(dt)}", ag_dim, res)

    def agv():
        rows = [1 + 2 * q for q in range(W)]
        inp, out = rk.empty((rows[r], 3), dt), rk.empty((sum(rows), 3), dt)
        inp.copy_(P(r, (rows[r], 3)))
        zb.all_gather_v(out, inp, rows)
        rk.finish()
        return diff(out, torch.cat([P(q, (rows[q], 3)) for q in range(W)]))

    run_case(rk, f"all_gather_v/{dtype_name(dt)}", agv, res)

    def a2av():
        split = lambda a, b: 1 + (a + 2 * b) % 3  # noqa: E731 - rows rank a sends to rank b
        ins = [split(r, q) for q in range(W)]
        outs = [split(q, r) for q in range(W)]
        inp, out = rk.empty((sum(ins), 2), dt), rk.empty((sum(outs), 2), dt)
        inp.copy_(P(r, (sum(ins), 2)))
        zb.all_to_all_single(out, inp, outs, ins)
        rk.finish()
        want = []
        for q in range(W):
            src = P(q, (sum(split(q, b) for b in range(W)), 2))
            lo = sum(split(q, b) for b in range(r))
            want.append(src[lo:lo + split(q, r)])
        return diff(out, torch.cat(want))

    run_case(rk, f"all_to_all_v/{dtype_name(dt)}", a2av, res)


def a2a_part(src: torch.Tensor, q: int, r: int, W: int, split) -> torch.Tensor:
    """What rank ``r`` receives from rank ``q``'s all_to_all input ``src`` (rank q sends split(q, b) to b)."""
    lo = sum(split(q, b) for b in range(r))
    return src[lo:lo + split(q, r)]


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")
