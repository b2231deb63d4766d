"""Shared decisions of the collectives: op and algorithm codes, slicing, threads, profiling.

The Python layer decides (which algorithm, how to slice, how many threads);
the native layer moves bytes. Algorithm choice comes from the tuner's table,
which every rank of a communicator shares (rank 0's copy), and the chosen
code travels in the op header so a disagreement is an error, not a hang.
"""

from __future__ import annotations

import contextlib

import torch

from ..runtime.threads import nthreads, set_threads

__all__ = [
    "OP_ALL_REDUCE", "OP_ALL_GATHER", "OP_REDUCE_SCATTER", "OP_ALL_TO_ALL", "OP_BROADCAST", "OP_NAMES",
    "ONESHOT", "TWOSHOT", "PULL", "PUSH", "ALGO_NAMES", "ALGO_CODES", "OP_ALGOS",
    "choose", "slices", "nthreads", "profiled", "set_threads",
]

OP_ALL_REDUCE, OP_ALL_GATHER, OP_REDUCE_SCATTER, OP_ALL_TO_ALL, OP_BROADCAST = 1, 2, 3, 4, 5
OP_NAMES = {OP_ALL_REDUCE: "all_reduce", OP_ALL_GATHER: "all_gather", OP_REDUCE_SCATTER: "reduce_scatter",
            OP_ALL_TO_ALL: "all_to_all", OP_BROADCAST: "broadcast"}
ONESHOT, TWOSHOT, PULL, PUSH = 1, 2, 3, 4
ALGO_NAMES = {ONESHOT: "oneshot", TWOSHOT: "twoshot", PULL: "pull", PUSH: "push"}
ALGO_CODES = {v: k for k, v in ALGO_NAMES.items()}
#: Algorithms each op implements (the first is the fallback).
OP_ALGOS = {
    "all_reduce": ("twoshot", "oneshot"),
    "all_gather": ("pull", "push"),
    "reduce_scatter": ("pull",),
    "all_to_all": ("pull", "push"),
    "broadcast": ("pull",),
}

# Elements per slice boundary: 64 bytes, so no two ranks write one cache line.
_ALIGN_BYTES = 64


def slices(count: int, parts: int, itemsize: int) -> list[tuple[int, int]]:
    """Split ``count`` elements into ``parts`` contiguous ranges, cache-line aligned."""
    align = max(1, _ALIGN_BYTES // itemsize)
    step = -(-count // parts)
    step = -(-step // align) * align
    return [(min(count, i * step), min(count, (i + 1) * step)) for i in range(parts)]


def choose(ch, opcode: int, dtype: torch.dtype, nbytes: int) -> tuple[int, int]:
    """``(algorithm code, chunk bytes)`` for this op and size, from the communicator's shared table."""
    cache = ch.choices
    key = (opcode, dtype, nbytes)
    algo = cache.get(key)
    if algo is None:
        from .tuner import table_for

        if len(cache) > 4096:
            cache.clear()
        algo = cache[key] = table_for(ch).choose(OP_NAMES[opcode], dtype, nbytes, ch.world_size)
    return algo


@contextlib.contextmanager
def _record(name: str):
    with torch.autograd.profiler.record_function(name):
        yield


_null = contextlib.nullcontext()


def profiled(op: str, t: torch.Tensor):
    """A profiler range ``zbccl::<op>(<bytes>B)`` when the torch profiler runs, else nothing."""
    if torch.autograd.profiler._is_profiler_enabled:
        nbytes = t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0  # a bad argument too
        return _record(f"zbccl::{op}({nbytes}B)")
    return _null
