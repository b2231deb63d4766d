"""Calibrated collective timing, machine-load gating, foreign-CPU accounting, payloads, stats.

This module depends on the standard library and torch only, never on the
rest of zbccl; every implementation (zbccl, gloo, vLLM) is timed, gated and
checked by the same code (the interleaved A/B in ``ab.py`` reuses
:func:`_calibrate` and :func:`_block`).

Timing protocol (:func:`time_calls`), run by every rank of a world at once:

1. ``warmup`` untimed calls.
2. Calibration: time ``k`` back-to-back calls, take the slowest rank's time
   (``Control.max``), grow ``k`` until the block lasts >= 20 ms, then choose
   ``iters`` so that one repetition lasts about ``target_s``; if ``reps``
   repetitions would exceed ``cap_s`` (huge, slow cells), ``iters`` drops to 1
   and ``reps`` to at least 3.
3. ``reps`` repetitions, each after the implementation's own barrier, each
   timing ``iters`` back-to-back calls. A repetition's value is the
   **slowest rank's** per-call time; the cell reports the median and the
   min/max over repetitions.
4. Around the repetitions, every rank's own CPU time (``time.process_time``,
   all its threads) and the machine-wide busy time from ``/proc/stat`` are
   read: ``foreign_cores`` = (machine busy - sum of our ranks' CPU) / wall,
   i.e. how many cores other processes used while we measured.
5. :func:`time_quietly`: if that exceeds ``noise_limit`` cores, wait for an
   idle machine again (:class:`Regate`, bounded by a sweep-wide budget) and
   re-time once; the quieter attempt is kept, ``attempts`` says it happened.

Calls inside a model step (``TimingConfig.gap_ms`` > 0, ``zbccl bench
--gap-ms``): back-to-back calls keep the code, the flags and the operands in
cache, but an inference engine calls a collective after milliseconds of
matmuls that evicted them all. With a gap, every call of a repetition is
preceded by ``gap_ms`` of bf16 matmuls on this rank (:func:`gap_compute`);
then every rank enters the call at one instant, a ``CLOCK_MONOTONIC`` target
agreed through ``ctl`` (``perf_counter_ns`` is one clock for every process of
the host), and the call counts from that instant to this rank's exit. The
slowest rank's median call is the repetition's value: the cost of a
collective in a step, without the ranks' compute skew (which no library can
shorten). Ranks wait for the target in a busy loop, so this mode needs a
core per rank (the runner refuses it otherwise).

Every decision is taken from values reduced over the ranks, so all ranks
take the same number of calls: a collective never waits for a peer that
decided to stop.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Protocol

import torch

__all__ = [
    "Control",
    "GlooControl",
    "LocalControl",
    "TimingConfig",
    "Timed",
    "CpuTimes",
    "read_cpu_times",
    "wait_for_idle",
    "leader_then_all",
    "time_calls",
    "time_quietly",
    "Regate",
    "summarize",
    "payload",
    "expected",
    "count_wrong",
    "DTYPES",
]

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# ----------------------------------------------------------------------------- control plane
class Control(Protocol):
    """The control plane a timing loop needs: element-wise reductions over all ranks."""

    def max(self, values: Sequence[float]) -> list[float]: ...

    def sum(self, values: Sequence[float]) -> list[float]: ...


class GlooControl:
    """:class:`Control` over a torch.distributed (gloo) group; values travel as float64."""

    def __init__(self, group=None) -> None:
        self.group = group

    def _reduce(self, values: Sequence[float], op) -> list[float]:
        import torch.distributed as dist

        t = torch.tensor(list(values), dtype=torch.float64)
        dist.all_reduce(t, op=op, group=self.group)
        return t.tolist()

    def max(self, values: Sequence[float]) -> list[float]:
        import torch.distributed as dist

        return self._reduce(values, dist.ReduceOp.MAX)

    def sum(self, values: Sequence[float]) -> list[float]:
        import torch.distributed as dist

        return self._reduce(values, dist.ReduceOp.SUM)


class LocalControl:
    """:class:`Control` for a single process (solo memcpy): reductions are identities."""

    def max(self, values: Sequence[float]) -> list[float]:
        return list(values)

    def sum(self, values: Sequence[float]) -> list[float]:
        return list(values)


# ----------------------------------------------------------------------------- machine load
@dataclass(frozen=True)
class CpuTimes:
    """Machine-wide CPU seconds from the ``cpu`` line of ``/proc/stat``."""

    busy: float  # user + nice + system + irq + softirq (guest time is inside user)
    steal: float  # time the hypervisor ran something else on our vCPUs
    wall: float  # time.perf_counter() when read


def read_cpu_times() -> CpuTimes:
    """Read ``/proc/stat`` now; zeros where it does not exist (non-Linux)."""
    now = time.perf_counter()
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return CpuTimes(0.0, 0.0, now)
    fields += [0] * (8 - len(fields))
    hz = float(os.sysconf("SC_CLK_TCK"))
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return CpuTimes((user + nice + system + irq + softirq) / hz, steal / hz, now)


def wait_for_idle(*, max_wait_s: float = 30.0, threshold_cores: float = 0.2,
                  window_s: float = 0.25) -> dict:
    """Block until the whole machine uses < ``threshold_cores`` over a window, at most ``max_wait_s``.

    Run by one rank while its peers block on a store key (no CPU), so the load
    seen is other processes'. The sleep is the sampling window of a load
    meter, not a synchronisation. Returns ``{"idle", "waited_s", "load_cores"}``.
    """
    start = time.perf_counter()
    load = float("nan")
    while True:
        a = read_cpu_times()
        time.sleep(window_s)
        b = read_cpu_times()
        load = (b.busy - a.busy) / max(b.wall - a.wall, 1e-9)
        waited = time.perf_counter() - start
        if load < threshold_cores or waited >= max_wait_s:
            return {"idle": load < threshold_cores, "waited_s": round(waited, 3), "load_cores": round(load, 3)}


def leader_then_all(store, key: str, rank: int, fn: Callable[[], dict], *, timeout_s: float) -> dict:
    """Collective over a torch ``Store``: rank 0 runs ``fn`` while the others block on ``key``.

    The waiting ranks sit in a blocking socket read (no CPU), so rank 0 can
    gate on machine load or copy alone. Every rank returns ``fn``'s result.
    """
    if rank == 0:
        result = fn()
        store.set(key, json.dumps(result))
        return result
    store.wait([key], timedelta(seconds=timeout_s))
    return json.loads(store.get(key))


# ----------------------------------------------------------------------------- timing
@dataclass(frozen=True)
class TimingConfig:
    """How long to time one cell; ``quick`` presets are chosen by the runner."""

    target_s: float = 0.15  # one repetition lasts about this long
    reps: int = 5
    warmup: int = 2
    cap_s: float = 10.0  # at most this much timed work per cell and implementation
    max_iters: int = 100_000
    gap_ms: float = 0.0  # > 0: each call after this much compute, all ranks entering at one instant


@dataclass
class Timed:
    """One timed block: per-repetition slowest-rank µs per call, and the CPU seen meanwhile."""

    samples_us: list[float]
    iters: int
    foreign_cores: float
    steal_cores: float
    own_cores: float
    attempts: int = 1  # > 1: re-timed after a load gate because the first attempt was noisy
    stats: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.stats = summarize(self.samples_us)

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(samples: Sequence[float]) -> dict:
    """``{"median", "min", "max", "n"}`` of a sample list (None for an empty one)."""
    if not samples:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "n": len(samples)}


def _block(fn: Callable[[], object], iters: int) -> float:
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return time.perf_counter() - t0


_GAP_WEIGHT: list[torch.Tensor] = []


def gap_compute(ms: float) -> None:
    """Run bf16 matmuls (a decode step's GEMV on a 4 MiB weight) for at least ``ms`` milliseconds."""
    if not _GAP_WEIGHT:
        gen = torch.Generator().manual_seed(0)
        _GAP_WEIGHT[:] = [torch.randn(2048, 1024, generator=gen).to(torch.bfloat16),
                          torch.randn(1, 2048, generator=gen).to(torch.bfloat16)]
    w, x = _GAP_WEIGHT
    end = time.perf_counter_ns() + int(ms * 1e6)
    while time.perf_counter_ns() < end:
        torch.mm(x, w)


def _gapped_block(fn: Callable[[], object], iters: int, ctl: Control, cfg: TimingConfig,
                  per_call_s: float) -> float:
    """Collective: ``iters`` calls, each after :func:`gap_compute` and entered by every rank at one
    agreed instant; returns ``iters`` times this rank's median call, from that instant to its exit
    (the median: a call that a descheduled rank entered late must not stand for the step)."""
    period = int(_gap_step_s(cfg, per_call_s) * 1e9)
    calls = []
    for _ in range(iters):
        # agreed per call (untimed): a rank that was descheduled once does not start every later call late
        start = int(ctl.max([float(time.perf_counter_ns() + period)])[0])
        gap_compute(cfg.gap_ms)
        while time.perf_counter_ns() < start:  # every rank has a core (checked by the runner)
            pass
        fn()
        calls.append(time.perf_counter_ns() - start)
    return statistics.median(calls) * iters / 1e9


def _timed_block(fn: Callable[[], object], iters: int, ctl: Control, cfg: TimingConfig,
                 per_call_s: float) -> float:
    """Seconds for ``iters`` calls: back to back, or each in a model step (``cfg.gap_ms``)."""
    if cfg.gap_ms > 0:
        return _gapped_block(fn, iters, ctl, cfg, per_call_s)
    return _block(fn, iters)


def _gap_step_s(cfg: TimingConfig, per_call_s: float) -> float:
    """Seconds from agreeing on a call's start to that start: the gap, with room for a slow matmul and
    the agreement itself, plus room for the previous call."""
    return cfg.gap_ms * 1.25e-3 + 5e-4 + 20 * per_call_s


def _gap_iters(cfg: TimingConfig, per_call_s: float) -> int:
    """Calls per repetition with a gap: about ``target_s`` of steps, at least 10."""
    return max(10, min(200, round(cfg.target_s / _gap_step_s(cfg, per_call_s))))


def _calibrate(fn: Callable[[], object], ctl: Control, sync: Callable[[], object],
               cfg: TimingConfig) -> tuple[int, int]:
    """``(iters, reps)`` for this cell, identical on every rank."""
    k, per_call = 1, 0.0
    for _ in range(6):
        sync()
        elapsed = ctl.max([_block(fn, k)])[0]
        per_call = max(elapsed / k, 1e-9)
        if elapsed >= 0.02 or k >= cfg.max_iters:
            break
        k = min(cfg.max_iters, max(2 * k, math.ceil(0.03 / per_call)))
    if per_call * k < cfg.target_s:  # a second block: one preemption must not shrink every repetition
        sync()
        per_call = min(per_call, max(ctl.max([_block(fn, k)])[0] / k, 1e-9))
    iters = max(1, min(cfg.max_iters, round(cfg.target_s / per_call)))
    reps = cfg.reps
    if iters * reps * per_call > cfg.cap_s:
        iters = max(1, int(cfg.cap_s / (reps * per_call)))
        if iters * reps * per_call > cfg.cap_s:
            reps = max(3, min(reps, int(cfg.cap_s / per_call)))
    return iters, reps


def time_calls(fn: Callable[[], object], *, ctl: Control, sync: Callable[[], object],
               cfg: TimingConfig = TimingConfig()) -> Timed:
    """Collective: time ``fn`` on every rank as described in the module docstring.

    ``sync`` is the implementation's own barrier, called before each
    repetition; ``ctl`` reduces timings over the ranks. Returns the same
    :class:`Timed` on every rank.
    """
    for _ in range(cfg.warmup):
        fn()
    iters, reps = _calibrate(fn, ctl, sync, cfg)
    per_call = cfg.target_s / iters
    if cfg.gap_ms > 0:
        iters = _gap_iters(cfg, per_call)
    local: list[float] = []
    cpu0, stat0 = time.process_time(), read_cpu_times()
    for _ in range(reps):
        sync()
        local.append(_timed_block(fn, iters, ctl, cfg, per_call) / iters * 1e6)
    cpu1, stat1 = time.process_time(), read_cpu_times()
    wall = max(stat1.wall - stat0.wall, 1e-9)
    reduced = ctl.max(local + [(stat1.busy - stat0.busy) / wall, (stat1.steal - stat0.steal) / wall])
    own = ctl.sum([(cpu1 - cpu0) / wall])[0]
    return Timed(samples_us=reduced[:reps], iters=iters, foreign_cores=round(max(0.0, reduced[reps] - own), 3),
                 steal_cores=round(reduced[reps + 1], 3), own_cores=round(own, 3))


class Regate:
    """Collective: a load gate before re-timing a noisy cell, within a sweep-wide wait budget.

    Every rank holds one; rank 0 waits for an idle machine (at most
    ``max_wait_s`` per call) while the others block on the store. The budget
    is charged with the leader's waited time, which every rank receives, so
    all ranks agree on when it is spent (``__call__`` then returns False).
    """

    def __init__(self, store, rank: int, *, max_wait_s: float, budget_s: float, prefix: str = "bench/regate"):
        self.store, self.rank, self.prefix = store, rank, prefix
        self.max_wait_s, self.budget_s, self.spent_s, self.count = max_wait_s, budget_s, 0.0, 0

    def __call__(self) -> bool:
        if self.spent_s >= self.budget_s:
            return False
        self.count += 1
        wait = min(self.max_wait_s, self.budget_s - self.spent_s)
        got = leader_then_all(self.store, f"{self.prefix}/{self.count}", self.rank,
                              lambda: wait_for_idle(max_wait_s=wait), timeout_s=wait + 120)
        self.spent_s += got["waited_s"]
        return True


def time_quietly(fn: Callable[[], object], *, ctl: Control, sync: Callable[[], object], cfg: TimingConfig,
                 regate: Callable[[], bool] | None, noise_limit: float = 0.25, retries: int = 1) -> Timed:
    """Collective: :func:`time_calls`, redone after ``regate()`` while other processes used more
    than ``noise_limit`` cores (at most ``retries`` times); returns the quietest attempt."""
    best = time_calls(fn, ctl=ctl, sync=sync, cfg=cfg)
    attempts = 1
    while regate is not None and best.foreign_cores > noise_limit and attempts <= retries and regate():
        again = time_calls(fn, ctl=ctl, sync=sync, cfg=cfg)
        attempts += 1
        if again.foreign_cores < best.foreign_cores:
            best = again
    best.attempts = attempts
    return best


# ----------------------------------------------------------------------------- payloads and oracle
def payload(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """``[numel]`` rank ``rank``'s input: small integers in [-30, 30] that encode (rank, index).

    Element i is ``(7 i + 13 rank) mod 61 - 30``. 61 is prime, so a chunk moved
    by any power-of-two offset or taken from another rank differs, and sums
    over up to 4 ranks stay within bf16's exact integer range (|x| <= 256).
    """
    idx = torch.arange(numel, dtype=torch.int32)
    return ((idx * 7 + 13 * rank) % 61 - 30).to(dtype)


def _sum_payloads(world_size: int, numel: int) -> torch.Tensor:
    total = torch.zeros(numel, dtype=torch.int32)
    for r in range(world_size):
        total += payload(r, numel, torch.int32)
    return total


def expected(op: str, rank: int, world_size: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """The plain-torch reference output of ``op`` on ``rank`` for :func:`payload` inputs.

    ``numel`` is the per-rank input length (a multiple of ``world_size`` for
    reduce_scatter and all_to_all); broadcast's source is rank 0.
    """
    if op == "all_reduce":
        return _sum_payloads(world_size, numel).to(dtype)
    if op in ("all_gather", "all_gather_inplace"):
        return torch.cat([payload(r, numel, dtype) for r in range(world_size)])
    chunk = numel // world_size
    if op == "reduce_scatter":
        return _sum_payloads(world_size, numel)[rank * chunk:(rank + 1) * chunk].to(dtype)
    if op == "all_to_all":
        return torch.cat([payload(r, numel, dtype)[rank * chunk:(rank + 1) * chunk] for r in range(world_size)])
    if op == "broadcast":
        return payload(0, numel, dtype)
    raise ValueError(f"expected: unknown op, expected one of all_reduce/all_gather/reduce_scatter/"
                     f"all_to_all/broadcast, got {op!r}")


def count_wrong(out: torch.Tensor, ref: torch.Tensor) -> int:
    """Elements of ``out`` that differ bit-for-bit from ``ref`` (NaN counts as wrong); all if shapes differ."""
    flat = out.reshape(-1)
    if flat.numel() != ref.numel() or flat.dtype != ref.dtype:
        return max(flat.numel(), ref.numel())
    return int((flat != ref).sum())
