"""``zbccl bench --hosts N [--ranks-per-host M]``: the collectives between namespace hosts, against gloo.

Builds ``N`` hosts out of Linux namespaces on this machine (``tools/netns.py``: a bridge, a veth pair
per host, own network/PID/IPC namespaces; root), starts ``M`` ranks in each, and runs
``hosts_rank.rank_main`` in them: raw Mooncake writes (the transport's physical limit), then the same
sweep as ``zbccl bench`` (zbccl's own API and gloo, ``GLOO_SOCKET_IFNAME`` set to each host's veth,
interleaved cell by cell in the same processes, every cell checked), the inter-host bytes of one call
of each zbccl cell (counted by the Mooncake engines) against a flat ring's, and EP dispatch+combine.

Inter-host bytes (``xhost``: what every rank's remote verbs moved for one call, summed over ranks,
signals included) are compared with two references, for a per-rank input of ``S`` bytes over ``W``
ranks on ``H`` hosts of ``M`` ranks (ranks numbered host by host):

* ``ring``: a flat ring over the ranks in rank order, ``H`` of whose ``W`` edges cross hosts, each
  carrying ``2(W-1)/W S`` (all_reduce), ``(W-1) S`` (all_gather), ``(W-1)/W S`` (reduce_scatter); for
  all_to_all the flat pairwise exchange, ``(W-M) S`` in all; for broadcast a chain, ``(H-1) S``.
* ``must``: the least any algorithm must move between hosts: ``2(H-1) S`` (all_reduce: every host's
  partial sum out and the total back), ``W(H-1) S`` (all_gather: each piece to each other host once),
  ``H(W-M) S/W`` (reduce_scatter), ``(W-M) S`` (all_to_all), ``(H-1) S`` (broadcast).
  ``xGB/s`` = must / H / time: the rate at which each host's link carried what had to cross, to
  compare with the raw Mooncake bandwidth (one writer, one link).

``mc_raw`` (``hosts_rank.RawExchange``), timed in every cell after zbccl and gloo: raw Mooncake writes of
only ``must`` bytes, every rank to the rank with its local index on each other host, all in flight at once:
the transfer limit of the cell's traffic on these links (every writer and both directions at once, unlike
the one-writer raw rate above).
"""

from __future__ import annotations

import os
import secrets
import sys
import time
from typing import IO

from .baselines import OPS

__all__ = ["HOST_OPS", "run_hosts_bench", "ring_bytes", "must_bytes", "raw_share", "format_hosts_report"]

#: The ops the issue asks for between hosts (broadcast can be added with ``--ops``).
HOST_OPS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def ring_bytes(op: str, size: int, world: int, per_host: int) -> int:
    """Bytes a flat ring (pairwise exchange for all_to_all, a chain for broadcast) moves between hosts."""
    hosts = world // per_host
    if hosts < 2:
        return 0
    edge = {"all_reduce": 2 * (world - 1) * size / world, "all_gather": (world - 1) * size,
            "reduce_scatter": (world - 1) * size / world}
    if op in edge:
        return int(hosts * edge[op])
    if op == "all_to_all":
        return (world - per_host) * size
    if op == "broadcast":
        return (hosts - 1) * size
    raise ValueError(f"ring_bytes: unknown op, expected one of {list(OPS)}, got {op!r}")


def must_bytes(op: str, size: int, world: int, per_host: int) -> int:
    """The least bytes any algorithm must move between hosts for ``op`` (see the module docstring)."""
    hosts = world // per_host
    table = {"all_reduce": 2 * (hosts - 1) * size, "all_gather": world * (hosts - 1) * size,
             "reduce_scatter": hosts * (world - per_host) * size // world, "all_to_all": (world - per_host) * size,
             "broadcast": (hosts - 1) * size}
    if op not in table:
        raise ValueError(f"must_bytes: unknown op, expected one of {list(OPS)}, got {op!r}")
    return table[op]


def raw_share(op: str, size: int, world: int, per_host: int) -> int:
    """Bytes of ``mc_raw``'s one write from each rank to each rank with its local index on another host: its
    share of :func:`must_bytes` (``W (H-1)`` such writes in all)."""
    hosts = world // per_host
    return must_bytes(op, size, world, per_host) // (world * (hosts - 1)) if hosts > 1 else 0


def _options(hosts: int, per_host: int, ops, dtypes, min_size, max_size, smoke: bool, quick: bool,
             idle_wait: float | None, ep: bool, threads: int | None = None) -> dict:
    from ..env import parse_size
    from ..tools.launch import rank_threads
    from .runner import size_ladder
    from .timing import DTYPES, TimingConfig

    ops, dtypes = list(ops), list(dtypes)
    for kind, given, known in (("op", ops, OPS), ("dtype", dtypes, tuple(DTYPES))):
        bad = [x for x in given if x not in known]
        if bad:
            raise ValueError(f"bench --hosts: unknown {kind} {bad}, expected some of {list(known)}")
    if not 2 <= hosts <= 8 or not 1 <= per_host <= 4 or hosts * per_host > 16:
        raise ValueError(f"bench --hosts: expected 2..8 hosts of 1..4 ranks (at most 16 ranks), got {hosts} x "
                         f"{per_host}")
    world = hosts * per_host
    if smoke:
        sizes = size_ladder(parse_size(min_size), min(parse_size(max_size), 64 << 10), factor=16, limit=2)
        tcfg = TimingConfig(target_s=0.005, reps=3, warmup=1, cap_s=0.5)
    elif quick:
        sizes = size_ladder(parse_size(min_size), parse_size(max_size), factor=16, limit=4)
        tcfg = TimingConfig(target_s=0.02, reps=3, warmup=1, cap_s=2.0)
    else:
        sizes = size_ladder(parse_size(min_size), parse_size(max_size), factor=4)
        tcfg = TimingConfig(target_s=0.1, reps=5, warmup=1, cap_s=6.0)
    ep_shape = {"tokens": [32], "hidden": 256, "experts": 4 * world, "topk": 2, "iters": 3} if smoke else \
        {"tokens": [32, 128, 512], "hidden": 2048, "experts": 8 * world, "topk": 4, "iters": 30}
    return {"ops": ops, "dtypes": dtypes, "sizes": sizes, "hosts": hosts, "ranks_per_host": per_host,
            "timing": {k: getattr(tcfg, k) for k in ("target_s", "reps", "warmup", "cap_s", "max_iters", "gap_ms")},
            "idle_wait": (0.0 if smoke or quick else 5.0) if idle_wait is None else float(idle_wait),
            "threads": threads or rank_threads(world), "ep": ep_shape if ep else None, "progress": False,
            "heap_size": (world + 3) * max(sizes) + (32 << 20), "zbccl_timeout": 120.0, "store_timeout": 600.0,
            "raw_timeout": 600.0}


def run_hosts_bench(*, hosts: int = 2, ranks_per_host: int = 1, ops=HOST_OPS, dtypes=("fp32", "bf16"),
                    min_size: int | str = "4K", max_size: int | str = "64M", smoke: bool = False,
                    quick: bool = False, idle_wait: float | None = None, ep: bool = True,
                    json_path: str | None = None, timeout: float | None = None, progress: bool = True,
                    out: IO[str] | None = None, threads: int | None = None, own_cores: bool = False) -> dict:
    """Run the benchmark between ``hosts`` namespace hosts of ``ranks_per_host`` ranks; print the report to
    ``out`` (None: stdout), write ``json_path``; return the results document. ``threads``: torch's intra-op
    threads per rank (None: this machine's cores over the ranks, as a launcher sets them). ``own_cores``: each
    host gets its own cores (``NetnsHosts(own_cores=True)``; the report says which, or that they were shared).

    Raises :class:`~zbccl.tools.netns.HostsUnavailable` (saying why) where namespace hosts cannot be made
    (not root, no iproute2/util-linux), or Mooncake is not installed; ``ValueError`` for bad options.
    """
    from ..heap.transports.mooncake import missing_reason
    from ..tools.netns import HostsUnavailable, NetnsHosts, hosts_skip_reason, run_hosts
    from . import report
    from .hosts_rank import rank_main

    out = out or sys.stdout
    opts = _options(hosts, ranks_per_host, ops, dtypes, min_size, max_size, smoke, quick, idle_wait, ep, threads)
    reason = hosts_skip_reason() or missing_reason()
    if reason:
        raise HostsUnavailable(f"bench --hosts: cannot run between namespace hosts here: {reason}")
    n_cells = len(opts["ops"]) * len(opts["dtypes"]) * len(opts["sizes"])
    budget = timeout or 240 + n_cells * (10 if smoke else 60) + len(opts["ops"]) * opts["idle_wait"]
    if progress:
        print(f"zbccl bench --hosts: {hosts} namespace hosts x {ranks_per_host} rank(s), {n_cells} cells against "
              f"gloo{' (smoke)' if smoke else ' (quick)' if quick else ''}; starting the hosts ...", file=sys.stderr,
              flush=True)
    env = {"ZBCCL_JOB_COOKIE": os.environ.get("ZBCCL_JOB_COOKIE") or secrets.token_hex(16)}
    t0 = time.perf_counter()
    load0 = os.getloadavg()
    with NetnsHosts(hosts, own_cores=own_cores) as made:
        ifnames = [made.ifname(i) for i in range(hosts)]
        results = run_hosts(rank_main, made, ranks_per_host, timeout=budget, env=env, opts=opts, ifnames=ifnames)[0]
    world = hosts * ranks_per_host
    doc = {"machine": report.machine_info(world_size=world, threads=results["threads"]),
           "options": opts, "hosts": {"hosts": hosts, "ranks_per_host": ranks_per_host,
                                      "transport": results["transport"], "cores": made.cores,
                                      "rank0_affinity": results["affinity"]},
           "loadavg": {"start": list(load0), "ranks_end": results["loadavg"], "end": list(os.getloadavg())},
           **{k: results[k] for k in ("cells", "gates", "host_state", "regate_s", "zbccl_ops", "raw", "ep")},
           "memcpy": None, "overheads": None, "vllm": None, "mpi": None}
    doc["wall_s"] = round(time.perf_counter() - t0, 1)
    for line in format_hosts_report(doc):
        print(line, file=out)
    if json_path:
        report.write_json(doc, json_path)
        print(f"wrote {json_path}", file=out)
    return doc


def _us(timing: dict | None) -> float | None:
    return timing["stats"]["median"] if timing else None


def _raw_gbps(doc: dict, size: int) -> float | None:
    """The raw Mooncake write bandwidth at ``size`` (the nearest measured size at or below it)."""
    sizes = (doc.get("raw") or {}).get("sizes") or {}
    best = max((int(s) for s in sizes if int(s) <= size), default=None)
    return best / _us(sizes[str(best)]) / 1e3 if best else None


def _hosts_row(cell: dict, doc: dict) -> str:
    from .report import _num, _times

    world, per_host = doc["machine"]["world_size"], doc["hosts"]["ranks_per_host"]
    z, g = cell.get("zbccl") or {}, cell.get("gloo") or {}
    zt, gt = _us(z.get("timing")), _us(g.get("timing"))
    size, op = cell["size"], cell["op"]
    ring, must = ring_bytes(op, size, world, per_host), must_bytes(op, size, world, per_host)
    x = z.get("xhost_bytes")
    xgbps = must / (world // per_host) / zt / 1e3 if zt else None
    raw = _raw_gbps(doc, size)
    zw = "ERR" if z.get("error") else str(z.get("wrong", "-"))
    gw = "ERR" if g.get("error") else str(g.get("wrong", "-"))
    spread = f"{z['timing']['stats']['min']:.0f}..{z['timing']['stats']['max']:.0f}" if zt else "-"
    gspread = f"{g['timing']['stats']['min']:.0f}..{g['timing']['stats']['max']:.0f}" if gt else "-"
    m = cell.get("mc_raw") or {}
    mt = _us(m.get("timing"))
    mc = f"{'ERR':>9} {'-':>5} {'-':>5}" if m.get("error") else \
        f"{_num(mt, 9, 1)} {_num(mt / zt if mt and zt else None, 5)} {_num(mt / gt if mt and gt else None, 5)}"
    return (f"{size:>10} {cell['dtype']:>5} {_num(zt, 9, 1)} {spread:>15} {zw:>6} | {_num(gt, 9, 1)} {gspread:>15} "
            f"{gw:>6} {_times(gt / zt if gt and zt else None, 7)} | {x if x is not None else '-':>10} "
            f"{ring:>10} {_num(x / ring if x is not None and ring else None, 6)} {must:>10} | {_num(xgbps, 6)} "
            f"{_num(raw, 6)} {_num(xgbps / raw if xgbps and raw else None, 6)} | {mc}")


def ep_rows(ep: dict | None, label: str) -> list[dict]:
    """The EP table's rows (``bench/ep_hosts.summarise``), [] without EP or after an error."""
    if not ep or ep.get("error"):
        return []
    from .ep_hosts import summarise

    return summarise(ep["cases"], label)


def _ep_lines(ep: dict | None, label: str) -> list[str]:
    if not ep:
        return []
    head = [f"# EP dispatch+combine {label}: hidden {ep['hidden']} bf16, {ep['experts']} experts, top-{ep['topk']}, "
            f"{ep['iters']} iterations interleaved with gloo (median of the slowest rank)"]
    if ep.get("error"):
        return ["", *head, f"zbccl: ERR ({ep['error']})"]
    cols = ("tokens", "step_us", "gloo_us", "speedup", "wrong", "ll_us", "ll_gloo_us", "ll_speedup", "ll_wrong",
            "crossed_KiB", "flat_KiB")
    rows = [" ".join(f"{r[c]:>11.1f}" if isinstance(r[c], float) else f"{r[c]!s:>11}" for c in cols)
            for r in ep_rows(ep, label)]
    return ["", *head, " ".join(f"{c:>11}" for c in cols), *rows]


def format_hosts_report(doc: dict) -> list[str]:
    """The report's lines: header, raw Mooncake, one table per (op, dtype), EP, summary."""
    from .report import _summary

    m, hs, o = doc["machine"], doc["hosts"], doc["options"]
    la = doc["loadavg"]
    lines = [f"zbccl bench --hosts: {hs['hosts']} namespace hosts x {hs['ranks_per_host']} rank(s); {m['cpu_model']}, "
             f"{m['cores']} cores; torch {m['torch']}, zbccl {m['zbccl']}; {m['threads']} thread(s)/rank",
             f"transport: {hs['transport']}",
             "cores: " + ("every host on all of this machine's" if not any(hs.get("cores") or ()) else
                          "; ".join(f"host {i} on {c}" for i, c in enumerate(hs["cores"]))),
             f"load average (1/5/15 min): start {la['start'][0]:.2f}/{la['start'][1]:.2f}/{la['start'][2]:.2f}, "
             f"end {la['end'][0]:.2f}/{la['end'][1]:.2f}/{la['end'][2]:.2f}", ""]
    raw = doc.get("raw") or {}
    if raw.get("error"):
        lines.append(f"raw mooncake: {raw['error']}")
    elif raw:
        lines.append("# raw Mooncake transfer_sync_write, rank 0 -> first rank of host 1 (the others idle)")
        lines.append(f"{'size':>10} {'time_us':>9} {'min':>9} {'max':>9} {'GB/s':>7}")
        for s, t in sorted(raw["sizes"].items(), key=lambda kv: int(kv[0])):
            st = t["stats"]
            lines.append(f"{int(s):>10} {st['median']:>9.1f} {st['min']:>9.1f} {st['max']:>9.1f} "
                         f"{int(s) / st['median'] / 1e3:>7.3f}")
        w = raw["word"]["stats"]
        lines.append(f"one 8-byte write (a signal): {w['median']:.1f} µs (min {w['min']:.1f}, max {w['max']:.1f})")
    head = (f"{'size':>10} {'dtype':>5} {'zbccl_us':>9} {'spread':>15} {'#wrong':>6} | {'gloo_us':>9} {'spread':>15} "
            f"{'#wrong':>6} {'speedup':>7} | {'xhost_B':>10} {'ring_B':>10} {'x/ring':>6} {'must_B':>10} | "
            f"{'xGB/s':>6} {'rawGB/s':>6} {'x/raw':>6} | {'mc_us':>9} {'mc/z':>5} {'mc/g':>5}")
    for op in o["ops"]:
        for dtype in o["dtypes"]:
            lines += ["", f"# {op} {dtype}   {hs['hosts']}x{hs['ranks_per_host']}", head]
            lines += [_hosts_row(c, doc) for c in doc["cells"] if c["op"] == op and c["dtype"] == dtype]
    lines += _ep_lines(doc.get("ep"), f"{hs['hosts']}x{hs['ranks_per_host']}")
    lines += ["", *_summary(doc),
              "time: median over repetitions of the slowest rank's µs per call (spread: min..max over repetitions); "
              "speedup = gloo_us / zbccl_us",
              "xhost_B: bytes every rank's Mooncake engine moved for one call, summed; ring_B: a flat ring's "
              "(pairwise for all_to_all); must_B: the least that must cross; xGB/s = must_B / hosts / time",
              "mc_us: raw Mooncake writes of only must_B, one per pair of ranks with the same local index on two "
              "hosts, all at once (no protocol; timed in the same cell); mc/z, mc/g: mc_us over zbccl's and gloo's "
              "time (mc/g > 1: gloo beats the raw engine at the same traffic)",
              f"run took {doc['wall_s']:.0f} s"]
    return lines
