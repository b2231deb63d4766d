"""The collectives across hosts: what every public op's door runs for a communicator that spans hosts.

A door sends a communicator with ``not comm._single_host`` here after its local argument checks (as
CPU/CUDA routing does; the single-host path pays nothing: its plan caches and hot entries never hold
a spanning communicator, whose op channel never exists). Each entry:

1. refuses a broken communicator (a rank that left an op half-way) on this rank;
2. makes the communicator's :class:`~.state.HostOps` on its first op (collective: regions, host group);
3. runs the op: its first step is the agreement (``state.py``), where a local error (``error``) or a
   disagreement fails the op on every rank; then the flat (``flat.py``) or hierarchical (``hier.py``)
   algorithm, as ``tuner.hosts_hierarchical`` says;
4. an op left half-way after the agreement (an exception other than the ones raised together) breaks
   the communicator here (later ops raise) and publishes ABORT on this rank's ABORT line, which peers on
   other hosts read through the verbs at their next liveness check. A timeout, a lost peer and Ctrl-C
   are published by the op's guard (``registry.collective``); any other error is published here.
"""

from __future__ import annotations

import math

import torch

from ...errors import ZbcclInvalidUsageError
from ...native.abi import ABORT_EXCEPTION, WHERE_COLLECTIVE
from ...runtime import liveness
from ..args import timeout_error
from ..dtypes import dtype_code
from ..tuner import TuningTable, hosts_hierarchical, hosts_settings
from . import flat, hier
from .state import HostOps, host_ops

__all__ = ["all_reduce", "gather", "reduce_scatter", "all_to_all", "broadcast", "barrier", "HostOps",
           "reduction_order", "settle"]


def reduction_order(comm, nbytes: int) -> list[list[int]] | None:
    """The order an all_reduce of ``nbytes`` over ``comm`` reduces in: None for member order (one host, or the
    flat algorithm, bit-equal to ``reference.all_reduce_ref``), else the group ranks per host, hosts in order
    of their first member, for the hierarchical one (``reference.hierarchical_all_reduce_ref``). Local: it
    reads the topology and the tuner's rule, the same inputs every member's choice reads: the communicator's
    agreed thresholds once it ran an op across hosts, before that this rank's tuning table's (the same where
    every host's table sets the same, or none)."""
    if comm._single_host:
        return None
    h = comm.device_state.get("hosts")
    hier_min = (h.tune if h is not None else hosts_settings(TuningTable.load().hosts))["hier_min"]
    by_host: dict[int, list[int]] = {}
    for i, g in enumerate(comm.ranks):
        by_host.setdefault(comm.topology.host_of(g), []).append(i)
    hosts = list(by_host.values())
    regular = len(hosts) >= 2 and len(hosts[0]) >= 2 and all(len(h) == len(hosts[0]) for h in hosts)
    return hosts if hosts_hierarchical("all_reduce", nbytes, len(hosts), len(hosts[0]), regular, hier_min) else None


def settle(comm, timeout: float = 30.0) -> None:
    """Wait until this rank's writes of ``comm``'s last op across hosts landed (:meth:`HostOps.settle`; nothing
    before the first such op). Not collective."""
    h = comm.device_state.get("hosts")
    if h is not None and h.broken is None:
        h.settle(timeout)


def _run(comm, op: str, timeout, body):
    """``body(h, seconds, timeout error)`` under the rules of the module docstring."""
    ctx = comm._ctx
    secs, terr = timeout_error(timeout, ctx.timeout, op=op)
    if ctx.left is not None:
        raise ZbcclInvalidUsageError(f"{op}: this communicator is broken on rank {comm.rank}: {ctx.left}; finalize "
                                     "and init again", ranks=(comm.rank,))
    h = comm.device_state.get("hosts")
    if h is not None and h.broken is not None:
        raise ZbcclInvalidUsageError(f"{op}: this communicator is broken on rank {comm.rank}: {h.broken}; finalize "
                                     "and init again", ranks=(comm.rank,))
    if h is None:
        h = host_ops(comm, timeout=secs)
    h.together = False
    try:
        return body(h, secs, terr)
    except BaseException as exc:
        if not h.together:  # left half-way: the peers must learn it (the guard publishes its own kinds)
            h.broken = f"op #{h.op_no} ({op}) was left half-way by {type(exc).__name__}: {exc}"
            if not liveness.reason(exc):
                liveness.mark_left(ctx, ABORT_EXCEPTION, h.broken, where=comm.role or WHERE_COLLECTIVE,
                                   seq=h.op_no)
        raise


def all_reduce(comm, tensor: torch.Tensor, dt: int, red: int, error: str | None, timeout) -> torch.Tensor:
    op = "all_reduce"

    def body(h: HostOps, secs: float, terr: str | None) -> None:
        err = error or terr
        nbytes = 0 if err else tensor.numel() * tensor.element_size()
        if err is None and hosts_hierarchical(op, nbytes, h.H, h.L, h.regular, h.tune["hier_min"]):
            hier.all_reduce(h, op, tensor, dt, red, secs)
        else:
            flat.all_reduce(h, op, tensor, dt, red, err, secs)

    _run(comm, op, timeout, body)
    return tensor


def gather(comm, op: str, output: torch.Tensor, input: torch.Tensor, dt: int, counts: list[int] | None, dim: int,
           error: str | None, timeout) -> torch.Tensor:
    """all_gather_into_tensor / all_gather_v (``counts``: elements per rank; None: even) along ``dim``."""

    def body(h: HostOps, secs: float, terr: str | None) -> None:
        err = error or terr
        cs = [input.numel()] * h.n if counts is None else list(counts)
        d, shapes = 0, []
        if err is None and dim:
            d = dim % input.dim()
            unit = math.prod(s for j, s in enumerate(input.shape) if j != d)
            shapes = [tuple(input.shape[:d]) + (c // unit if unit else 0,) + tuple(input.shape[d + 1:]) for c in cs]
        nbytes = 0 if err else sum(cs) * input.element_size()
        if (err is None and d == 0 and len(set(cs)) == 1
                and hosts_hierarchical("all_gather", nbytes, h.H, h.L, h.regular, h.tune["hier_min"])):
            hier.all_gather(h, op, output, input, dt, cs, secs)
        else:
            flat.gather(h, op, output, input, dt, cs, d, shapes, err, secs)

    _run(comm, op, timeout, body)
    return output


def reduce_scatter(comm, op: str, output: torch.Tensor, input: torch.Tensor, dt: int, red: int, counts: list[int],
                   dim: int, error: str | None, timeout) -> torch.Tensor:
    """reduce_scatter_tensor / reduce_scatter_v (``counts``: elements per rank) along ``dim``."""

    def body(h: HostOps, secs: float, terr: str | None) -> None:
        err = error or terr
        d, rows = 0, list(counts)
        if err is None and dim:
            d = dim % input.dim()
            unit = math.prod(s for j, s in enumerate(input.shape) if j != d)
            rows = [c // unit if unit else 0 for c in counts]
        nbytes = 0 if err else input.numel() * input.element_size()
        if (err is None and d == 0 and len(set(counts)) == 1
                and hosts_hierarchical("reduce_scatter", nbytes, h.H, h.L, h.regular, h.tune["hier_min"])):
            hier.reduce_scatter(h, op, output, input, dt, red, list(counts), secs)
        else:
            flat.reduce_scatter(h, op, output, input, dt, red, list(counts), rows, d, err, secs)

    _run(comm, op, timeout, body)
    return output


def all_to_all(comm, output: torch.Tensor, input: torch.Tensor, dt: int, ins: list[int], outs: list[int],
               error: str | None, timeout) -> torch.Tensor:
    op = "all_to_all"
    _run(comm, op, timeout, lambda h, secs, terr: flat.all_to_all(h, op, output, input, dt, ins, outs,
                                                                  error or terr, secs))
    return output


def broadcast(comm, tensor: torch.Tensor, src: int, error: str | None, timeout) -> torch.Tensor:
    op = "broadcast"

    def body(h: HostOps, secs: float, terr: str | None) -> None:
        err, dt = error or terr, 0
        if err is None:
            try:
                dt = dtype_code(tensor.dtype, op=op)
            except ZbcclInvalidUsageError as exc:
                err = str(exc)
        nbytes = 0 if err else tensor.numel() * tensor.element_size()
        if err is None and hosts_hierarchical(op, nbytes, h.H, h.L, h.regular, h.tune["hier_min"]):
            hier.broadcast(h, op, tensor, dt, src, secs)
        else:
            flat.broadcast(h, op, tensor, dt, src, err, secs)

    _run(comm, op, timeout, body)
    return tensor


def barrier(comm, timeout, tag: int = 0) -> list[int] | None:
    """A barrier through the pad words (one header-only step); every member's tag when they differ."""
    op = "barrier"
    return _run(comm, op, timeout, lambda h, secs, terr: flat.barrier(h, op, tag, terr, secs))
