"""The soak: random ops for minutes, every result checked bit-exactly, resources watched.

Usage: ``zbccl soak [--world N] [--minutes M | --ops K] [--seed S] [--json] [--no-ep] [--hosts H [--netns]]``

Starts N local ranks (OS-assigned store port); each initialises zbccl and torch.distributed on the
``zbccl`` backend and runs the same seeded random sequence of ops (:mod:`zbccl.tools.soak_ops`):
all_reduce with every reduce op, all_gather (tensor and list forms, ``dim``), all_gather_v (``dim``),
reduce_scatter (``dim``) and reduce_scatter_v, all_to_all_single even and uneven, broadcast, barrier, p2p
rings and pairs, torch.distributed's reduce, gather, scatter and list forms of reduce_scatter and all_to_all,
EP normal dispatch/combine, ``all_gather_object``, sub-groups created and destroyed; through zbccl's
own API and torch.distributed, sync and ``async_op=True``; sizes from 0 up, odd ones included, six
dtypes, heap and private tensors. Each result is compared bit for bit with the plain-torch reference.

``--hosts H`` splits the ranks into H contiguous blocks, each a "host" of this machine: every rank gets
``ZBCCL_HOST_ID`` of its block and the launcher's one-off ``ZBCCL_JOB_COOKIE`` (set in the rank's own
process before ``init``), so ranks of one block share memory over shm and the others are reached through
the mooncake transport (the ``routed`` transport; ``pip install 'zbccl[internode]'``). Every op then runs
its between-hosts form. ``H`` need not divide ``N``: the blocks then differ in size by one. With ``--netns``
the hosts are real: Linux namespaces joined by veth pairs (:class:`~zbccl.tools.netns.NetnsHosts`, each host
its own network, PID and IPC namespaces; root), ``N / H`` ranks each, their host ids their own, so nothing but
the network joins two hosts; a rank's progress lines go to its host's log.

Every ``--check-every`` ops the ranks exchange their counters and resources (RSS, open descriptors,
heap bytes allocated): that is also where they agree to stop. Growth is measured from the first
checkpoint after the warm-up (the first minute, or a quarter of a shorter run) to the last one.
Exit status: 0 when no result was wrong, no op raised and no growth passed its threshold; 1 otherwise.
"""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import sys
import time

__all__ = ["run_soak", "soak_rank", "THRESHOLDS"]

#: Growth allowed from the end of the warm-up to the end, per rank. RSS is the anonymous part
#: (``RssAnon``): the heap is shared memory, and first touches of peers' pages are not a leak.
#: Heap bytes allocated move with frees still queued at a checkpoint, so both ends are the floor
#: (least value) of ``WINDOW`` checkpoints.
#: Sockets are counted apart from other descriptors: across hosts, Mooncake's TCP transport opens a connection
#: to a peer when a transfer is submitted while the open ones are busy (the liveness monitor's probe beside an
#: op's write), at a random point of a run, up to its lanes per peer; ``SOCKETS_PER_REMOTE`` of them per remote
#: rank are allowed there (a leak, a socket per op or per reconnect, passes that in any soak). On one host no
#: socket may appear.
THRESHOLDS = {"rss_anon_bytes": 64 << 20, "fds": 0, "sockets": 0, "heap_allocated_bytes": 1 << 20}
SOCKETS_PER_REMOTE = 2
WINDOW = 5


def _resources() -> dict:
    import gc

    import zbccl

    gc.collect()  # tensors in reference cycles (exception tracebacks, Works) go now, not at a random later point
    _trim()
    status = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon"):
                status[key] = int(value.split()[0]) * 1024
    stats = zbccl.memory_stats()
    fds, sockets = _descriptors()
    return {"rss_anon_bytes": status["RssAnon"], "rss_bytes": status["VmRSS"], "fds": fds, "sockets": sockets,
            "heap_allocated_bytes": stats["allocated_bytes"], "heap_bytes": stats["heap_bytes"]}


def _descriptors() -> tuple[int, int]:
    """This process's open descriptors: (not sockets, sockets)."""
    fds = sockets = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile (the listing's own descriptor)
            continue
        if target.startswith("socket:"):
            sockets += 1
        else:
            fds += 1
    return fds, sockets


def _trim() -> None:
    """Hand free malloc memory back to the OS, so RSS counts what is live, not what glibc keeps
    (its mmap threshold rises after large frees and later big blocks fragment its arenas)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _floor(samples: list[list[dict]]) -> list[dict]:
    """Per rank, the least value of each resource over ``samples`` (checkpoints)."""
    return [{k: min(s[r][k] for s in samples) for k in samples[0][r]} for r in range(len(samples[0]))]


class _Meter:
    """The checkpoints' side: the warm-up's end, and the first and last ``WINDOW`` samples of every
    rank's resources, which growth compares."""

    def __init__(self, seconds: float | None, ops: int | None, check_every: int) -> None:
        self.seconds, self.ops = seconds, ops
        self.warm = min(60.0, 0.25 * seconds) if seconds else None
        self.first = max(check_every, (ops or 0) // 4)
        self.warmup_end: tuple[float, int] | None = None
        self.head: list[list[dict]] = []
        self.tail: list[list[dict]] = []
        self.t0 = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def record(self, everyone: list[dict], done: int) -> bool:
        """Take the exchanged figures of one checkpoint; True when the run is over (for every rank)."""
        slowest = min(e["elapsed"] for e in everyone)
        sample = [e["res"] for e in everyone]
        if self.warmup_end is None and (slowest >= self.warm if self.warm is not None else done >= self.first):
            self.warmup_end = (slowest, done)
        if self.warmup_end is not None:
            if len(self.head) < WINDOW:
                self.head.append(sample)
            self.tail = (self.tail + [sample])[-WINDOW:]
        return done >= self.ops if self.ops else slowest >= self.seconds

    def growth(self) -> list[dict] | None:
        return _growth(self.head, self.tail) if self.head else None


def host_of(rank: int, world_size: int, hosts: int) -> int:
    """The host block of ``rank`` when ``world_size`` ranks are split into ``hosts`` contiguous blocks."""
    return rank * hosts // world_size


def soak_rank(*, rank: int, world_size: int, store, seed: int, seconds: float | None, ops: int | None,
              check_every: int, report_every: float, heap_size: int, ep: bool, to_stderr: bool,
              hosts: int = 1, cookie: str | None = None) -> dict:
    """One rank of the soak (collective: every rank calls it with the same arguments but its rank).

    Initialises zbccl and the ``zbccl`` torch.distributed backend over ``store``, runs ``ops`` ops
    or ``seconds`` of them, finalizes, and returns its figures: ops, counts by kind, wrong results and
    errors (described), the warm-up's end and the resource growth of every rank.
    """
    import torch.distributed as dist

    import zbccl

    from .soak_ops import Soaker

    if hosts > 1:  # this rank's own process, before init reads them (see the module docstring)
        os.environ["ZBCCL_HOST_ID"] = f"soak-host-{host_of(rank, world_size, hosts)}"
        os.environ["ZBCCL_JOB_COOKIE"] = cookie
    comm = zbccl.init(store=store, rank=rank, world_size=world_size, heap_size=heap_size)
    dist.init_process_group("zbccl", store=dist.PrefixStore("soak-pg", store), rank=rank, world_size=world_size)
    soaker = Soaker(comm, seed, ep=ep)
    stream = sys.stderr if to_stderr else sys.stdout
    meter = _Meter(seconds, ops, check_every)
    counts: dict[str, int] = {}
    wrong: list[str] = []
    errors: list[str] = []
    done, last_print = 0, 0.0
    while True:
        try:
            kind, bad = soaker.step(done)
        except Exception as exc:  # noqa: BLE001 - the soak counts every failure
            errors.append(f"rank {rank}, op #{done} ({soaker.kind}): {type(exc).__name__}: {exc}"[:500])
            print(f"[soak] error: {errors[-1]}", file=stream, flush=True)
            break
        done += 1
        counts[kind] = counts.get(kind, 0) + 1
        if bad:
            wrong.append(f"rank {rank}: {bad}"[:500])
            print(f"[soak] wrong: {wrong[-1]}", file=stream, flush=True)
        if done % check_every and done != ops:
            continue
        elapsed = meter.elapsed()
        try:
            soaker.drop_group()  # sub-groups live until the next checkpoint: the samples compare like with like
            everyone = comm.all_gather_object({"elapsed": elapsed, "wrong": len(wrong), "res": _resources()})
        except Exception as exc:  # noqa: BLE001
            errors.append(f"rank {rank}, checkpoint after op #{done}: {type(exc).__name__}: {exc}"[:500])
            break
        stop = meter.record(everyone, done)
        if rank == 0 and (stop or elapsed - last_print >= report_every):
            last_print = elapsed
            _progress(stream, elapsed, done, sum(e["wrong"] for e in everyone), meter)
        if stop:
            break
    elapsed = meter.elapsed()
    _shutdown(soaker, errors, rank)
    return {"rank": rank, "job": comm.job_id, "ops": done, "seconds": elapsed, "counts": counts, "wrong": wrong,
            "errors": errors, "warmup_end": meter.warmup_end, "growth": meter.growth(),
            "end": meter.tail[-1] if meter.tail else None}


def _netns_rank(ctx, **kwargs) -> dict:
    """:func:`soak_rank` in a rank of a namespace host (``tools/netns.run_hosts``)."""
    return soak_rank(rank=ctx.rank, world_size=ctx.world_size, store=ctx.store(), **kwargs)


def _shutdown(soaker, errors: list[str], rank: int) -> None:
    """Destroy the soak's groups and finalize; after an error, abort first (the peers, out of step with
    this rank, raise naming it at once) and skip the collective teardown of the EP buffer."""
    import torch.distributed as dist

    import zbccl

    if errors:
        zbccl.abort(errors[0])
    steps = [dist.destroy_process_group, zbccl.finalize] if errors else \
        [soaker.close, dist.destroy_process_group, zbccl.finalize]
    for step in steps:
        try:
            step()
        except Exception as exc:  # noqa: BLE001
            errors.append(f"rank {rank}, shutdown ({step.__qualname__}): {type(exc).__name__}: {exc}"[:500])
            zbccl.finalize()
            break


def _progress(stream, elapsed: float, done: int, wrong: int, meter: _Meter) -> None:
    growth = ""
    g = meter.growth()
    if g is not None:
        growth = "  growth since warm-up: rss(anon) " + "/".join(f"{x['rss_anon_bytes'] / 2**20:+.1f}" for x in g) + \
            " MiB, fds " + "/".join(f"{x['fds']:+d}" for x in g) + \
            ", sockets " + "/".join(f"{x['sockets']:+d}" for x in g) + \
            ", heap " + "/".join(f"{x['heap_allocated_bytes'] / 2**10:+.1f}" for x in g) + " KiB"
    print(f"[soak {elapsed:7.1f}s] {done} ops ({done / max(elapsed, 1e-9):.1f}/s), wrong {wrong}{growth}",
          file=stream, flush=True)


def _growth(head: list[list[dict]], tail: list[list[dict]]) -> list[dict]:
    a, b = _floor(head), _floor(tail)
    return [{k: y[k] - x[k] for k in THRESHOLDS} for x, y in zip(a, b)]


def run_soak(*, world_size: int = 2, minutes: float | None = None, ops: int | None = None, seed: int = 0,
             check_every: int = 32, report_every: float = 30.0, heap_size: int = 64 << 20, ep: bool = True,
             as_json: bool = False, rss_growth: int | None = None, hosts: int = 1, netns: bool = False) -> int:
    """Run the soak; print the summary (JSON with ``as_json``); return the exit status. ``netns``: the ``hosts``
    are namespace hosts (``hosts`` must divide ``world_size``; raises
    :class:`~zbccl.tools.netns.HostsUnavailable` where they cannot be made)."""
    from .launch import launch_local

    if (minutes is None) == (ops is None):
        raise ValueError("soak: give exactly one of minutes and ops")
    if not 1 <= hosts <= world_size:
        raise ValueError(f"soak: bad number of hosts, expected 1 to the world size ({world_size}), got {hosts}")
    if netns and (hosts < 2 or world_size % hosts):
        raise ValueError(f"soak: namespace hosts need 2 or more hosts of equal size, got {world_size} ranks on "
                         f"{hosts} hosts")
    limits = dict(THRESHOLDS, **({"rss_anon_bytes": rss_growth} if rss_growth is not None else {}))
    if hosts > 1:  # Mooncake's lanes (``THRESHOLDS``): remote ranks of the rank with the most of them
        remote = max(sum(host_of(q, world_size, hosts) != host_of(r, world_size, hosts) for q in range(world_size))
                     for r in range(world_size))
        limits["sockets"] = SOCKETS_PER_REMOTE * remote
    seconds = minutes * 60 if minutes is not None else None
    stream = sys.stderr if as_json else sys.stdout
    where = f" on {hosts} {'namespace ' if netns else ''}hosts ({', '.join(str(sum(host_of(r, world_size, hosts) == h for r in range(world_size))) for h in range(hosts))} ranks)" if hosts > 1 else ""
    print(f"zbccl soak: {world_size} local ranks{where}, {f'{minutes:g} min' if minutes else f'{ops} ops'}, "
          f"seed {seed}", file=stream, flush=True)
    timeout = (seconds or 0) + 600 + (ops or 0) * 2
    common = {"seed": seed, "seconds": seconds, "ops": ops, "check_every": check_every, "report_every": report_every,
              "heap_size": heap_size, "ep": ep, "to_stderr": as_json}
    cookie = secrets.token_hex(16) if hosts > 1 else None
    if netns:
        from .netns import NetnsHosts, run_hosts

        with NetnsHosts(hosts) as made:  # (the ranks' host ids are their namespaces': no ZBCCL_HOST_ID)
            rows = run_hosts(_netns_rank, made, world_size // hosts, timeout=timeout,
                             env={"ZBCCL_JOB_COOKIE": cookie, "OMP_NUM_THREADS": "1"}, **common)
    else:
        rows = launch_local(soak_rank, world_size, timeout=timeout, threads=1, hosts=hosts, cookie=cookie, **common)
    doc = _summary(rows, world_size=world_size, seed=seed, limits=limits)
    doc["hosts"], doc["netns"] = hosts, netns
    if as_json:
        print(json.dumps(doc, indent=1))
    else:
        _print_summary(doc)
    return 0 if doc["ok"] else 1


def _summary(rows: list[dict], *, world_size: int, seed: int, limits: dict) -> dict:
    growth = rows[0]["growth"]  # every rank computed it from the same exchanged samples
    over = [f"rank {r}: {k} grew by {v}, allowed {limits[k]}" for r, g in enumerate(growth or [])
            for k, v in g.items() if v > limits[k]]
    counts = rows[0]["counts"]  # every rank draws the same ops
    ops = min(r["ops"] for r in rows)
    seconds = max(r["seconds"] for r in rows)
    wrong = [w for r in rows for w in r["wrong"]]
    errors = [e for r in rows for e in r["errors"]]
    return {"world_size": world_size, "seed": seed, "ops": ops, "seconds": round(seconds, 1),
            "ops_per_s": round(ops / max(seconds, 1e-9), 1), "counts": counts, "wrong": len(wrong),
            "wrong_first": wrong[:10], "errors": len(errors), "errors_first": errors[:10],
            "warmup_end": ({"seconds": round(rows[0]["warmup_end"][0], 1), "ops": rows[0]["warmup_end"][1]}
                           if rows[0]["warmup_end"] else None), "end": rows[0]["end"],
            "growth": growth, "limits": limits, "growth_over_limit": over,
            "ok": not wrong and not errors and not over and growth is not None}


def _print_summary(doc: dict) -> None:
    hosts = f" over {doc['hosts']} {'namespace ' if doc.get('netns') else ''}hosts" if doc.get("hosts", 1) > 1 else ""
    print(f"\n{doc['ops']} ops in {doc['seconds']}s ({doc['ops_per_s']}/s) on {doc['world_size']} ranks{hosts}, "
          f"seed {doc['seed']}")
    print("ops by kind: " + ", ".join(f"{k} {v}" for k, v in sorted(doc["counts"].items())))
    print(f"wrong results: {doc['wrong']}    errors: {doc['errors']}")
    for line in doc["wrong_first"] + doc["errors_first"]:
        print("  " + line)
    if doc["growth"] is None:
        print("growth: not measured (the run ended before the warm-up did)")
    else:
        w = doc["warmup_end"]
        print(f"growth per rank from the warm-up's end ({w['seconds']}s, op {w['ops']}) to the end:")
        print(f"{'rank':>4} {'rss_anon_MiB':>12} {'fds':>5} {'sockets':>7} {'heap_alloc_KiB':>15}   "
              "(end: rss MiB, anon MiB, fds, sockets, heap MiB)")
        for r, (g, e) in enumerate(zip(doc["growth"], doc["end"])):
            print(f"{r:>4} {g['rss_anon_bytes'] / 2**20:>+12.1f} {g['fds']:>+5d} {g['sockets']:>+7d} "
                  f"{g['heap_allocated_bytes'] / 2**10:>+15.1f}   ({e['rss_bytes'] / 2**20:.0f}, "
                  f"{e['rss_anon_bytes'] / 2**20:.0f}, {e['fds']}, {e['sockets']}, {e['heap_bytes'] / 2**20:.0f})")
        lim = doc["limits"]
        print(f"limits: rss(anon) {lim['rss_anon_bytes'] >> 20} MiB, fds {lim['fds']}, sockets {lim['sockets']}, "
              f"heap {lim['heap_allocated_bytes'] >> 10} KiB (floors of {WINDOW} checkpoints)")
    for line in doc["growth_over_limit"]:
        print("  over the limit: " + line)
    print("result:", "OK" if doc["ok"] else "FAILED")
