"""One rank of ``zbccl bench --hosts`` (run by ``tools/netns.run_hosts`` inside a namespace host).

Order inside the ranks (every step is collective):

1. gloo joins over the host's veth (``GLOO_SOCKET_IFNAME``); ``zbccl.init`` builds the heap (the
   routed transport: shm to the host's ranks, Mooncake to the other hosts).
2. Raw Mooncake (the transport's physical limit): rank 0 alone writes from its heap into a heap
   tensor of the first rank of host 1 with ``transfer_sync_write`` (no bounds checks, no Python
   above the engine), timed as ``memcpy_solo`` is (``timing.time_calls`` on one rank) while every
   other rank blocks on the store; then a one-word write's round trip (the latency).
3. The sweep of ``runner._sweep`` (the same cells, checks, gates and timing as ``zbccl bench``):
   zbccl's own API on heap tensors and gloo on private tensors, interleaved cell by cell in the
   same processes. A cell that raises (an op zbccl does not run across hosts yet) is an error on
   every rank and the sweep goes on.
4. Inter-host bytes: for each zbccl cell that ran, one more call between two reads of every rank's
   Mooncake counters (``transport.traffic()``), summed over the ranks.
5. EP dispatch+combine, normal and low-latency (``bench/ep_hosts.hosts_case``: ``bench/ep.py``'s steps
   and gloo baseline, interleaved iteration by iteration, checked against the baseline, with the bytes
   that crossed between hosts), at each token count of ``opts["ep"]["tokens"]``.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from ..ops.hosts import settle
from .baselines import GlooImpl, op_buffers, op_numel, silence_deprecations
from .runner import Harness, ZbcclImpl, _sweep, zbccl_ops_available
from .timing import DTYPES, GlooControl, LocalControl, TimingConfig, leader_then_all, time_calls

__all__ = ["rank_main"]


def _traffic(comm) -> int:
    """Bytes this rank's remote verbs moved so far (0 where the transport counts nothing)."""
    counts = getattr(comm._ctx.heap.transport, "traffic", None)
    if counts is None:
        return 0
    got = counts()
    return int(got["written"] + got["read"])


def _raw(comm, h: Harness, opts: dict) -> dict:
    """Collective: raw Mooncake writes from rank 0 into the first rank of host 1 (see the module docstring)."""
    import zbccl

    target = opts["ranks_per_host"]
    size = max(opts["sizes"])
    buf = zbccl.empty(size, dtype=torch.uint8, comm=comm)
    buf.fill_(h.rank % 251)
    offsets = [int(x) for x in h.ctl.max([float(comm._ctx.heap.transport.offset_of(h.rank, buf))
                                           if h.rank == target else 0.0])]
    tcfg = TimingConfig(**{**opts["timing"], "gap_ms": 0.0})

    def solo() -> dict:
        t = comm._ctx.heap.transport
        remote = getattr(t, "remote", t)  # the routed transport's mooncake side
        engine, peer = remote.engine, remote.peers[target]
        out = {"sizes": {}}
        for nbytes in opts["sizes"]:
            def write(n=nbytes) -> None:
                rc = engine.write(peer.sid, buf.data_ptr(), peer.data + offsets[0], n)
                if rc != 0:
                    raise RuntimeError(f"bench --hosts: raw Mooncake write of {n} bytes failed, expected rc 0, got {rc}")
            out["sizes"][str(nbytes)] = time_calls(write, ctl=LocalControl(), sync=lambda: None, cfg=tcfg).to_dict()
        word = torch.zeros(1, dtype=torch.int64)
        pad = remote.peers[target].pad

        def signal() -> None:
            engine.write(peer.sid, word.data_ptr(), pad, 8)  # an 8-byte write: a signal's round trip
        out["word"] = time_calls(signal, ctl=LocalControl(), sync=lambda: None, cfg=tcfg).to_dict()
        return out

    return leader_then_all(h.store, "bench/hosts/raw", h.rank, solo, timeout_s=opts["raw_timeout"])


class RawExchange:
    """The transfer limit of a cell (``mc_raw``): raw Mooncake writes of exactly the bytes that must cross, in
    one round, with nothing above the engine (no headers, signals, local phase or checks).

    Every rank writes ``must_bytes(op) / (W (H-1))`` bytes of its heap input to the rank with its own local index
    on each other host (one write per such pair, all in flight at once: the fewest writes that move only what
    must cross), and a call ends once all of them landed (Mooncake TCP v2: a completed write is in the target's
    memory; the writes are awaited as the transport awaits its own); the cell's time is the slowest rank's, as
    for the ops. Any algorithm moves at least these bytes between hosts, and one that also waits for its peers'
    bytes pays at least a one-way latency more; the op's local part (its own piece's copy, the reductions) is
    left out. So this time over the op's (``mc/z``) says how close it gets to the link, and over gloo's
    (``mc/g``) whether gloo's sockets beat Mooncake's writes at the same traffic. The written bytes land in a
    region of each rank's heap that nothing reads; nothing is checked (``checked`` False: ``wrong`` is None).
    """

    name = "mc_raw"
    checked = False

    def __init__(self, comm, h: Harness, opts: dict) -> None:
        import zbccl

        from .hosts import raw_share

        self.comm, self._share = comm, raw_share
        self.world, self.per_host = h.world_size, opts["ranks_per_host"]
        t = comm._ctx.heap.transport
        self._remote = getattr(t, "remote", t)
        self._region = zbccl.empty(max(opts["sizes"]), dtype=torch.uint8, comm=comm)
        mine = [0.0] * self.world
        mine[h.rank] = float(t.offset_of(h.rank, self._region))
        offs = [int(x) for x in h.ctl.max(mine)]
        me = h.rank % self.per_host
        self._targets = [(self._remote.peers[g], offs[g]) for g in range(me, self.world, self.per_host)
                         if g // self.per_host != h.rank // self.per_host]

    def supports(self, op: str) -> bool:
        return op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        import zbccl

        return zbccl.empty(numel, dtype=dtype, comm=self.comm)  # registered memory, as RDMA needs

    def bind(self, op: str, out: torch.Tensor, inp: torch.Tensor):
        size = inp.numel() * inp.element_size()
        nbytes = self._share(op, size, self.world, self.per_host)
        engine, src = self._remote.engine, inp.data_ptr()

        def call() -> None:
            batches = [engine.submit_write(peer.sid, src, peer.data + off, nbytes) for peer, off in self._targets]
            rc = -1 if None in batches else engine._await(batches, nbytes * len(batches), None)
            if rc:
                raise RuntimeError(f"bench --hosts: raw Mooncake writes of {nbytes} bytes failed (rc {rc})")
        return call

    def sync(self) -> None:
        dist.barrier()

    def staged_bytes(self) -> int:
        return 0


def _bytes_per_op(impls: list, cells: list[dict], h: Harness) -> None:
    """Collective: ``xhost_bytes`` (summed over ranks) of one more call of every zbccl cell that ran."""
    zb = next((i for i in impls if i.name == "zbccl"), None)
    if zb is None:
        return
    for cell in cells:
        z = cell.get("zbccl")
        if not z or z.get("error"):
            continue
        numel = op_numel(cell["op"], cell["nominal"], DTYPES[cell["dtype"]].itemsize, h.world_size)
        out, inp = op_buffers(zb, cell["op"], numel, DTYPES[cell["dtype"]], h.world_size, h.rank)
        fn = zb.bind(cell["op"], out, inp)
        zb.sync()
        settle(zb.comm)  # (the last cell's writes: not this one's)
        before = _traffic(zb.comm)
        fn()
        settle(zb.comm)  # its last writes, still in flight when it returned, counted once they landed
        moved = _traffic(zb.comm) - before
        z["xhost_bytes"] = int(h.ctl.sum([float(moved)])[0])
        del out, inp


def _ep(comm, h: Harness, opts: dict) -> dict:
    """Collective: EP dispatch+combine (normal and low-latency) against the same semantics over gloo's
    all_to_all, interleaved iteration by iteration (``bench/ep_hosts.hosts_case``, one per token count);
    rank 0 gets every rank's cases (``{"cases": per rank}``), or ``{"error"}`` when a rank failed."""
    import zbccl.ep as deep_ep

    from .ep_hosts import hosts_case

    e = opts["ep"]
    cases, error, buffer = [], None, None
    try:
        buffer = deep_ep.Buffer(comm, explicitly_destroy=True)
        for tokens in e["tokens"]:
            cases.append(hosts_case(comm, buffer, tokens=tokens, hidden=e["hidden"], experts=e["experts"],
                                    topk=e["topk"], iters=e["iters"]))
    except Exception as exc:  # noqa: BLE001 - recorded; the ranks agree below (a failed rank waits for no peer)
        error = f"rank {h.rank}: {type(exc).__name__}: {exc}"
    finally:
        if buffer is not None:
            try:
                buffer.destroy()
            except Exception as exc:  # noqa: BLE001 - reported with the case's own error first
                error = error or f"rank {h.rank}: destroy: {type(exc).__name__}: {exc}"
    everyone = [None] * h.world_size
    dist.all_gather_object(everyone, {"error": error, "cases": cases})
    errors = [x["error"] for x in everyone if x["error"]]
    return {**e, "error": errors[0]} if errors else {**e, "cases": [x["cases"] for x in everyone]}


def rank_main(ctx, *, opts: dict, ifnames: list[str]) -> dict | None:
    """One rank of ``zbccl bench --hosts`` (see the module docstring); rank 0 returns the results."""
    import zbccl

    silence_deprecations()
    rank, world = ctx.rank, ctx.world_size
    os.environ["GLOO_SOCKET_IFNAME"] = ifnames[rank // opts["ranks_per_host"]]
    torch.set_num_threads(opts["threads"])
    store = ctx.store(timeout=opts["store_timeout"])
    dist.init_process_group("gloo", store=dist.PrefixStore("gloo", store), rank=rank, world_size=world,
                            timeout=timedelta(seconds=opts["zbccl_timeout"] + 240))
    comm = zbccl.init(store=dist.PrefixStore("zbccl", store), rank=rank, world_size=world,
                      heap_size=opts["heap_size"], timeout=opts["zbccl_timeout"])
    try:
        h = Harness(rank, world, store, GlooControl(), TimingConfig(**opts["timing"]), None, opts["idle_wait"])
        raw = _raw(comm, h, opts)
        zops = [op for op in zbccl_ops_available() if op in opts["ops"]]
        impls = [ZbcclImpl(comm, zops), GlooImpl(), RawExchange(comm, h, opts)]
        result = _sweep(impls, opts, h)
        _bytes_per_op(impls, result["cells"], h)
        ep = _ep(comm, h, opts) if opts["ep"] else None
        dist.barrier()
        transport = comm._ctx.heap.transport
        described = transport.describe() if hasattr(transport, "describe") else {}
    finally:
        zbccl.finalize()
        dist.destroy_process_group()
    if rank != 0:
        return None
    return {**result, "raw": raw, "ep": ep, "zbccl_ops": zops, "transport": described,
            "threads": torch.get_num_threads(), "loadavg": os.getloadavg(),
            "affinity": sorted(os.sched_getaffinity(0))}
