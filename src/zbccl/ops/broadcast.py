"""broadcast: every rank copies the root's tensor (pull).

Heap placement: the *root's* tensor must be in the heap (staged otherwise,
counted in ``staged_bytes``); the others' tensors may be private. The root
never writes its own tensor: a staged or non-contiguous root tensor is only
copied into the heap, never back. After
``ARRIVE`` every non-root rank copies the root's bytes into its tensor;
``DONE`` tells the root that nobody reads its tensor any more.
"""

from __future__ import annotations

import torch

from ..errors import ZbcclInvalidUsageError
from ..native.abi import OP_BROADCAST
from ..runtime.communicator import Communicator
from ..runtime.registry import collective
from . import hosts, null, route
from .args import rank_error, tensor_error, written_error
from .channel import OpChannel
from .dtypes import dtype_code
from .entry import run_op
from .operands import Operand
from .route import device_of
from .tuner import choose

__all__ = ["broadcast"]

_OP = "broadcast"


@collective("broadcast")
def broadcast(tensor: torch.Tensor, src: int, *, comm: Communicator | None = None,
              timeout: float | None = None) -> torch.Tensor:
    """Collective: copy rank ``src``'s ``tensor`` into every rank's ``tensor`` (in place).

    ``src`` is a rank *of the communicator* (its group rank, ``comm.rank`` numbering), not
    torch's global rank; any integral value (``int``, ``numpy.int64``, ...) but ``bool``.
    ``tensor``: a CPU tensor of the same shape and dtype on every rank; the root's is only
    read. ``timeout``: seconds this op may wait (default: the communicator's). Blocks the host
    until this rank's copy is complete and (at the root) no peer reads its tensor any more.
    """
    W = comm.world_size
    error = tensor_error(tensor, "tensor", op=_OP)
    if error is not None and (device := device_of(_OP, tensor)) is not None:  # a CUDA tensor: the device ops
        return route.broadcast(comm, device, tensor, src, timeout)
    dt = 0
    if error is None:
        src, error = rank_error(src, W, op=_OP)
    if error is None and comm.rank != src:
        error = written_error(tensor, "tensor", op=_OP)  # receivers write theirs
    if error is None:
        try:
            dt = dtype_code(tensor.dtype, op=_OP)
        except ZbcclInvalidUsageError as exc:
            error = str(exc)
    if not comm._single_host:  # a communicator across hosts
        return hosts.broadcast(comm, tensor, src, error, timeout)
    run_op(comm, OP_BROADCAST, error, _root if comm.rank == src else _receive, null.broadcast, (tensor, dt, src),
           op=_OP, timeout=timeout, t=tensor)
    return tensor


def _root(ch: OpChannel, tensor: torch.Tensor, dt: int, src: int) -> None:
    """The root only lends its tensor (staged into the heap if need be) and never writes it."""
    n, isz = tensor.numel(), tensor.element_size()
    algo, _ = choose(ch, OP_BROADCAST, tensor.dtype, n * isz)
    operand = Operand(ch, tensor, op=_OP, role="tensor", read=True, write=False)
    try:
        if operand.error is not None:
            ch.fail(OP_BROADCAST, operand.error, operand.kind, op=_OP)
        ch.run(_OP, op=OP_BROADCAST, dtype=dt, in_numel=n, out_numel=n, in_off=operand.offset, out_off=-1, algo=algo,
               root=src, in_addr=operand.addr, out_addr=operand.addr, itemsize=isz)
    finally:
        operand.finish()


def _receive(ch: OpChannel, tensor: torch.Tensor, dt: int, src: int) -> None:
    """A receiver copies the root's bytes into its tensor (through a contiguous buffer if need be)."""
    n, isz = tensor.numel(), tensor.element_size()
    algo, _ = choose(ch, OP_BROADCAST, tensor.dtype, n * isz)
    dst = tensor if tensor.is_contiguous() else torch.empty_like(tensor, memory_format=torch.contiguous_format)
    ch.run(_OP, op=OP_BROADCAST, dtype=dt, in_numel=n, out_numel=n, in_off=-1, out_off=-1, algo=algo, root=src,
           out_addr=dst.data_ptr(), itemsize=isz)
    if dst is not tensor:
        tensor.copy_(dst)
