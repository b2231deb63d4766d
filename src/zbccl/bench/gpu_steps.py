"""The per-rank steps of the GPU check beyond the per-op cases (``bench/gpu.py``): graph capture and
replay of every op, a decode step captured once and replayed many times, the same step under
``heap_scope`` (zero staging), torch.distributed on a ``zbccl`` group (Work objects over CUDA events),
and :func:`cases_rank`, one rank of a cases world. Same conventions as :mod:`.gpu_cases`: payloads
``f(rank, index, iteration)``, bounded waits, bit-exact comparisons against plain torch, the ranks
agreeing after each case.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from .gpu_cases import DEV, Rank, a2a_part, correctness, diff, payload, reduce_ref, run_case
from .gpu_ep import ep_cases

__all__ = ["graph_cases", "decode_step", "scope_step", "pg_cases", "cases_rank"]


def graph_cases(rk: Rank, *, replays: int = 3) -> list[tuple[str, bool, str]]:
    """Every op captured in a CUDA graph after one eager warm-up, then replayed ``replays`` times on new
    payloads (copied into the captured tensors before each replay), each replay bit-exact."""
    W, r, zb, res = rk.world, rk.rank, rk.zbccl, []
    dt, n = torch.bfloat16, 1001
    P = lambda q, shape, it, d=dt: payload(q, shape, d, it=it)  # noqa: E731
    rows = [97 + 2 * q for q in range(W)]
    split = lambda a, b: 50 + (a + 2 * b) % 3  # noqa: E731 - elements rank a sends to rank b
    # a captured op's sizes must be in device memory (a replay reads them there): int64 [W] tensors
    sizes_t = lambda v: torch.tensor(v, dtype=torch.int64, device=rk.device)  # noqa: E731
    # (the interpret rehearsal passes them as tensors too: the same path; its "replays" run eagerly)
    tens = rk.device.type == "cuda" or rk.interpret
    rows_t = sizes_t(rows) if tens else rows
    out_t = sizes_t([split(q, r) for q in range(W)]) if tens else [split(q, r) for q in range(W)]
    in_t = sizes_t([split(r, q) for q in range(W)]) if tens else [split(r, q) for q in range(W)]
    cases = {
        "all_reduce": ((n,), (n,), lambda o, i: zb.all_reduce(i),
                       lambda it: reduce_ref([P(q, (n,), it) for q in range(W)], "sum", dt), True),
        "all_gather": ((W * n,), (n,), lambda o, i: zb.all_gather_into_tensor(o, i),
                       lambda it: torch.cat([P(q, (n,), it) for q in range(W)]), False),
        "reduce_scatter": ((n,), (W * n,), lambda o, i: zb.reduce_scatter_tensor(o, i),
                           lambda it: reduce_ref([P(q, (W * n,), it) for q in range(W)], "sum", dt)[r * n:(r + 1) * n],
                           False),
        "all_to_all": ((W * n,), (W * n,), lambda o, i: zb.all_to_all_single(o, i),
                       lambda it: torch.cat([P(q, (W * n,), it)[r * n:(r + 1) * n] for q in range(W)]), False),
        "broadcast": ((n,), (n,), lambda o, i: zb.broadcast(i, 0), lambda it: P(0, (n,), it), True),
        "all_gather_v": ((sum(rows),), (rows[r],), lambda o, i: zb.all_gather_v(o, i, rows_t),
                         lambda it: torch.cat([P(q, (rows[q],), it) for q in range(W)]), False),
        "reduce_scatter_v": ((rows[r],), (sum(rows),), lambda o, i: zb.reduce_scatter_v(o, i, rows_t),
                             lambda it: reduce_ref([P(q, (sum(rows),), it) for q in range(W)], "sum",
                                                dt)[sum(rows[:r]):sum(rows[:r + 1])], False),
        "all_to_all_v": ((sum(split(q, r) for q in range(W)),), (sum(split(r, q) for q in range(W)),),
                         lambda o, i: zb.all_to_all_single(o, i, out_t, in_t),
                         lambda it: torch.cat([a2a_part(P(q, (sum(split(q, b) for b in range(W)),), it), q, r, W,
                                                         split) for q in range(W)]), False),
    }
    for name, (oshape, ishape, call, want, inplace) in cases.items():
        def case(oshape=oshape, ishape=ishape, call=call, want=want, inplace=inplace):
            out, inp = rk.empty(oshape, dt), rk.empty(ishape, dt)
            inp.copy_(P(r, ishape, 0))
            call(out, inp)  # eager warm-up: the device ops and their tables exist before the capture
            rk.finish()
            wrong = diff(inp if inplace else out, want(0))
            if wrong:
                return f"eager: {wrong}"
            if rk.interpret:
                replay = lambda: call(out, inp)  # noqa: E731 - no graphs on the CPU: the same call, eagerly
            else:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    call(out, inp)
                replay = g.replay
            for it in range(1, replays + 1):
                inp.copy_(P(r, ishape, it))
                replay()
                rk.finish()
                wrong = diff(inp if inplace else out, want(it))
                if wrong:
                    return f"replay {it}: {wrong}"
            return None

        run_case(rk, f"graph/{name}/bfloat16/n={n}", case, res)
    return res


def decode_step(rk: Rank, *, replays: int) -> list[tuple[str, bool, str]]:
    """A decode-style step, ``(x @ A_rank) -> all_reduce -> @ B``, captured once and replayed ``replays``
    times on new inputs: each replay bit-exact against the same step run eagerly, and the eager step
    against a plain-torch reference (the sum over ranks of ``x @ A_q``, computed here, fp32 tolerance);
    replays bit-exact against eager, or within fp32 rounding where cuBLAS picks another algorithm."""
    res: list = []
    W, r, zb = rk.world, rk.rank, rk.zbccl

    def weights(q: int, shape) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 + q)
        return (torch.randn(shape, generator=g) / 32).to(rk.device)

    def case():
        B, H, F = 8, 512, 1024
        A = [weights(q, (H, F)) for q in range(W)]
        Bw = weights(99, (F, H))
        x = torch.empty(B, H, device=rk.device)
        h = rk.empty((B, F), torch.float32)

        def step():
            torch.matmul(x, A[r], out=h)
            zb.all_reduce(h)
            return h @ Bw

        inputs = [(payload(0, (B, H), torch.float32, it=i) / 16).to(rk.device) for i in range(replays)]
        eager = []
        for xi in inputs:
            x.copy_(xi)
            eager.append(step().clone())
        rk.finish()
        ref = (sum(inputs[0] @ A[q] for q in range(W))) @ Bw
        err = (eager[0] - ref).abs().max().item()
        if err > 1e-3 * max(1.0, ref.abs().max().item()):
            return f"eager step differs from the plain-torch reference by {err:.3g}"
        x.copy_(inputs[0])
        outs = []
        if rk.interpret:  # no graphs on the CPU: the same step, eagerly
            for xi in inputs:
                x.copy_(xi)
                outs.append(step().clone())
        else:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                y = step()
            for xi in inputs:
                x.copy_(xi)
                g.replay()
                outs.append(y.clone())
        rk.finish()
        for i, (a, b) in enumerate(zip(outs, eager)):
            # bit-exact unless cuBLAS picked another algorithm under capture (then within fp32 rounding)
            if not torch.equal(a, b) and (a - b).abs().max().item() > 1e-5 * max(1.0, b.abs().max().item()):
                return f"replay {i} differs from eager by {(a - b).abs().max().item():.3g}"
        return None

    run_case(rk, f"graph/decode_step/{replays}_replays", case, res)
    return res



def scope_step(rk: Rank) -> list[tuple[str, bool, str]]:
    """A decode step under ``heap_scope``, eager: zero staging (see ``scoped``)."""
    res: list = []
    W, r, zb = rk.world, rk.rank, rk.zbccl

    def weights(q: int, shape) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 + q)
        return (torch.randn(shape, generator=g) / 32).to(rk.device)

    def scoped():
        """The eager step under ``heap_scope``: the matmul's output lands in the heap, so the all_reduce runs
        on it in place, and nothing is staged."""
        B, H, F = 8, 512, 1024
        A, Bw = weights(r, (H, F)), weights(99, (F, H))
        dev = rk.device.type
        before = zb.memory_stats(device=dev)["staged_bytes"]
        x = (payload(0, (B, H), torch.float32) / 16).to(rk.device)
        with zb.heap_scope(device=dev):
            h = x @ A
            if not zb.is_heap_tensor(h):
                return "the matmul's output under heap_scope is not a heap tensor"
            zb.all_reduce(h)
            y = h @ Bw
        rk.finish()
        staged = zb.memory_stats(device=dev)["staged_bytes"] - before
        ref = (sum(x @ weights(q, (H, F)) for q in range(W))) @ Bw
        err = (y - ref).abs().max().item()
        if err > 1e-3 * max(1.0, ref.abs().max().item()):
            return f"differs from the plain-torch reference by {err:.3g}"
        return None if staged == 0 else f"{staged} bytes staged, expected 0"

    run_case(rk, "scope/decode_step", scoped, res)
    return res


def pg_cases(rk: Rank) -> list[tuple[str, bool, str]]:
    """torch.distributed on a ``zbccl`` group (``dist.new_group(backend="zbccl")``): sync and ``async_op``
    collectives (Work objects over CUDA events: ``wait``, ``is_completed``, ``get_future``), the barrier,
    and the functional all_gather, on heap tensors, each against the reference."""
    import torch.distributed._functional_collectives as funcol

    W, r, res = rk.world, rk.rank, []
    dt, n = torch.bfloat16, 1001
    P = lambda q, shape, it=0: payload(q, shape, dt, it=it)  # noqa: E731
    summed = lambda shape, it=0: reduce_ref([P(q, shape, it) for q in range(W)], "sum", dt)  # noqa: E731
    # the group's timeout bounds its kernels' waits (torch's default, 30 minutes, would outlive the world)
    pg = dist.new_group(list(range(W)), backend="zbccl", timeout=timedelta(seconds=rk.timeout))

    def sync_ops():
        t = rk.empty((n,), dt)
        t.copy_(P(r, (n,)))
        dist.all_reduce(t, group=pg)
        out, inp = rk.empty((W * n,), dt), rk.empty((n,), dt)
        inp.copy_(P(r, (n,), 1))
        dist.all_gather_into_tensor(out, inp, group=pg)
        rs_in, rs_out = rk.empty((W * n,), dt), rk.empty((n,), dt)
        rs_in.copy_(P(r, (W * n,), 2))
        dist.reduce_scatter_tensor(rs_out, rs_in, group=pg)
        a_in, a_out = rk.empty((W * n,), dt), rk.empty((W * n,), dt)
        a_in.copy_(P(r, (W * n,), 3))
        dist.all_to_all_single(a_out, a_in, group=pg)
        b = rk.empty((n,), dt)
        b.copy_(P(r, (n,), 4))
        dist.broadcast(b, src=W - 1, group=pg)
        dist.barrier(group=pg)
        rk.finish()
        return (diff(t, summed((n,))) or diff(out, torch.cat([P(q, (n,), 1) for q in range(W)]))
                or diff(rs_out, summed((W * n,), 2)[r * n:(r + 1) * n])
                or diff(a_out, torch.cat([P(q, (W * n,), 3)[r * n:(r + 1) * n] for q in range(W)]))
                or diff(b, P(W - 1, (n,), 4)))

    def async_ops():
        t = rk.empty((n,), dt)
        t.copy_(P(r, (n,)))
        work = dist.all_reduce(t, group=pg, async_op=True)
        work.wait()  # the current stream waits; the host does not
        fut = work.get_future()
        out, inp = rk.empty((W * n,), dt), rk.empty((n,), dt)
        inp.copy_(P(r, (n,), 1))
        w2 = dist.all_gather_into_tensor(out, inp, group=pg, async_op=True)
        w2.synchronize() if hasattr(w2, "synchronize") else w2.wait()
        w2.wait()
        got = fut.wait()
        rk.finish()
        if not (work.is_completed() and w2.is_completed()):
            return "a waited Work is not completed after the device finished"
        got = got[0] if isinstance(got, list) else got
        return diff(t, summed((n,))) or diff(got, summed((n,))) or diff(
            out, torch.cat([P(q, (n,), 1) for q in range(W)]))

    def functional():
        inp = rk.empty((n,), dt)
        inp.copy_(P(r, (n,), 5))
        got = funcol.all_gather_tensor(inp, 0, pg).wait() if hasattr(funcol, "all_gather_tensor") else None
        rk.finish()
        return None if got is None else diff(got, torch.cat([P(q, (n,), 5) for q in range(W)]))

    run_case(rk, "pg/sync_ops", sync_ops, res)
    run_case(rk, "pg/async_ops", async_ops, res)
    run_case(rk, "pg/functional_all_gather", functional, res)
    return res


def cases_rank(*, rank: int, world_size: int, store, quick: bool, replays: int, heap_bytes: int,
               device: str = DEV, deadline: float = float("inf")) -> list:
    """One rank of a cases world (``tools.launch.launch_local``): the core dtypes' eager cases, the
    heap_scope step, the graph cases, the decode step, then every other dtype (each op and dtype is one
    more kernel to compile: the order puts what matters most first when the time budget runs out)."""
    rk = Rank(rank, world_size, store, heap_bytes=heap_bytes, timeout=10.0, device=device, deadline=deadline)
    try:
        # float32 first, then the heap_scope step, the graphs and the decode step (each kernel variant is
        # one more compile: these come before the rest of the dtypes use up a short budget), then bf16
        res = correctness(rk, quick=quick, core=True, dtypes=(torch.float32,))
        res += scope_step(rk)  # eager, before any capture
        res += graph_cases(rk)  # on the CPU dry run: each case's eager half and reference, then no capture
        res += decode_step(rk, replays=replays)
        if not rk.interpret:  # (the rehearsal's CPU tensors would take the CPU path there: nothing to rehearse)
            res += pg_cases(rk)
            res += ep_cases(rk)  # (on the CPU dry run: the same cases on the CPU path, against the same oracle)
        res += correctness(rk, quick=quick, core=True, dtypes=(torch.bfloat16,))
        res += correctness(rk, quick=quick, core=False)
        if rk.interpret:  # the rehearsal really ran the kernels: every op above was a DeviceOps launch
            ops = rk.comm.device_state.get("cpu")
            launches = getattr(ops, "_epoch", 0)
            res.append(("interpret/device_ops", type(ops).__name__ == "DeviceOps" and launches > 100,
                        f"{type(ops).__name__}, {launches} kernel launches"))
        return res
    finally:
        rk.close()
