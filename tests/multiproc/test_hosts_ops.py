"""Every collective over a communicator that spans hosts (``ops/hosts``), against the plain-torch reference.

"Hosts" are made by ``ZBCCL_HOST_ID`` (one machine, no root): ranks of one host id share memory (shm),
the others are reached through Mooncake over loopback (the routed transport). Layouts: 2x1, 2x2 (the
hierarchical algorithms), 3x1 and an irregular 2+1. Payloads name their source (value = f(rank, index)).
Skips without Mooncake.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from tests.spawn import run_world
from zbccl.ops.dtypes import AVG, MAX, MIN, PROD, SUM
from zbccl.ops.hosts import reduction_order
from zbccl.ops.reference import all_reduce_ref, hierarchical_all_reduce_ref, reduce_ref
from zbccl.ops.tuner import HOSTS_COLUMN_MAX, hosts_hierarchical, hosts_settings

REDS = {"sum": SUM, "max": MAX, "min": MIN, "product": PROD, "avg": AVG}


@pytest.fixture(autouse=True)
def _needs_mooncake():
    from zbccl.heap.transports.mooncake import missing_reason

    reason = missing_reason()
    if reason:
        pytest.skip(reason)


def _init(ctx, hosts: list[int], **kwargs):
    os.environ["ZBCCL_HOST_ID"] = f"fake-host-{hosts[ctx.rank]}"
    kwargs.setdefault("heap_size", 8 << 20)
    return ctx.init(**kwargs)


def f(rank: int, n: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """``n`` values naming their source; small integers, so every float sum is exact."""
    v = (torch.arange(n) % 13 + 1) * (rank + 2) + salt
    if dtype == torch.bool:
        return (v % 3) == rank % 3
    return v.to(dtype)


def _cases(ctx, hosts: list[int], sizes: list[int], dtypes: list[torch.dtype], reds: list[str]) -> str:
    import zbccl

    comm = _init(ctx, hosts)
    W, me = comm.world_size, comm.rank
    assert not comm._single_host
    try:
        for n in sizes:
            for dt in dtypes:
                for red in reds:
                    if red == "avg" and not dt.is_floating_point:
                        continue
                    x = f(me, n, dt)
                    zbccl.all_reduce(x, red)
                    want = all_reduce_ref([f(r, n, dt) for r in range(W)], REDS[red])
                    assert torch.equal(x, want), (n, dt, red, x[:8], want[:8])
                # all_gather (even), into a private output, then in place from the heap
                out = torch.empty(W * n, dtype=dt)
                zbccl.all_gather_into_tensor(out, f(me, n, dt))
                assert torch.equal(out, torch.cat([f(r, n, dt) for r in range(W)])), (n, dt)
                # reduce_scatter (even)
                x = torch.cat([f(me, n, dt, salt=r) for r in range(W)])
                o = torch.empty(n, dtype=dt)
                zbccl.reduce_scatter_tensor(o, x)
                want = reduce_ref([torch.cat([f(q, n, dt, salt=r) for r in range(W)])[me * n:(me + 1) * n]
                                   for q in range(W)], SUM)
                assert torch.equal(o, want), (n, dt)
                # broadcast from the last rank
                b = f(me, n, dt)
                zbccl.broadcast(b, W - 1)
                assert torch.equal(b, f(W - 1, n, dt)), (n, dt)
            # uneven: all_gather_v, reduce_scatter_v, all_to_all with splits
            rows = [(n + r) % 5 + r for r in range(W)]
            g = torch.empty(sum(rows), 3)
            zbccl.all_gather_v(g, f(me, rows[me] * 3, torch.float32).view(rows[me], 3), rows)
            assert torch.equal(g, torch.cat([f(r, rows[r] * 3, torch.float32).view(rows[r], 3) for r in range(W)]))
            x = f(me, sum(rows) * 2, torch.int32).view(sum(rows), 2)
            o = torch.empty(rows[me], 2, dtype=torch.int32)
            zbccl.reduce_scatter_v(o, x, rows, "max")
            lo = sum(rows[:me])
            want = reduce_ref([f(q, sum(rows) * 2, torch.int32).view(-1, 2)[lo:lo + rows[me]] for q in range(W)], MAX)
            assert torch.equal(o, want)
            ins = [(me + q + n) % 4 for q in range(W)]
            outs = [(q + me + n) % 4 for q in range(W)]
            src = f(me, sum(ins), torch.int64) + 1000 * me
            dst = torch.empty(sum(outs), dtype=torch.int64)
            zbccl.all_to_all_single(dst, src, outs, ins)
            parts = []
            for q in range(W):
                qi = [(q + r + n) % 4 for r in range(W)]
                parts.append((f(q, sum(qi), torch.int64) + 1000 * q)[sum(qi[:me]):sum(qi[:me]) + qi[me]])
            assert torch.equal(dst, torch.cat(parts))
        comm.barrier()
        # along a dim, heap tensors, in place
        x = zbccl.empty((4, 3), dtype=torch.float32)
        x.copy_(f(me, 12, torch.float32).view(4, 3))
        out = torch.empty(4, 3 * W)
        zbccl.all_gather_into_tensor(out, x, dim=1)
        assert torch.equal(out, torch.cat([f(r, 12, torch.float32).view(4, 3) for r in range(W)], 1))
        for shape in [(0, 8), (3, 0)]:  # empty along another dim than the gathered one (found by the soak)
            e = torch.empty(shape)
            eo = torch.full((shape[0], shape[1] * W), 7.0)
            zbccl.all_gather_into_tensor(eo, e, dim=1)
            assert eo.numel() == 0
        big = zbccl.empty((W * 5,), dtype=torch.float32)
        big.copy_(f(me, W * 5, torch.float32))
        zbccl.all_gather_into_tensor(big, big[me * 5:(me + 1) * 5].clone().copy_(big[me * 5:(me + 1) * 5]))
        y = f(me, 2 * W * 3, torch.float32).view(2, W * 3)
        o = torch.empty(2, 3)
        zbccl.reduce_scatter_tensor(o, y, dim=1)
        assert torch.equal(o, sum(f(q, 2 * W * 3, torch.float32).view(2, W * 3) for q in range(W))[:, me * 3:me * 3 + 3])
        nc = f(me, 40, torch.float64).view(5, 8).t()  # non-contiguous
        zbccl.all_reduce(nc)
        assert torch.equal(nc, sum(f(r, 40, torch.float64) for r in range(W)).view(5, 8).t())
        zbccl.all_reduce(x, timeout=20)
        return "ok"
    finally:
        zbccl.finalize()


SMALL = [0, 1, 7, 300]


@pytest.mark.parametrize("hosts", [[0, 1], [0, 0, 1, 1], [0, 1, 2], [0, 0, 1]], ids=["2x1", "2x2", "3x1", "2+1"])
def test_every_op_small(hosts):
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.uint8] if len(hosts) == 2 else [torch.float32,
                                                                                                torch.int32]
    reds = ["sum", "max", "min", "product", "avg"] if len(hosts) == 2 else ["sum", "avg"]
    assert run_world(_cases, len(hosts), hosts=hosts, sizes=SMALL, dtypes=dtypes, reds=reds,
                     timeout=240) == ["ok"] * len(hosts)


def _large(ctx, hosts: list[int]) -> str:
    """Multi-chunk sizes (the chunk shrinks to fit the small heap) and the hierarchical algorithms at 2x2."""
    import zbccl

    comm = _init(ctx, hosts, heap_size=2 << 20)
    W, me = comm.world_size, comm.rank
    try:
        h = comm.device_state.get("hosts")
        for n in (140_001, 300_000):  # (hierarchical at 2 x 2 from tuner.HOSTS_HIER_MIN, 256 KiB, in every dtype)
            for dt, red in ((torch.float32, "sum"), (torch.int64, "max"), (torch.bfloat16, "avg"),
                            (torch.bfloat16, "product")):
                x = f(me, n, dt)
                zbccl.all_reduce(x, red)
                ins = [f(r, n, dt) for r in range(W)]
                order = reduction_order(comm, x.numel() * x.element_size())  # per host first, where hierarchical
                assert (order is not None) == (len(set(hosts)) < W), order
                want = all_reduce_ref(ins, REDS[red]) if order is None else \
                    hierarchical_all_reduce_ref(ins, REDS[red], order)
                assert torch.equal(x, want), (n, dt, red)  # bit for bit, in the documented order
            out = torch.empty(W * n, dtype=torch.float32)
            zbccl.all_gather_into_tensor(out, f(me, n, torch.float32))
            assert torch.equal(out, torch.cat([f(r, n, torch.float32) for r in range(W)]))
            hin, hout = zbccl.empty((n,), dtype=torch.float32), zbccl.empty((W * n,), dtype=torch.float32)
            hin.copy_(f(me, n, torch.float32))
            staged = zbccl.memory_stats()["staged_bytes"]
            zbccl.all_gather_into_tensor(hout, hin)  # heap operands: nothing staged, hierarchical or flat
            assert zbccl.memory_stats()["staged_bytes"] == staged
            assert torch.equal(hout, torch.cat([f(r, n, torch.float32) for r in range(W)]))
            del hin, hout
            x = torch.cat([f(me, n, torch.int32, salt=r) for r in range(W)])
            o = torch.empty(n, dtype=torch.int32)
            zbccl.reduce_scatter_tensor(o, x)
            assert torch.equal(o, sum(torch.cat([f(q, n, torch.int32, salt=r) for r in range(W)])[me * n:(me + 1) * n]
                                      for q in range(W)).to(torch.int32))
            b = f(me, n, torch.float32)
            zbccl.broadcast(b, 0)
            assert torch.equal(b, f(0, n, torch.float32))
            b = f(me, 2 * n, torch.int32).view(n, 2).t()  # a root of local index 1, a strided tensor
            zbccl.broadcast(b, W - 1)
            assert torch.equal(b, f(W - 1, 2 * n, torch.int32).view(n, 2).t())
        x = f(me, 1 << 20, torch.float32)  # 4 MiB outside a 2 MiB heap: the hierarchy stages segment by segment
        zbccl.all_reduce(x)
        assert torch.equal(x, sum(f(r, 1 << 20, torch.float32) for r in range(W)))
        h = comm.device_state["hosts"]
        return f"chunk={h.chunk} hier={h.regular}"
    finally:
        zbccl.finalize()


@pytest.mark.parametrize("hosts", [[0, 1], [0, 0, 1, 1]], ids=["2x1", "2x2"])
def test_large_multi_chunk_and_hierarchical(hosts):
    got = run_world(_large, len(hosts), hosts=hosts, timeout=300)
    assert all(g.endswith(f"hier={len(hosts) == 4}") for g in got), got
    assert all(int(g.split()[0].split("=")[1]) < 300_000 * 4 for g in got), got  # really chunked


def _two_phases(ctx, tables: str) -> str:
    """2 x 2, sizes the hierarchical all_reduce runs as the host's all_reduce and one column step of the whole
    tensor (``HostOps.tune["column_max"]``, the default ``tuner.HOSTS_COLUMN_MAX``): bit for bit the hierarchical
    reference, for each reduce op, in the heap or not, contiguous or not; and the segments just above it. Rank 0's
    table makes every all_reduce hierarchical (by default the smaller ones are flat)."""

    import zbccl
    from zbccl.ops.hosts import hier

    _table(ctx, tables, {"hier_min": {"all_reduce": 0}})
    comm = _init(ctx, [0, 0, 1, 1], heap_size=32 << 20)
    W, me = comm.world_size, comm.rank
    runs = []
    two_phases = hier._host_then_column
    hier._host_then_column = lambda *a: (runs.append(1), two_phases(*a))  # (this process only)
    try:
        for n, dt, red, heap, strided in ((20_001, torch.float32, "sum", True, False),
                                          (65_000, torch.bfloat16, "avg", False, False),
                                          (16_000, torch.int64, "max", False, True),
                                          (50_000, torch.bfloat16, "product", True, False),
                                          (HOSTS_COLUMN_MAX // 4 + 1, torch.float32, "sum", False, False)):
            x = f(me, 2 * n if strided else n, dt)
            if heap:
                x = zbccl.empty((n,), dtype=dt).copy_(x)
            if strided:
                x = x.view(2, n).t()  # not contiguous
            ins = [(f(r, 2 * n, dt).view(2, n).t() if strided else f(r, n, dt)) for r in range(W)]
            before = len(runs)
            zbccl.all_reduce(x, red)
            h = comm.device_state["hosts"]
            order = reduction_order(comm, x.numel() * x.element_size())
            assert order == [[0, 1], [2, 3]], order
            assert torch.equal(x, hierarchical_all_reduce_ref(ins, REDS[red], order)), (n, dt, red)
            two = n * x.element_size() <= min(h.tune["column_max"], h.chunk)
            assert len(runs) - before == int(two), (n, runs)
        return "ok"
    finally:
        zbccl.finalize()


def test_hierarchical_all_reduce_in_two_phases(tmp_path):
    assert run_world(_two_phases, 4, timeout=240, tables=str(tmp_path)) == ["ok"] * 4


def _table(ctx, tables: str, hosts: dict) -> None:
    """Rank 0's tuning table sets ``hosts`` (its ``"hosts"`` section); the others' tables set nothing (an empty
    table each, in place of this machine's: the native build cache stays where it is)."""
    import json

    path = os.path.join(tables, f"rank{ctx.rank}.json")
    with open(path, "w") as fh:
        json.dump({"rules": {}, "hosts": hosts if ctx.rank == 0 else {}}, fh)
    os.environ["ZBCCL_TUNE_FILE"] = path


def _tuned(ctx, tables: str) -> str:
    """2 x 2: rank 0's tuning file sets the inter-host choices of every rank (the others have none); a bad file
    on rank 0 fails the first op across hosts on every rank with the file named."""
    import json

    import zbccl
    from zbccl.errors import ZbcclInvalidUsageError

    tune = {"chunk": 65536, "direct_min": 8192, "hier_min": {"all_reduce": 0, "all_gather": None}, "column_max": 0,
            "relay": False}
    _table(ctx, tables, tune)
    comm = _init(ctx, [0, 0, 1, 1], heap_size=32 << 20)
    W, me = comm.world_size, comm.rank
    try:
        x = f(me, 1000, torch.float32)
        zbccl.all_reduce(x)  # 4000 bytes: hierarchical only because rank 0's table says so
        h = comm.device_state["hosts"]
        assert h.tune == hosts_settings(tune) and h.chunk == 65536 and h.direct_min == 8192, (h.tune, h.chunk)
        assert h.world.relays == [None] * W
        order = reduction_order(comm, 4000)
        assert order == [[0, 1], [2, 3]], order
        assert torch.equal(x, hierarchical_all_reduce_ref([f(r, 1000, torch.float32) for r in range(W)], SUM, order))
        big = f(me, 300_000, torch.float32)  # over the tuned chunk and column_max: segments of 64 KiB chunks
        zbccl.all_reduce(big)
        assert torch.equal(big, hierarchical_all_reduce_ref([f(r, 300_000, torch.float32) for r in range(W)], SUM,
                                                            order))
        out = torch.empty(W * 300_000)
        zbccl.all_gather_into_tensor(out, f(me, 300_000, torch.float32))  # never hierarchical: flat, chunked
        assert torch.equal(out, torch.cat([f(r, 300_000, torch.float32) for r in range(W)]))
    finally:
        zbccl.finalize()
    if ctx.rank == 0:
        path = os.path.join(tables, "bad.json")
        with open(path, "w") as fh:
            json.dump({"rules": {}, "hosts": {"chunk": 100}}, fh)
        os.environ["ZBCCL_TUNE_FILE"] = path
    comm = _init(ctx, [0, 0, 1, 1], heap_size=32 << 20)
    try:
        with pytest.raises(ZbcclInvalidUsageError, match=r"on rank 0: .*bad hosts.chunk in .*bad.json"):
            zbccl.all_reduce(torch.ones(10))
    finally:
        zbccl.finalize()
    return "ok"


def test_rank_zeros_tuning_file_sets_the_inter_host_choices(tmp_path):
    assert run_world(_tuned, 4, timeout=240, tables=str(tmp_path)) == ["ok"] * 4


def _hier_reduce_scatter(ctx, tables: str) -> str:
    """2 x 2, rank 0's table making every even reduce_scatter and every broadcast hierarchical (by default never
    and from 4 MiB). reduce_scatter: the host's partials, then the column's, bit for bit the hierarchical reference's
    slice for each reduce op; tiny, odd and multi-segment slices; in place (output = this rank's slice of the
    input), a strided output, operands in the heap or not; inter-host bytes: this rank's column peers' slices
    only. broadcast: the root's column, then each host, from either local index, empty to multi-segment."""

    import zbccl

    _table(ctx, tables, {"hier_min": {"reduce_scatter": 0, "broadcast": 0}})
    comm = _init(ctx, [0, 0, 1, 1], heap_size=32 << 20)
    W, me = comm.world_size, comm.rank
    order = [[0, 1], [2, 3]]
    try:
        cases = ((1, torch.float32, "sum", "plain"), (7, torch.bfloat16, "avg", "plain"),
                 (300, torch.int64, "max", "heap"), (301, torch.int32, "product", "inplace"),
                 (200_000, torch.float32, "sum", "heap"), (200_001, torch.bfloat16, "sum", "strided"))
        for c, dt, red, how in cases:
            ins = [f(r, W * c, dt) for r in range(W)]
            x = ins[me].clone()
            if how == "heap":
                x = zbccl.empty((W * c,), dtype=dt).copy_(x)
            out = torch.empty(c, dtype=dt)
            if how == "inplace":
                out = x[me * c:(me + 1) * c]
            elif how == "strided":
                out = torch.empty(2 * c, dtype=dt)[::2]
            mc = comm._ctx.heap.transport.remote
            before = mc.bytes_put
            zbccl.reduce_scatter_tensor(out, x, red)
            want = hierarchical_all_reduce_ref(ins, REDS[red], order)[me * c:(me + 1) * c]
            assert torch.equal(out, want), (c, dt, red, how)
            h = comm.device_state["hosts"]
            sent = mc.bytes_put - before  # one stamp per step and this rank's column peer's slice, no more
            assert c * x.element_size() <= sent <= c * x.element_size() + 4096 * (1 + c * x.element_size()
                                                                                     // h.chunk), (sent, c)
        for n, dt, root, how in ((0, torch.float32, 0, "plain"), (5, torch.int64, 3, "heap"),
                                 (300_001, torch.bfloat16, 1, "strided"), (800_000, torch.float32, 2, "heap")):
            b = f(me, 2 * n, dt)[::2] if how == "strided" else f(me, n, dt)
            if how == "heap":
                b = zbccl.empty((n,), dtype=dt).copy_(b)
            zbccl.broadcast(b, root)
            want = f(root, 2 * n, dt)[::2] if how == "strided" else f(root, n, dt)
            assert torch.equal(b, want), (n, dt, root, how)
        return "ok"
    finally:
        zbccl.finalize()


def test_hierarchical_reduce_scatter_and_broadcast(tmp_path):
    assert run_world(_hier_reduce_scatter, 4, timeout=240, tables=str(tmp_path)) == ["ok"] * 4


def _direct(ctx, hosts: list[int]) -> str:
    """Pieces over the direct threshold go straight into the receivers' outputs (heap outputs; a heap scratch
    for the others), mixed with small pieces through the slots; with no room for a scratch on one rank, every
    rank takes the slots instead. Counted by ``HostOps.direct_bytes``."""
    import zbccl
    from zbccl.errors import ZbcclInvalidUsageError

    comm = _init(ctx, hosts, heap_size=16 << 20, heap_max=16 << 20)  # no growth: a full heap stays full
    W, me = comm.world_size, comm.rank
    try:
        zbccl.barrier()
        h = comm.device_state["hosts"]
        big = min(h.direct_min, h.chunk)
        far = [q for q in range(W) if hosts[q] != hosts[me]]
        n = big // 4 + 999  # float32 pieces just over the threshold
        # all_to_all, uneven: big pieces to the ranks of other hosts, small ones to the rest, into a heap output
        ins = [n + 7 * q if q in far or q == me else 5 + q for q in range(W)]
        outs = [n + 7 * me if hosts[q] != hosts[me] or q == me else 5 + me for q in range(W)]
        src = torch.cat([f(me, ins[q], torch.float32, salt=q) for q in range(W)])
        dst = zbccl.empty((sum(outs),), dtype=torch.float32)
        before = h.direct_bytes
        zbccl.all_to_all_single(dst, src, outs, ins)
        assert torch.equal(dst, torch.cat([f(q, outs[q], torch.float32, salt=me) for q in range(W)]))
        assert h.direct_bytes - before == sum(4 * ins[q] for q in far if ins[q] * 4 > big), h.direct_bytes - before
        # all_gather into ordinary memory (a scratch in the heap receives), and a broadcast in place
        out = torch.empty(W * n, dtype=torch.int32)
        before = h.direct_bytes
        zbccl.all_gather_into_tensor(out, f(me, n, torch.int32))
        assert torch.equal(out, torch.cat([f(r, n, torch.int32) for r in range(W)]))
        hier = hosts_hierarchical("all_gather", W * n * 4, h.H, h.L, h.regular)  # 2x2: through the columns
        assert h.direct_bytes - before == (0 if hier else (W - 1) * 4 * n)
        b = f(me, 2 * n, torch.float64)[::2]  # not contiguous: a scratch receives it
        zbccl.broadcast(b, W - 1)
        assert torch.equal(b, f(W - 1, 2 * n, torch.float64)[::2])
        # all_reduce of slices over the threshold (flat: a reduce_scatter, then an all_gather, both direct; the
        # bits of the one exchange), in the heap and not contiguous; reduce_scatter through the scratch slots
        for x in (zbccl.empty((W * n,), dtype=torch.float32).copy_(f(me, W * n, torch.float32)),
                  f(me, 2 * W * n + 2, torch.bfloat16).view(2, -1).t()):
            want = all_reduce_ref([f(r, x.numel(), x.dtype).view(x.shape) if x.is_contiguous() else
                                   f(r, x.numel(), x.dtype).view(2, -1).t() for r in range(W)], SUM)
            before = h.direct_bytes
            zbccl.all_reduce(x)
            assert torch.equal(x, want), x.dtype
            flat = reduction_order(comm, x.numel() * x.element_size()) is None
            assert (h.direct_bytes > before) == flat, (h.direct_bytes, before, flat)
        m = big // 2 + 99  # bf16 pieces just over the threshold
        y = torch.cat([f(me, m, torch.bfloat16, salt=q) for q in range(W)])
        o = torch.empty(m, dtype=torch.bfloat16)
        before = h.direct_bytes
        zbccl.reduce_scatter_tensor(o, y)
        assert torch.equal(o, reduce_ref([f(q, m, torch.bfloat16, salt=me) for q in range(W)], SUM))
        assert h.direct_bytes - before == (W - 1) * 2 * m
        # sizes that disagree, one rank splitting its all_reduce and the other not: every rank raises the same error
        with pytest.raises(ZbcclInvalidUsageError, match="disagree on the size"):
            zbccl.all_reduce(torch.ones(3 * big if me == 0 else big // 8))
        skew = [n + 1, n - 1] + [n] * (W - 2) if me == 0 else [n] * W  # rank 0 sends rank 1 one row too few
        with pytest.raises(ZbcclInvalidUsageError, match="splits disagree"):  # pieces big enough to go direct
            zbccl.all_to_all_single(zbccl.empty((W * n,)), torch.ones(W * n), [n] * W, skew)
        # no room for a scratch on rank 0: every rank sends the big pieces through the slots, one step late (4 MiB
        # are left there, less than the scratch the output outside the heap needs)
        filler = zbccl.empty(((zbccl.memory_stats()["free_bytes"] - (4 << 20)) // 2,), dtype=torch.int16) \
            if me == 0 else None
        out = torch.empty(W * 3 * n, dtype=torch.float32)
        before = h.direct_bytes
        zbccl.all_to_all_single(out, torch.cat([f(me, 3 * n, torch.float32, salt=q) for q in range(W)]))
        assert torch.equal(out, torch.cat([f(q, 3 * n, torch.float32, salt=me) for q in range(W)]))
        assert h.direct_bytes == before
        del filler
        zbccl.barrier()
        return "ok"
    finally:
        zbccl.finalize()


@pytest.mark.parametrize("hosts", [[0, 1], [0, 0, 1, 1], [0, 1, 2]], ids=["2x1", "2x2", "3x1"])
def test_direct_puts_into_outputs(hosts):
    assert run_world(_direct, len(hosts), hosts=hosts, timeout=240) == ["ok"] * len(hosts)


def _groups_and_errors(ctx) -> str:
    """Groups spanning hosts and within one host; a mismatch and a local error on one rank raise everywhere."""
    import zbccl
    from zbccl.errors import ZbcclInvalidUsageError

    comm = _init(ctx, [0, 0, 1, 1])
    me = comm.rank
    try:
        span = comm.new_group([1, 2])  # one rank of each host
        inside = comm.new_group([2, 3])  # one host: the shm ops
        if span:
            x = f(me, 33, torch.float32)
            zbccl.all_reduce(x, comm=span)
            assert torch.equal(x, f(1, 33, torch.float32) + f(2, 33, torch.float32))
            assert not span._single_host
        if inside:
            assert inside._single_host
            x = f(me, 33, torch.float32)
            zbccl.all_reduce(x, comm=inside)
            assert torch.equal(x, f(2, 33, torch.float32) + f(3, 33, torch.float32))
        # a size mismatch on rank 3 only: every rank raises, naming the disagreement; then the group works
        x = torch.ones(10 if me != 3 else 11)
        with pytest.raises(ZbcclInvalidUsageError, match="disagree on the size"):
            zbccl.all_reduce(x)
        # a local error on rank 1 only (a bad root): every rank raises
        with pytest.raises(ZbcclInvalidUsageError, match="src out of range"):
            zbccl.broadcast(torch.ones(4), 9 if me == 1 else 0)
        with pytest.raises(ZbcclInvalidUsageError, match="different ops"):
            if me == 0:
                zbccl.broadcast(torch.ones(4), 0)
            else:
                zbccl.all_reduce(torch.ones(4))
        with pytest.raises(ZbcclInvalidUsageError, match="splits disagree"):
            zbccl.all_to_all_single(torch.empty(4), torch.ones(4), [1, 1, 1, 1], [1, 1, 1, 1] if me else [2, 0, 1, 1])
        x = f(me, 5, torch.int64)
        zbccl.all_reduce(x)
        assert torch.equal(x, sum(f(r, 5, torch.int64) for r in range(4)))
        if span:
            span.destroy()
        if inside:
            inside.destroy()
        comm.barrier()
        return "ok"
    finally:
        zbccl.finalize()


def test_groups_and_agreement_errors():
    assert run_world(_groups_and_errors, 4, timeout=240) == ["ok"] * 4


def _late(ctx) -> str:
    """A per-op timeout names the late rank and its host; the others name the rank that left; later ops raise."""
    from datetime import timedelta

    import zbccl
    from zbccl.errors import ZbcclError, ZbcclRemoteError, ZbcclTimeoutError

    comm = _init(ctx, [0, 1, 2], timeout=20)
    me, store = comm.rank, ctx.store()
    try:
        zbccl.barrier()
        if me == 0:
            with pytest.raises(ZbcclTimeoutError, match=r"waiting for ranks \[2\] \(rank 2 on host") as info:
                zbccl.all_reduce(torch.ones(8), timeout=1.5)
            store.set("timed-out", "1")
            result = str(info.value)
        else:
            if me == 2:  # late: arrives only once rank 0 gave up
                store.wait(["timed-out"], timedelta(seconds=60))
            try:  # every byte may have arrived before rank 0 left (it put its own first): then the op is complete
                zbccl.all_reduce(torch.ones(8))
                named = False
            except ZbcclRemoteError as exc:
                assert "rank 0 timed out" in str(exc), exc
                named = True
            if not named:  # then the next op names rank 0, within a liveness interval (not the 10 s timeout)
                with pytest.raises(ZbcclRemoteError, match="rank 0 timed out"):
                    zbccl.all_reduce(torch.ones(8), timeout=10)
            result = "named 0"
        with pytest.raises(ZbcclError, match="broken"):  # the communicator is unusable now
            zbccl.all_reduce(torch.ones(8), timeout=5)
        store.set(f"checked{me}", "1")
        store.wait(["checked0", "checked1", "checked2"], timedelta(seconds=60))  # nobody exits before
        return result if me else "timed out"
    finally:
        zbccl.finalize()


def test_timeout_names_the_late_rank():
    assert run_world(_late, 3, timeout=120) == ["timed out", "named 0", "named 0"]


def _interrupted(ctx) -> str:
    """Ctrl-C (SIGINT) of rank 1 in the middle of an op: rank 0, on the other host, names it."""
    from datetime import timedelta

    import zbccl
    from zbccl.errors import ZbcclError, ZbcclRemoteError

    comm = _init(ctx, [0, 1], timeout=30)
    me, store = comm.rank, ctx.store()
    try:
        zbccl.barrier()
        if me == 1:
            signal.signal(signal.SIGALRM, lambda *_: os.kill(os.getpid(), signal.SIGINT))
            signal.setitimer(signal.ITIMER_REAL, 1.0)  # SIGINT while it waits for rank 0
            with pytest.raises(KeyboardInterrupt):
                zbccl.all_reduce(torch.ones(8))
            store.set("left", "1")
        else:
            store.wait(["left"], timedelta(seconds=60))
            x = torch.ones(8)  # rank 1 put its bytes before it was interrupted: this op may complete
            try:
                zbccl.all_reduce(x)
                assert torch.equal(x, torch.full((8,), 2.0))
                named = False
            except ZbcclRemoteError as exc:
                assert "rank 1 was interrupted" in str(exc), exc
                named = True
            if not named:
                with pytest.raises(ZbcclRemoteError, match="rank 1 was interrupted"):
                    zbccl.all_reduce(torch.ones(8), timeout=10)
        with pytest.raises(ZbcclError, match="broken"):
            zbccl.all_reduce(torch.ones(8), timeout=5)
        store.set(f"checked{me}", "1")
        store.wait(["checked0", "checked1"], timedelta(seconds=60))
        return "ok"
    finally:
        zbccl.finalize()


def test_ctrl_c_mid_op_is_named_across_hosts():
    assert run_world(_interrupted, 2, timeout=120) == ["ok", "ok"]
