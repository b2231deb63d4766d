"""Usage: python scripts/triton_kernels_gpu.py [--worlds 2 4] [--bench] [--device cuda|cpu] [--timeout 300]

The device kernels (src/zbccl/native/triton) on one device, without the CUDA transport: W processes
share plain device buffers (a "heap" and a kernel pad each) through torch.multiprocessing (CUDA IPC
on a GPU; shared memory, with TRITON_INTERPRET=1, on the CPU), build the pointer tables from them and
drive ``zbccl.ops.device.DeviceOps`` over a small stand-in transport. It separates kernel problems
from transport ones, and runs where the CUDA transport does not yet.

Prints ``CHECK <name> PASS|FAIL <detail>`` per check (every op at each world, bit-exact against
plain torch on the device; CUDA graph capture and replay, and a captured matmul/all_reduce/matmul
step against eager; a peer that never arrives), then with ``--bench`` (GPU) rows of
``op size us algbw_GBps busbw_GBps`` beside the device memcpy and torch SymmetricMemory's one-shot
all_reduce at the same sizes in the same processes (TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1).
Several processes on one GPU without MPS are time-sliced: every handshake waits for the peers'
slices, so the bench shows that cost for both libraries. Exit status 1 if any check failed.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
import traceback

import torch
import torch.multiprocessing as mp

HEAP = 256 << 20


class StandInTransport:
    """What DeviceOps needs of a transport, over buffers shared by torch.multiprocessing."""

    KERNEL_LINE = 0

    def __init__(self, device: torch.device, rank: int, bufs: dict) -> None:
        self.device, self.rank, self.bufs = device, rank, bufs

    def pointer_tables(self, ranks):
        data = torch.tensor([self.bufs[r][0].data_ptr() for r in ranks], dtype=torch.int64, device=self.device)
        pads = torch.tensor([self.bufs[r][1].data_ptr() for r in ranks], dtype=torch.int64, device=self.device)
        return data, pads

    def offset_of(self, rank, t):
        heap = self.bufs[rank][0]
        off = t.data_ptr() - heap.data_ptr()
        ok = t.device == self.device and 0 <= off and off + t.numel() * t.element_size() <= heap.numel()
        return off if ok else -1

    def clear_pad(self, rank, line, nbytes):
        self.bufs[rank][1][line:line + nbytes].zero_()

    def pad_view(self, rank, line, nbytes, op="pad"):
        return self.bufs[rank][1][line:line + nbytes]


class Bump:
    """Heap tensors: a bump allocator over this rank's shared buffer (256-byte aligned)."""

    def __init__(self, heap: torch.Tensor) -> None:
        self.heap, self.top = heap, 0

    def __call__(self, *shape, dtype=torch.float32) -> torch.Tensor:
        n = torch.Size(shape).numel() * dtype.itemsize
        off = self.top
        self.top = (off + n + 255) // 256 * 256
        assert self.top <= self.heap.numel(), "script heap too small"
        return self.heap[off:off + n].view(dtype).view(*shape)

    def reset(self) -> None:
        self.top = 0


def payload(rank: int, n: int, dtype, device, salt: int = 0) -> torch.Tensor:
    i = torch.arange(n, dtype=torch.float64, device=device)
    if dtype.is_floating_point:
        return (torch.sin(i * 0.37 + rank * 1.3 + salt * 0.11) * 50 + rank).to(dtype)
    hi = 100 if dtype in (torch.int8, torch.uint8) else 10_000
    return ((i.long() * 7 + rank * 13 + salt * 5 + 1) % hi).to(dtype)


def _check(results: list, name: str, fn) -> None:
    try:
        detail = fn()
        results.append((name, True, detail or ""))
    except Exception as exc:  # noqa: BLE001 - every check reports and the next one runs
        results.append((name, False, f"{type(exc).__name__}: {str(exc)[:300]}"))


def _ops_cases(ops, alloc, W, me, dev):
    from zbccl.ops.dtypes import REDUCE_OPS
    from zbccl.ops.reference import all_reduce_ref, all_to_all_ref, reduce_ref

    def ref_ar(n, dtype, opname, salt=0):
        return all_reduce_ref([payload(r, n, dtype, dev, salt) for r in range(W)], REDUCE_OPS[opname])

    cases = []
    for algo in ("one_shot", "two_shot"):
        for dtype, opname, n in ((torch.float32, "sum", 4099), (torch.bfloat16, "sum", 70001), (torch.float16, "sum", 1),
                                 (torch.int32, "sum", 33), (torch.int8, "sum", 4099), (torch.bfloat16, "avg", 1000),
                                 (torch.float32, "max", 1000)):
            for inplace in (False, True):
                def case(algo=algo, dtype=dtype, opname=opname, n=n, inplace=inplace):
                    alloc.reset()
                    t = alloc(n, dtype=dtype)
                    t.copy_(payload(me, n, dtype, dev))
                    out = t if inplace else alloc(n, dtype=dtype)
                    ops.all_reduce(t, opname, out=None if inplace else out, algo=algo)
                    ops.check(wait=True)
                    assert torch.equal(out, ref_ar(n, dtype, opname)), "wrong result"
                cases.append((f"all_reduce_{algo}_{str(dtype)[6:]}_{opname}_n{n}{'_inplace' if inplace else ''}", case))

    def gathers():
        for dtype, n in ((torch.bfloat16, 4099), (torch.uint8, 7), (torch.float32, 1 << 16)):
            alloc.reset()
            inp = alloc(n, dtype=dtype)
            inp.copy_(payload(me, n, dtype, dev))
            out = torch.empty(W * n, dtype=dtype, device=dev)
            ops.all_gather(out, inp)
            ops.check(wait=True)
            assert torch.equal(out, torch.cat([payload(r, n, dtype, dev) for r in range(W)])), (dtype, n)
        shape = (5, 3, 7)
        inp = alloc(*shape)
        inp.copy_(payload(me, 105, torch.float32, dev).view(shape))
        out = torch.empty(5, 3 * W, 7, device=dev)
        ops.all_gather(out, inp, dim=1)
        ops.check(wait=True)
        assert torch.equal(out, torch.cat([payload(r, 105, torch.float32, dev).view(shape) for r in range(W)], 1))
        sizes = [(3 * r + 1) % 4 for r in range(W)]
        inp = alloc(sizes[me], 6, dtype=torch.bfloat16)
        inp.copy_(payload(me, 6 * sizes[me], torch.bfloat16, dev).view(-1, 6))
        out = torch.empty(sum(sizes), 6, dtype=torch.bfloat16, device=dev)
        ops.all_gather_v(out, inp, sizes)
        ops.check(wait=True)
        assert torch.equal(out, torch.cat([payload(r, 6 * sizes[r], torch.bfloat16, dev).view(-1, 6)
                                           for r in range(W)]))

    def scatters():
        n = 4099
        full = [payload(r, W * n, torch.bfloat16, dev) for r in range(W)]
        alloc.reset()
        inp = alloc(W * n, dtype=torch.bfloat16)
        inp.copy_(full[me])
        out = torch.empty(n, dtype=torch.bfloat16, device=dev)
        ops.reduce_scatter(out, inp, "sum")
        ops.check(wait=True)
        assert torch.equal(out, reduce_ref([x[me * n:(me + 1) * n] for x in full], 0))
        sizes = [r % 3 + 1 for r in range(W)]
        T, pre = sum(sizes), sum(sizes[:me])
        full = [payload(r, 4 * T, torch.float32, dev).view(4, T) for r in range(W)]
        inp = alloc(4, T)
        inp.copy_(full[me])
        out = torch.empty(4, sizes[me], device=dev)
        ops.reduce_scatter_v(out, inp, sizes, "sum", dim=1)
        ops.check(wait=True)
        assert torch.equal(out, reduce_ref([x[:, pre:pre + sizes[me]] for x in full], 0))

    def exchanges():
        alloc.reset()
        inp = alloc(W * 3, 5)
        inp.copy_(payload(me, W * 15, torch.float32, dev).view(-1, 5))
        out = torch.empty(W * 3, 5, device=dev)
        ops.all_to_all(out, inp)
        ops.check(wait=True)
        want = all_to_all_ref([payload(r, W * 15, torch.float32, dev).view(-1, 5) for r in range(W)],
                              [[3] * W] * W, me)
        assert torch.equal(out, want)
        send = [[(q + 2 * p) % 3 for p in range(W)] for q in range(W)]
        inp = alloc(sum(send[me]), 4, dtype=torch.int64)
        inp.copy_(payload(me, 4 * sum(send[me]), torch.int64, dev).view(-1, 4))
        recv = [send[q][me] for q in range(W)]
        out = torch.empty(sum(recv), 4, dtype=torch.int64, device=dev)
        ops.all_to_all_v(out, inp, recv, send[me])
        ops.check(wait=True)
        want = all_to_all_ref([payload(q, 4 * sum(send[q]), torch.int64, dev).view(-1, 4) for q in range(W)], send, me)
        assert torch.equal(out, want)

    def broadcasts():
        for src in range(W):
            alloc.reset()
            t = alloc(4099) if me == src else torch.empty(4099, device=dev)
            t.copy_(payload(me, 4099, torch.float32, dev))
            ops.broadcast(t, src)
            ops.check(wait=True)
            assert torch.equal(t, payload(src, 4099, torch.float32, dev)), src

    def barriers():
        for _ in range(5):
            ops.barrier()
        ops.check(wait=True)

    return cases + [("all_gather_and_v", gathers), ("reduce_scatter_and_v", scatters),
                    ("all_to_all_and_v", exchanges), ("broadcast", broadcasts), ("barrier", barriers)]


def _graph_cases(ops, alloc, W, me, dev):
    from zbccl.ops.reference import all_reduce_ref

    def replay():
        alloc.reset()
        x = alloc(8192, dtype=torch.bfloat16)
        y = torch.empty(8192, dtype=torch.bfloat16, device=dev)
        g_out = torch.empty(W * 8192, dtype=torch.bfloat16, device=dev)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            ops.all_reduce(x, out=y)  # warm: compiled before the capture
            ops.all_gather(g_out, x)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            ops.all_reduce(x, out=y)
            ops.all_gather(g_out, x)
            ops.barrier()
        for i in range(50):
            x.copy_(payload(me, 8192, torch.bfloat16, dev, salt=i))
            graph.replay()
            torch.cuda.synchronize()
            ok = torch.equal(y, all_reduce_ref([payload(r, 8192, torch.bfloat16, dev, salt=i) for r in range(W)], 0))
            assert ok and torch.equal(g_out, torch.cat([payload(r, 8192, torch.bfloat16, dev, salt=i)
                                                        for r in range(W)])), f"replay {i}"
        ops.check(wait=True)
        return "50 replays bit-exact"

    def decode_step():
        alloc.reset()
        torch.manual_seed(1234 + me)
        a = torch.randn(16, 1024, device=dev, dtype=torch.bfloat16)
        w1 = torch.randn(1024, 2048, device=dev, dtype=torch.bfloat16) / 32
        w2 = torch.randn(2048, 512, device=dev, dtype=torch.bfloat16) / 32
        h = alloc(16, 2048, dtype=torch.bfloat16)

        def step():
            torch.matmul(a, w1, out=h)
            ops.all_reduce(h)
            return h @ w2

        eager = step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            out = step()
        for _ in range(30):
            graph.replay()
        torch.cuda.synchronize()
        ops.check(wait=True)
        assert torch.equal(out, eager), "captured step differs from eager"
        return "30 replays equal eager"

    return [("graph_replay", replay), ("graph_decode_step", decode_step)]


def _timed(fn, iters: int, sync) -> float:
    for _ in range(3):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - t0) / iters


def _bench(ops, alloc, W, me, dev, port, barrier, rows):
    """Rows (rank 0's view): memcpy, our all_reduce/all_gather, torch symm_mem one-shot."""
    sync = torch.cuda.synchronize

    def together(fn, iters):
        ops.barrier()
        sync()
        barrier.wait()
        return _timed(fn, iters, sync)

    big = 64 << 20
    src = torch.empty(big, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    t = _timed(lambda: dst.copy_(src), 20, sync)
    rows.append(("memcpy", big, t, big / t, big / t))
    alloc.reset()
    x = alloc(big // 2, dtype=torch.bfloat16)
    y = alloc(big // 2, dtype=torch.bfloat16)
    for algo in ("one_shot", "two_shot"):
        t = together(lambda algo=algo: ops.all_reduce(x, out=y, algo=algo), 10)
        rows.append((f"zbccl_all_reduce_{algo}", big, t, big / t, big / t * 2 * (W - 1) / W))
    inp = alloc(big // W, dtype=torch.uint8)
    out = torch.empty(big, dtype=torch.uint8, device=dev)
    t = together(lambda: ops.all_gather(out, inp), 10)
    rows.append(("zbccl_all_gather", big, t, big / t, big / t * (W - 1) / W))
    small = [4 << 10, 16 << 10, 64 << 10]
    for n in small:
        s = alloc(n // 2, dtype=torch.bfloat16)
        t = together(lambda s=s: ops.all_reduce(s, algo="one_shot"), 200)
        rows.append(("zbccl_all_reduce_one_shot", n, t, n / t, n / t * 2 * (W - 1) / W))
    try:
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=me, world_size=W)
        group = dist.group.WORLD.group_name
        for n in small + [big]:
            buf = symm_mem.empty(n // 2, dtype=torch.bfloat16, device=dev)
            symm_mem.rendezvous(buf, group)
            buf.copy_(payload(me, n // 2, torch.bfloat16, dev))
            outb = torch.empty_like(buf)

            def one(buf=buf, outb=outb):
                torch.ops.symm_mem.one_shot_all_reduce_out(buf, "sum", group, outb)

            one()
            sync()
            dist.barrier()
            t = _timed(one, 200 if n < big else 10, sync)
            rows.append(("symm_mem_one_shot", n, t, n / t, n / t * 2 * (W - 1) / W))
    except Exception as exc:  # noqa: BLE001 - the baseline is optional
        rows.append((f"symm_mem_unavailable: {type(exc).__name__}: {str(exc)[:200]}", 0, 0.0, 0.0, 0.0))


def worker(rank, W, device, inboxes, barrier, results, bench, port):
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported in this process
    out = []
    try:
        from zbccl.errors import ZbcclTimeoutError
        from zbccl.heap import layout
        from zbccl.ops.device import DeviceOps

        dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
        if device == "cuda":
            torch.cuda.set_device(0)
            if os.environ.get("CUDA_MPS_PIPE_DIRECTORY"):  # MPS: the W launches must fit on GPU 0 together
                sms = torch.cuda.get_device_properties(0).multi_processor_count
                DeviceOps.max_blocks = max(1, min(DeviceOps.max_blocks, sms // W))
        heap = torch.zeros(HEAP if device == "cuda" else 8 << 20, dtype=torch.uint8, device=dev)
        pad = torch.zeros(layout.kernel_pad_bytes(W), dtype=torch.uint8, device=dev)
        if device == "cpu":
            heap.share_memory_()
            pad.share_memory_()
        for q in range(W):
            if q != rank:
                inboxes[q].put((rank, heap, pad))
        bufs = {rank: (heap, pad)}
        for _ in range(W - 1):
            r, h, p = inboxes[rank].get(timeout=120)
            bufs[r] = (h, p)
        transport = StandInTransport(dev, rank, bufs)
        ops = DeviceOps(rank, range(W), transport, slot=1, timeout_s=10, barrier=barrier.wait)
        alloc = Bump(heap)
        t0 = time.perf_counter()
        cases = _ops_cases(ops, alloc, W, rank, dev)
        if device == "cuda":
            cases += _graph_cases(ops, alloc, W, rank, dev)
        for name, fn in cases:
            _check(out, f"w{W}_{name}", fn)
            barrier.wait()
        late = DeviceOps(rank, range(W), transport, slot=2, timeout_s=2, barrier=barrier.wait)

        def timeout():
            if rank == W - 1:
                return "stayed away"
            try:
                late.barrier()  # raises here under the interpreter (synchronous), at check() on a GPU
                late.check(wait=True)
            except ZbcclTimeoutError as exc:
                assert exc.ranks == (W - 1,), exc.ranks
                return str(exc)[:120]
            raise AssertionError("no timeout reported")

        _check(out, f"w{W}_peer_never_arrives", timeout)
        barrier.wait()
        out.append((f"w{W}_time", True, f"{time.perf_counter() - t0:.1f}s"))
        rows = []
        if bench and device == "cuda":
            _bench(ops, alloc, W, rank, dev, port, barrier, rows)
        results.put((rank, out, rows))
        barrier.wait()  # the peers may still read this rank's buffers until every rank is done
    except BaseException:  # noqa: BLE001 - report, never hang the parent
        results.put((rank, out + [(f"w{W}_rank{rank}_crashed", False, traceback.format_exc()[-800:])], []))


def run_world(W: int, args) -> bool:
    ctx = mp.get_context("spawn")
    inboxes = [ctx.Queue() for _ in range(W)]
    barrier = ctx.Barrier(W, timeout=args.timeout)
    results = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=worker, args=(r, W, args.device, inboxes, barrier, results, args.bench, port))
             for r in range(W)]
    for p in procs:
        p.start()
    got = {}
    deadline = time.monotonic() + args.timeout
    while len(got) < W and time.monotonic() < deadline:
        try:
            r, out, rows = results.get(timeout=5)
            got[r] = (out, rows)
        except Exception:  # noqa: BLE001 - queue.Empty: poll again
            if not any(p.is_alive() for p in procs) and results.empty():
                break
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
    ok = len(got) == W
    if not ok:
        print(f"CHECK w{W}_all_ranks_reported FAIL got {sorted(got)} of {W} ranks (timeout {args.timeout}s)")
    names = {}
    for r, (out, _) in sorted(got.items()):
        for name, passed, detail in out:
            names.setdefault(name, []).append((r, passed, detail))
    for name, per in names.items():
        passed = all(p for _, p, _ in per)
        ok &= passed
        bad = [f"rank {r}: {d}" for r, p, d in per if not p]
        print(f"CHECK {name} {'PASS' if passed else 'FAIL'} {'; '.join(bad) if bad else per[0][2]}")
    if 0 in got and got[0][1]:
        print(f"# world {W}, device {torch.cuda.get_device_name(0) if args.device == 'cuda' else 'cpu'}, rank 0")
        print(f"{'op':40s} {'bytes':>10s} {'us':>10s} {'algbw_GBps':>11s} {'busbw_GBps':>11s}")
        for op, n, t, alg, bus in got[0][1]:
            print(f"{op:40s} {n:10d} {t * 1e6:10.1f} {alg / 1e9:11.1f} {bus / 1e9:11.1f}")
    sys.stdout.flush()
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args()
    ok = True
    for W in args.worlds:
        ok &= run_world(W, args)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
