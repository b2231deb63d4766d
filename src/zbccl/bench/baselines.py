"""The implementations a cell is timed on, and the memory-copy limit.

An implementation (:class:`Impl`) allocates the cell's tensors, binds an op
to them as a zero-argument call, and offers its own barrier for the timing
loop. :class:`GlooImpl` is torch.distributed's gloo backend on private
tensors; the zbccl implementation lives in ``runner.py`` (it needs zbccl),
vLLM's in ``ab.py`` (it needs vLLM).

The memcpy limit (:func:`copy_call`, :func:`memcpy_solo`) is ``dst.copy_(src)`` of the cell's
per-rank byte count, timed two ways:

- ``all``: every rank copies at once, with the ranks' intra-op threads, and a
  repetition counts the slowest rank. This is the **fair limit** and the
  table's ``memcpy_GB/s``: during a collective every rank moves data at the
  same time through the same memory system, and busbw (nccl-tests) is the
  per-rank rate of that data movement, so ``busbw / memcpy`` near 1 means the
  op runs at the speed of a plain copy on a busy machine.
- ``solo``: rank 0 alone, one thread, while the others block on the store:
  the single-core copy rate, kept in the JSON for reference. It is higher
  than ``all`` once the copy leaves the caches (the 2 cores share DRAM).

``busbw / memcpy`` can exceed 1 where not every rank moves data (broadcast:
the root only waits, so its peers get the whole memory system) or where an
op avoids a copy's write-allocate read (reducing into a destination already
in the cache).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Protocol

import torch

from .timing import LocalControl, Timed, TimingConfig, time_calls

__all__ = ["OPS", "Impl", "silence_deprecations", "GlooImpl", "op_numel", "op_buffers", "copy_call", "memcpy_solo"]

OPS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
#: Opt-in variants: all_gather whose input is this rank's slice of the output (the zero-copy way
#: inference engines call it: no copy of the rank's own block).
EXTRA_OPS: tuple[str, ...] = ("all_gather_inplace",)



def silence_deprecations() -> None:
    """Hide torch 2.13's FutureWarnings for ``all_gather_into_tensor`` / ``reduce_scatter_tensor``.

    They are deprecated in favour of ``*_single`` but gloo still implements
    them; called in each rank process, never at import.
    """
    for name in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        warnings.filterwarnings("ignore", message=rf".*{name}.*", category=FutureWarning)


class Impl(Protocol):
    """What the runner needs from one implementation of the collectives."""

    name: str

    def supports(self, op: str) -> bool: ...

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor: ...

    def bind(self, op: str, out: torch.Tensor, inp: torch.Tensor) -> Callable[[], object]: ...

    def sync(self) -> None: ...

    def staged_bytes(self) -> int: ...


def op_numel(op: str, nbytes: int, itemsize: int, world_size: int) -> int:
    """Per-rank input elements for a cell of ``nbytes`` per rank (0: the cell is skipped).

    reduce_scatter and all_to_all cut the input into ``world_size`` equal
    chunks, so their count is rounded down to a multiple of ``world_size``.
    """
    numel = nbytes // itemsize
    if op in ("reduce_scatter", "all_to_all"):
        numel -= numel % world_size
    return numel


def op_buffers(impl: Impl, op: str, numel: int, dtype: torch.dtype,
               world_size: int, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, inp)`` for ``op``: inp ``[numel]``; out ``[world_size * numel]`` for all_gather,
    ``[numel / world_size]`` for reduce_scatter, ``[numel]`` for all_to_all, and ``inp`` itself
    for the in-place ops (all_reduce, broadcast)."""
    if op == "all_gather_inplace":
        out = impl.empty(numel * world_size, dtype)
        return out, out[rank * numel:(rank + 1) * numel]
    inp = impl.empty(numel, dtype)
    if op in ("all_reduce", "broadcast"):
        return inp, inp
    out_numel = {"all_gather": numel * world_size, "reduce_scatter": numel // world_size}.get(op, numel)
    return impl.empty(out_numel, dtype), inp


class GlooImpl:
    """torch.distributed on ``group`` (gloo), private tensors, ``dist.barrier`` as sync."""

    name = "gloo"

    def __init__(self, group=None) -> None:
        self.group = group

    def supports(self, op: str) -> bool:
        return op in OPS or op in EXTRA_OPS

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    def bind(self, op: str, out: torch.Tensor, inp: torch.Tensor) -> Callable[[], object]:
        import torch.distributed as dist

        g = self.group
        calls: dict[str, Callable[[], object]] = {
            "all_reduce": lambda: dist.all_reduce(inp, group=g),
            "all_gather": lambda: dist.all_gather_into_tensor(out, inp, group=g),
            "all_gather_inplace": lambda: dist.all_gather_into_tensor(out, inp, group=g),
            "reduce_scatter": lambda: dist.reduce_scatter_tensor(out, inp, group=g),
            "all_to_all": lambda: dist.all_to_all_single(out, inp, group=g),
            "broadcast": lambda: dist.broadcast(inp, src=0, group=g),
        }
        return calls[op]

    def sync(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self.group)

    def staged_bytes(self) -> int:
        return 0


def copy_call(nbytes: int) -> Callable[[], object]:
    """``dst.copy_(src)`` of ``nbytes`` private bytes, bound: time it on every rank for the ``all`` limit."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    return lambda: dst.copy_(src)


def memcpy_solo(nbytes: int, *, cfg: TimingConfig) -> Timed:
    """One process, one thread: ``dst.copy_(src)`` of ``nbytes`` (the ``solo`` reference)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return time_calls(copy_call(nbytes), ctl=LocalControl(), sync=lambda: None, cfg=cfg)
    finally:
        torch.set_num_threads(threads)
