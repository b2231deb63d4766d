"""``zbccl tune --hosts N [--ranks-per-host M]``: measure the inter-host choices, save them in the tuning table.

Builds ``N`` namespace hosts of ``M`` ranks on this machine (``tools/netns.py``, as ``zbccl bench --hosts``)
and times, in the same processes, each choice's candidates interleaved repetition by repetition (the
slowest rank's time of each repetition; the median over repetitions), fp32 payloads:

* ``relay`` (``M >= 2``): all_to_all and all_reduce of 4-64 KiB with relayed small steps and without;
  relayed unless the direct writes win by the margin in most cells;
* ``hier_min.all_reduce`` (``M >= 2``): flat against hierarchical at 16 KiB - 4 MiB; the threshold is the
  smallest size from which the hierarchical one wins (by the margin) at that size and every larger one
  measured, null when it never does;
* ``hier_min.all_gather`` (``M >= 2``): the same at 256 KiB - 16 MiB gathered;
* ``hier_min.broadcast`` (``M >= 2``): the same at 256 KiB - 4 MiB, from the last rank;
* ``hier_min.reduce_scatter`` (``M >= 2``): the same at 1 - 16 MiB of input;
* ``column_max`` (``M >= 2``): the hierarchical all_reduce as the host's all_reduce and one column step,
  against reduce_scatter, column step, all_gather, at 64 KiB - 1 MiB: the largest size up to which the two
  phases win at every smaller size (0: never);
* ``direct_min``: all_to_all whose pieces (what one rank sends one peer) of 256 KiB - 4 MiB go through the
  slots, or straight into the outputs: pieces over the largest size where the slots won go straight;
* ``chunk``: 1, 4 and 8 MiB on a 16 MiB all_reduce and all_to_all, each on a communicator of its own (the
  chunk sizes the mesh regions), set the way a table sets it (``ZBCCL_TUNE_FILE``).

A candidate replaces the default (``tuner.HOSTS_DEFAULTS``) only where it wins by ``MARGIN``. Every rank
decides from the same gathered times, so they agree; rank 0's result is written as the table's ``"hosts"``
section (its measurements as ``"hosts_measured"``) into ``--out`` (default: this host's table), keeping the
table's rules (``zbccl tune``'s), atomically. The namespace hosts measure this machine's veth links: on a
cluster the figures differ, and the section can be written by hand (``docs/mooncake.md``).
"""

from __future__ import annotations

import json
import os
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

__all__ = ["run_tune_hosts", "decide", "MARGIN"]

#: A candidate must beat the other by this much to count as a win (the timing noise of a few %).
MARGIN = 0.05
_KI, _MI = 1 << 10, 1 << 20


def _plan(quick: bool) -> dict:
    if quick:  # a check that the tool runs end to end, not a measurement
        return {"reps": 3, "target_s": 0.004, "relay": [4 * _KI], "hier_ar": [16 * _KI, 256 * _KI],
                "hier_ag": [256 * _KI, 1 * _MI], "hier_bc": [1 * _MI], "hier_rs": [1 * _MI], "column": [64 * _KI],
                "direct": [256 * _KI], "chunks": [1 * _MI], "chunk_size": 2 * _MI}
    return {"reps": 5, "target_s": 0.04, "relay": [4 * _KI, 16 * _KI, 64 * _KI],
            "hier_ar": [16 * _KI, 64 * _KI, 256 * _KI, 1 * _MI, 4 * _MI],
            "hier_ag": [256 * _KI, 1 * _MI, 4 * _MI, 16 * _MI], "hier_bc": [256 * _KI, 1 * _MI, 4 * _MI],
            "hier_rs": [1 * _MI, 4 * _MI, 16 * _MI],
            "column": [64 * _KI, 256 * _KI, 512 * _KI, 1 * _MI], "direct": [256 * _KI, 1 * _MI, 4 * _MI],
            "chunks": [1 * _MI, 4 * _MI, 8 * _MI], "chunk_size": 16 * _MI}


def _gather_times(comm, mine: list[list[float]]) -> list[list[float]]:
    """Every rank's ``[rep][candidate]`` seconds; the slowest rank's per cell (identical on every rank)."""
    import zbccl

    t = torch.tensor(mine, dtype=torch.float64)
    out = torch.empty((comm.world_size, *t.shape), dtype=torch.float64)
    zbccl.all_gather_into_tensor(out.view(-1), t.view(-1), comm=comm)
    return out.amax(0).tolist()


def _compare(comm, cell, setters: list, reps: int, target_s: float) -> list[float]:
    """Median seconds per call of each candidate (``setters[k]()`` selects it on this rank) of ``cell`` (a
    :class:`_Cell`), interleaved rep by rep, the slowest rank's. Each candidate's first call is checked against
    the reference first: a candidate that computes a wrong result on any rank raises on every rank."""
    iters = []
    for k, set_ in enumerate(setters):  # a checked call each, and how many calls fill target_s
        set_()
        comm.barrier()
        wrong = cell.checked()
        if _agree_max(comm, float(wrong)):
            raise AssertionError(f"tune --hosts: {cell.name}: candidate {k} computed a wrong result")
        t0 = time.perf_counter()
        cell.call()
        once = time.perf_counter() - t0
        iters.append(int(_agree_max(comm, max(1, min(200, round(target_s / max(once, 1e-6)))))))
    mine = []
    for _ in range(reps):
        row = []
        for set_, n in zip(setters, iters):
            set_()
            comm.barrier()
            t0 = time.perf_counter()
            for _ in range(n):
                cell.call()
            row.append((time.perf_counter() - t0) / n)
        mine.append(row)
    slow = _gather_times(comm, mine)
    return [statistics.median(r[k] for r in slow) for k in range(len(setters))]


def _payload(rank: int, n: int) -> torch.Tensor:
    """Small integers named by their source (exact in fp32 through any sum order)."""
    return ((torch.arange(n, dtype=torch.int64) * 7 + 13 * rank) % 251).to(torch.float32)


class _Cell:
    """One op at one size on heap tensors: ``call()`` runs it; ``checked()`` runs it from fresh inputs and says
    whether this rank's result is wrong (against the result computed here from every rank's payload)."""

    def __init__(self, comm, op: str, nbytes: int) -> None:
        import zbccl

        W, me = comm.world_size, comm.rank
        self.name = f"{op} of {nbytes} bytes"
        n = max(W, nbytes // 4 // W * W)
        if op == "all_gather":
            n = max(1, nbytes // 4 // W)
        self.x = zbccl.empty((n,), dtype=torch.float32, comm=comm)
        self.x0 = _payload(me, n)
        ins = [_payload(r, n) for r in range(W)]
        if op == "all_reduce":
            self.out, self.want = self.x, torch.stack(ins).sum(0)
            self.call = lambda: zbccl.all_reduce(self.x, comm=comm)
        elif op == "reduce_scatter":
            self.out = zbccl.empty((n // W,), dtype=torch.float32, comm=comm)
            self.want = torch.stack(ins).sum(0).view(W, -1)[me]
            self.call = lambda: zbccl.reduce_scatter_tensor(self.out, self.x, comm=comm)
        elif op == "broadcast":  # from the last rank (another host than rank 0's, another local index)
            self.out, self.want = self.x, ins[W - 1]
            self.call = lambda: zbccl.broadcast(self.x, W - 1, comm=comm)
        elif op == "all_gather":
            self.out = zbccl.empty((W * n,), dtype=torch.float32, comm=comm)
            self.want = torch.cat(ins)
            self.call = lambda: zbccl.all_gather_into_tensor(self.out, self.x, comm=comm)
        else:
            self.out = zbccl.empty((n,), dtype=torch.float32, comm=comm)
            self.want = torch.cat([i.view(W, -1)[me] for i in ins])
            self.call = lambda: zbccl.all_to_all_single(self.out, self.x, comm=comm)
        self.x.copy_(self.x0)

    def checked(self) -> bool:
        self.x.copy_(self.x0)
        if self.out is not self.x:
            self.out.fill_(-1)
        self.call()
        return not torch.equal(self.out, self.want)


def _agree_max(comm, value: float) -> float:
    import zbccl

    t = torch.tensor([float(value)], dtype=torch.float64)
    zbccl.all_reduce(t, "max", comm=comm)
    return float(t.item())


def decide(measured: dict, defaults: dict) -> dict:
    """The ``"hosts"`` section from ``measured`` (:func:`_rank`'s: per choice, ``[[size, base_s, alt_s, op],
    ...]`` rows, ascending sizes per op); choices not measured keep ``defaults``. Pure: the tests check its
    rules."""
    win = lambda row: row[2] < row[1] * (1 - MARGIN)  # noqa: E731 - the alternative beats the base
    out = {"hier_min": dict(defaults["hier_min"])}
    rows = measured.get("relay")  # base: relayed, alt: direct writes
    if rows:
        out["relay"] = not sum(map(win, rows)) * 2 > len(rows)
    for op in defaults["hier_min"]:
        rows = measured.get(f"hier_{op}")  # base: flat, alt: hierarchical
        if rows:
            start = None
            for row in reversed(rows):
                if not win(row):
                    break
                start = row[0]
            out["hier_min"][op] = start
    rows = measured.get("column")  # base: three phases, alt: two
    if rows:
        most = 0
        for row in rows:
            if not win(row):
                break
            most = row[0]
        out["column_max"] = most
    rows = measured.get("direct")  # base: the slots, alt: straight into the outputs (sizes: piece bytes)
    if rows:
        lost = [row[0] for row in rows if not win(row)]
        out["direct_min"] = max(lost) if lost else rows[0][0] // 2
    chunks = measured.get("chunk")  # [[chunk, seconds], ...]
    if chunks:
        base = next((s for c, s in chunks if c == defaults["chunk"]), None)
        best_c, best_s = min(chunks, key=lambda cs: cs[1])
        out["chunk"] = best_c if base is None or win([best_c, base, best_s]) else defaults["chunk"]
    return out


def _rank(ctx, *, plan: dict, heap_size: int, op_timeout: float, tables: str) -> dict | None:
    """One rank: every measurement of the module docstring; rank 0 returns ``{"measured", "hosts"}``."""
    import zbccl
    from zbccl.ops.tuner import HOSTS_DEFAULTS

    torch.set_num_threads(1)
    rank, world = ctx.rank, ctx.world_size
    os.environ["ZBCCL_TUNE_FILE"] = _table(tables, rank, "defaults", {})  # the defaults, measured
    comm = zbccl.init(store=ctx.store(timeout=op_timeout), rank=rank, world_size=world, heap_size=heap_size,
                      timeout=op_timeout)
    measured: dict = {}
    reps, target = plan["reps"], plan["target_s"]
    never, always = 1 << 62, 0
    try:
        zbccl.all_reduce(torch.zeros(4), comm=comm)  # sets up the inter-host state
        h = comm.device_state["hosts"]

        def setter(**kw):
            def set_():
                for key, value in kw.items():
                    if key == "relay":
                        h.world.set_relays(value)
                    elif key == "direct_min":
                        h.direct_min = value
                    elif key in HOSTS_DEFAULTS["hier_min"]:
                        h.tune["hier_min"][key] = value
                    else:
                        h.tune[key] = value
            return set_

        def rows(key, ops, sizes, base, alt, scale=1):
            measured[key] = [[size, *_compare(comm, _Cell(comm, op, size * scale), [base, alt], reps, target), op]
                             for op in ops for size in sizes]

        if any(r is not None for r in h.world.relays):
            rows("relay", ("all_to_all", "all_reduce"), plan["relay"], setter(relay=True), setter(relay=False))
            setter(relay=HOSTS_DEFAULTS["relay"])()
        if h.regular:
            rows("hier_all_reduce", ("all_reduce",), plan["hier_ar"], setter(all_reduce=None),
                 setter(all_reduce=always))
            rows("hier_all_gather", ("all_gather",), plan["hier_ag"], setter(all_gather=None),
                 setter(all_gather=always))
            rows("hier_broadcast", ("broadcast",), plan["hier_bc"], setter(broadcast=None), setter(broadcast=always))
            rows("hier_reduce_scatter", ("reduce_scatter",), plan["hier_rs"], setter(reduce_scatter=None),
                 setter(reduce_scatter=always))
            rows("column", ("all_reduce",), plan["column"], setter(all_reduce=always, column_max=0),
                 setter(all_reduce=always, column_max=never))
            setter(**HOSTS_DEFAULTS["hier_min"], column_max=HOSTS_DEFAULTS["column_max"])()
        rows("direct", ("all_to_all",), plan["direct"], setter(direct_min=never), setter(direct_min=always),
             scale=world)  # sizes: the pieces one rank sends one peer
        setter(direct_min=HOSTS_DEFAULTS["direct_min"])()
        measured["chunk"] = _chunks(comm, plan, tables, rank, reps, target)
    finally:
        zbccl.finalize()
    if rank != 0:
        return None
    return {"measured": measured, "hosts": decide(measured, HOSTS_DEFAULTS)}


def _table(tables: str, rank: int, name: str, hosts: dict) -> str:
    """A tuning file of this rank setting ``hosts``; its path."""
    path = os.path.join(tables, f"rank{rank}-{name}.json")
    Path(path).write_text(json.dumps({"rules": {}, "hosts": hosts}))
    return path


def _chunks(comm, plan: dict, tables: str, rank: int, reps: int, target: float) -> list[list[float]]:
    """``[[chunk, seconds of a plan["chunk_size"] all_reduce and all_to_all], ...]``: one communicator per
    chunk, made with that chunk in its ranks' tables (rank 0's is the one used), all alive at once so that
    their cells are interleaved rep by rep."""
    groups, cells = [], []
    try:
        for chunk in plan["chunks"]:
            os.environ["ZBCCL_TUNE_FILE"] = _table(tables, rank, f"chunk{chunk}", {"chunk": chunk})
            group = comm.new_group(list(range(comm.world_size)))
            groups.append(group)
            cells.append((_Cell(group, "all_reduce", plan["chunk_size"]), _Cell(group, "all_to_all",
                                                                                 plan["chunk_size"])))
            cells[-1][0].checked()  # (sets up the group's state with its chunk)
        both = _Both(cells)
        times = _compare(comm, both, [both.select(k) for k in range(len(cells))], reps, target)
        return [[g.device_state["hosts"].chunk, t] for g, t in zip(groups, times)]
    finally:
        cells.clear()
        for group in groups:
            group.destroy()


class _Both:
    """The chunk cells as one :class:`_Cell`: an all_reduce and an all_to_all on the selected communicator."""

    def __init__(self, cells: list) -> None:
        self.cells, self.k, self.name = cells, 0, "the chunk's all_reduce and all_to_all"

    def select(self, k: int):
        def set_():
            self.k = k
        return set_

    def call(self) -> None:
        for cell in self.cells[self.k]:
            cell.call()

    def checked(self) -> bool:
        return any([cell.checked() for cell in self.cells[self.k]])


def run_tune_hosts(*, hosts: int = 2, ranks_per_host: int = 2, quick: bool = False, out: Path | None = None,
                   timeout: float = 1800.0, own_cores: bool = False) -> Path:
    """Measure between ``hosts`` namespace hosts of ``ranks_per_host`` ranks (``own_cores``: each on its own
    cores, ``NetnsHosts(own_cores=True)``), print the figures and the choices, save the ``"hosts"`` section
    into ``out`` (None: this host's table); returns its path. Raises
    :class:`~zbccl.tools.netns.HostsUnavailable` (saying why) where namespace hosts cannot be made."""
    from zbccl.heap.transports.mooncake import missing_reason
    from zbccl.ops.tuner import read_file, table_path

    from .netns import HostsUnavailable, NetnsHosts, hosts_skip_reason, run_hosts
    from .tune import write_table

    if not 2 <= hosts <= 8 or not 1 <= ranks_per_host <= 4:
        raise ValueError(f"tune --hosts: expected 2..8 hosts of 1..4 ranks, got {hosts} x {ranks_per_host}")
    reason = hosts_skip_reason() or missing_reason()
    if reason:
        raise HostsUnavailable(f"tune --hosts: cannot run between namespace hosts here: {reason}")
    plan = _plan(quick)
    world = hosts * ranks_per_host
    # the mesh regions of a chunk (two meshes: 2 (world + hosts) slots, a quarter of the heap at most:
    # tuner.hosts_chunk), and the buffers of the largest cells
    largest = max(plan["chunk_size"], max(plan["hier_ag"]), max(plan["hier_rs"]), max(plan["direct"]) * world)
    heap = 4 * 2 * (world + hosts) * max(plan["chunks"]) + 4 * largest + (64 << 20)
    print(f"zbccl tune --hosts: {hosts} namespace hosts x {ranks_per_host} rank(s){' (quick)' if quick else ''}",
          file=sys.stderr, flush=True)
    env = {"ZBCCL_JOB_COOKIE": os.environ.get("ZBCCL_JOB_COOKIE") or secrets.token_hex(16)}
    with tempfile.TemporaryDirectory(prefix="zbccl-tune-hosts-") as tables:
        os.chmod(tables, 0o755)  # the ranks run as this user in other namespaces: they write their tables here
        with NetnsHosts(hosts, own_cores=own_cores) as made:
            cores = made.cores
            res = run_hosts(_rank, made, ranks_per_host, timeout=timeout, env=env, plan=plan, heap_size=heap,
                            op_timeout=120.0, tables=tables)
    result = res[0]
    for line in _report(result):
        print(line)
    path = Path(out) if out else table_path()
    table = read_file(path) if path.is_file() else {"rules": {}}
    table["hosts"] = result["hosts"]
    table["hosts_measured"] = {"hosts": hosts, "ranks_per_host": ranks_per_host, "cores": cores, **result["measured"],
                               "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    write_table(table, path)
    print(f"saved {path}")
    return path


def _report(result: dict) -> list[str]:
    names = {"relay": ("relayed", "direct"), "hier_all_reduce": ("flat", "hierarchical"),
             "hier_all_gather": ("flat", "hierarchical"), "hier_broadcast": ("flat", "hierarchical"),
             "hier_reduce_scatter": ("flat", "hierarchical"),
             "column": ("three phases", "two phases"),
             "direct": ("slots", "straight")}
    lines = []
    for key, (base, alt) in names.items():
        for size, b, a, op in result["measured"].get(key, []):
            lines.append(f"  {key:<16} {op:<11} {size:>10} B  {base} {b * 1e6:9.1f} us  {alt} {a * 1e6:9.1f} us")
    for chunk, s in result["measured"].get("chunk", []):
        lines.append(f"  {'chunk':<16} {'ar+a2a':<11} {chunk:>10} B  {s * 1e6:9.1f} us")
    lines.append(f"hosts: {json.dumps(result['hosts'])}")
    return lines
