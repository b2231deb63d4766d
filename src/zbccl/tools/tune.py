"""``zbccl tune``: measure this machine and save the algorithm table every rank will load.

Usage: ``zbccl tune [--world-size 2,4] [--max-size 64M] [--out PATH]``

For each op with more than one algorithm, each world size and each message
size (4 KiB to ``--max-size``, x4 steps, bf16), every algorithm is timed in
the same world (median of 5 repetitions, slowest rank per repetition); the
fastest wins if it beats the default by 5% (less is noise), and for large
twoshot all_reduce the pipelining chunk is tuned too. Neighbouring sizes with
the same choice are merged into ``[max_bytes, algorithm(, chunk)]`` rules. The table goes to
``ZBCCL_CACHE_DIR/tuning/<host>.json`` (or ``--out`` / ``ZBCCL_TUNE_FILE``),
keyed by world size, keeping the ``"hosts"`` section ``zbccl tune --hosts``
(``tools/tune_hosts.py``) wrote there; a communicator uses rank 0's copy, so
all ranks agree.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

__all__ = ["run_tune", "write_table"]

_TUNED_OPS = ("all_reduce", "all_gather", "all_to_all")
# Another algorithm must beat the default by this much to be chosen (timing noise is a few %).
_MARGIN = 0.05
_CHUNKS = (256 << 10, 1 << 20, 4 << 20)


def _time_op(comm, op: str, nbytes: int, algo: str, chunk: int | None = None) -> float:
    import zbccl
    from zbccl.ops.tuner import force_algorithm

    W = comm.world_size
    n = max(1, nbytes // 2)
    x = zbccl.zeros(n, dtype=torch.bfloat16)
    out = zbccl.zeros(n * W, dtype=torch.bfloat16) if op == "all_gather" else None
    if op == "all_to_all":
        n = max(W, n // W * W)
        x = zbccl.zeros(n, dtype=torch.bfloat16)
        out = zbccl.zeros(n, dtype=torch.bfloat16)
    call = {
        "all_reduce": lambda: zbccl.all_reduce(x),
        "all_gather": lambda: zbccl.all_gather_into_tensor(out, x),
        "all_to_all": lambda: zbccl.all_to_all_single(out, x),
    }[op]
    force_algorithm(comm, op, algo)
    if chunk is not None:
        from zbccl.ops.channel import channel_of
        from zbccl.ops.tuner import table_for

        ch = channel_of(comm)
        table_for(ch).rules[op] = {"*": [[-1, algo, chunk]]}
        ch.forget_plans()
    call()
    iters = max(3, min(1000, int(5e7 // max(nbytes, 4096))))
    reps = []
    for _ in range(5):
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            call()
        reps.append((time.perf_counter() - t0) / iters)
    # every rank must use the slowest rank's time to decide the same way
    slowest = [max(col) for col in zip(*comm.all_gather_object(reps))]
    return statistics.median(slowest)


def _rank(*, rank: int, world_size: int, store, sizes: list[int]) -> dict:
    import zbccl
    from zbccl.ops.tuner import OP_ALGOS

    comm = zbccl.init(store=store, rank=rank, world_size=world_size, heap_size=max(sizes) * (world_size + 2) + (64 << 20))
    try:
        results: dict[str, list] = {}
        for op in _TUNED_OPS:
            rows = []
            for nbytes in sizes:
                times = {a: _time_op(comm, op, nbytes, a) for a in OP_ALGOS[op]}
                default = OP_ALGOS[op][0]
                best = min(times, key=times.get)
                if times[best] > times[default] * (1 - _MARGIN):
                    best = default
                row = [nbytes, best, {a: t * 1e6 for a, t in times.items()}]
                if op == "all_reduce" and best == "twoshot" and nbytes >= 4 * _CHUNKS[0]:
                    chunks = {c: _time_op(comm, op, nbytes, best, c) for c in _CHUNKS}
                    row.append(min(chunks, key=chunks.get))
                    row[2].update({f"chunk={c >> 10}K": t * 1e6 for c, t in chunks.items()})
                rows.append(row)
            results[op] = rows
        return results
    finally:
        zbccl.finalize()


def _rules(rows: list) -> list[list]:
    """Merge neighbouring sizes with the same (algorithm, chunk) into ``[max_bytes, algo(, chunk)]``."""
    rules: list[list] = []
    for row in rows:
        nbytes, best = row[0], row[1]
        rule = [nbytes, best] + ([row[3]] if len(row) > 3 else [])
        if rules and rules[-1][1:] == rule[1:]:
            rules[-1][0] = nbytes
        else:
            rules.append(rule)
    rules[-1][0] = -1
    return rules


def run_tune(*, world_sizes: list[int], max_size: int, out: Path | None = None) -> Path:
    """Measure, print the winners, save the table; returns its path."""
    from zbccl.ops.tuner import table_path

    from .launch import launch_local

    sizes = []
    s = 4096
    while s <= max_size:
        sizes.append(s)
        s *= 4
    table: dict = {"rules": {}, "measured": {}}
    for ws in world_sizes:
        print(f"zbccl tune: world size {ws}, sizes {sizes[0]}..{sizes[-1]} bytes")
        res = launch_local(_rank, ws, sizes=sizes, timeout=1800)[0]
        for op, rows in res.items():
            table["rules"].setdefault(op, {})[str(ws)] = _rules(rows)
            table["measured"].setdefault(op, {})[str(ws)] = rows
            for row in rows:
                nbytes, best, times = row[:3]
                cells = "  ".join(f"{a}={t:9.1f}us" for a, t in times.items())
                chunk = f" chunk {row[3] >> 10} KiB" if len(row) > 3 else ""
                print(f"  {op:<11} {nbytes:>10}  {cells}  -> {best}{chunk}")
    path = Path(out or table_path())
    table["created"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    if path.is_file():  # the choices between hosts ``zbccl tune --hosts`` saved there stay
        from zbccl.ops.tuner import read_file

        old = read_file(path)
        table.update({k: old[k] for k in ("hosts", "hosts_measured") if k in old})
    write_table(table, path)
    print(f"saved {path}")
    return path


def write_table(table: dict, path: Path) -> None:
    """Validate ``table`` and write it atomically: ranks loading ``path`` see the old table or the new one.

    The text goes to a temporary file in the same directory (same filesystem),
    is flushed to disk, and replaces ``path`` in one ``os.replace``; a failure
    leaves ``path`` as it was and removes the temporary file.
    """
    from zbccl.ops.tuner import validate_hosts, validate_rules

    validate_rules(table["rules"], source="the table zbccl tune measured")
    if "hosts" in table:
        validate_hosts(table["hosts"], source="the table zbccl tune measured")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(table, indent=1))
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; the table is not secret
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
