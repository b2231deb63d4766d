"""Functional collectives (``torch.distributed._functional_collectives``) on zbccl groups.

torch's functional ops run in C++ and reach a Python process group only
through the virtual methods its trampoline forwards (``allreduce``,
``all_to_all_single``, ``broadcast``, the ``*_coalesced`` forms...). The
two most used by DTensor, ``all_gather_into_tensor`` and
``reduce_scatter_tensor``, call ``_allgather_base`` / ``_reduce_scatter_base``,
which the trampoline of torch 2.13 does not forward: they would run on the
group's registered CPU backend (its inner gloo group).

:func:`install` therefore adds CPU and CUDA kernels for those two ops that run zbccl
when the group is a zbccl group, and for any other group call the ops' own
``_out`` forms (which is what torch's kernels do), so other backends are
unaffected. It runs when the first zbccl group is created, never at import.
The ``_out`` forms themselves are not redirected (torch calls them for
``dist.all_gather_into_tensor`` only while tracing with ``torch.compile``);
on a zbccl group they run on its inner gloo group.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from ..ops.dtypes import REDUCE_OPS

__all__ = ["install"]

_lock = threading.Lock()
_lib = None


def _zbccl_group(group_name):
    """The zbccl process group ``group_name`` names (a name or a group), or None."""
    from .process_group import ProcessGroupZbccl

    pg = group_name
    if isinstance(group_name, str):
        try:
            pg = dist.distributed_c10d._resolve_process_group(group_name)
        except Exception:  # noqa: BLE001 - not a group this process knows: not ours
            return None
    return pg if isinstance(pg, ProcessGroupZbccl) else None


def _all_gather(input: torch.Tensor, group_size: int, group_name) -> torch.Tensor:
    out = input.new_empty((input.shape[0] * group_size, *input.shape[1:]) if input.dim() else (group_size,))
    pg = _zbccl_group(group_name)
    if pg is None or not pg._zb("all_gather_into_tensor"):
        return torch.ops._c10d_functional.all_gather_into_tensor_out(input, group_size, group_name, out=out)
    pg.all_gather_single(out, input.contiguous())
    return out


def _reduce_scatter(input: torch.Tensor, reduce_op: str, group_size: int, group_name) -> torch.Tensor:
    out = input.new_empty((input.shape[0] // group_size, *input.shape[1:]))
    pg = _zbccl_group(group_name)
    if pg is None or not pg._zb("reduce_scatter_tensor") or reduce_op.lower() not in REDUCE_OPS:
        return torch.ops._c10d_functional.reduce_scatter_tensor_out(input, reduce_op, group_size, group_name,
                                                                   out=out)
    from ..ops import reduce_scatter_tensor

    reduce_scatter_tensor(out, input.contiguous(), reduce_op.lower(), comm=pg.comm)
    return out


def install() -> None:
    """Register the kernels above for CPU and CUDA tensors (once per process)."""
    global _lib
    with _lock:
        if _lib is not None:
            return
        import warnings

        lib = torch.library.Library("_c10d_functional", "IMPL")
        with warnings.catch_warnings():  # "overriding a previously registered kernel": that is the point
            warnings.simplefilter("ignore")
            for key in ("CPU", "CUDA"):  # CUDA: the group's CUDA tensors (a Python group has no CUDA backend)
                lib.impl("all_gather_into_tensor", _all_gather, key)
                lib.impl("reduce_scatter_tensor", _reduce_scatter, key)
        _lib = lib
