"""Plain-torch reference collectives: the tests' oracle and the semantics in one page.

Each takes every rank's inputs in rank order (as a single process would see
them) and returns what zbccl must produce, bit for bit: floats accumulate in
fp32 (fp64 for float64) in rank order and round once; integers wrap.
"""

from __future__ import annotations

import torch

from .dtypes import AVG, MAX, MIN, PROD, SUM

__all__ = ["reduce_ref", "all_reduce_ref", "hierarchical_all_reduce_ref", "all_gather_ref", "reduce_scatter_ref",
           "all_to_all_ref"]


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype in (torch.bfloat16, torch.float16, torch.float32):
        return torch.float32
    return dtype


def reduce_ref(inputs: list[torch.Tensor], op: int) -> torch.Tensor:
    """Element-wise reduction of ``inputs`` in list order."""
    dtype = inputs[0].dtype
    if dtype == torch.bool:
        stack = torch.stack(inputs)
        return stack.any(0) if op in (SUM, MAX) else stack.all(0)
    acc = inputs[0].to(_acc_dtype(dtype)).clone()
    for x in inputs[1:]:
        x = x.to(acc.dtype)
        if op in (SUM, AVG):
            acc = acc + x
        elif op == PROD:
            acc = acc * x
        elif op == MAX:
            acc = torch.maximum(acc, x)
        elif op == MIN:
            acc = torch.minimum(acc, x)
    if op == AVG:
        acc = acc / len(inputs)
    return acc.to(dtype)


def all_reduce_ref(inputs: list[torch.Tensor], op: int) -> torch.Tensor:
    return reduce_ref([x.reshape(-1) for x in inputs], op).view(inputs[0].shape)


def hierarchical_all_reduce_ref(inputs: list[torch.Tensor], op: int, groups: list[list[int]]) -> torch.Tensor:
    """What the hierarchical all_reduce across hosts produces (``ops/hosts/hier.py``): each group's (host's)
    members reduced in list order and rounded to the dtype, then the groups' results in group order, rounded
    again; ``avg`` sums through both levels and divides by the member count once, in the dtype. ``groups``:
    the indices into ``inputs`` per host, hosts in order (``zbccl.ops.hosts.reduction_order``)."""
    inner = SUM if op == AVG else op
    flat = [x.reshape(-1) for x in inputs]
    out = reduce_ref([reduce_ref([flat[i] for i in g], inner) for g in groups], inner)
    if op == AVG:
        out.div_(len(inputs))
    return out.view(inputs[0].shape)


def all_gather_ref(inputs: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([x.reshape(-1) for x in inputs])


def reduce_scatter_ref(inputs: list[torch.Tensor], op: int, counts: list[int], rank: int) -> torch.Tensor:
    lo = sum(counts[:rank])
    return reduce_ref([x.reshape(-1)[lo:lo + counts[rank]] for x in inputs], op)


def all_to_all_ref(inputs: list[torch.Tensor], in_splits: list[list[int]], rank: int) -> torch.Tensor:
    """Rows ``in_splits[q][rank]`` of each rank q's input, in rank order (splits in rows)."""
    parts = []
    for q, x in enumerate(inputs):
        lo = sum(in_splits[q][:rank])
        parts.append(x[lo:lo + in_splits[q][rank]])
    return torch.cat(parts)
