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
from ..runtime.communicator import Communicator
from ..runtime.registry import collective
from .allreduce import _show
from .args import rank_error, tensor_error, written_error
from .channel import ERR_USAGE, Header
from .dtypes import dtype_code
from .entry import open_op
from .fastpath import native_channel
from .operands import Operand
from .plan import OP_BROADCAST, choose, nthreads, profiled

__all__ = ["broadcast", "barrier"]

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
    with profiled(_OP, tensor):
        ch = open_op(comm, OP_BROADCAST, error, op=_OP, timeout=timeout)
        if ch is not None:
            seq = ch.seq
            try:
                if comm.rank == src:
                    _root(ch, tensor, dt, src)
                else:
                    _receive(ch, tensor, dt, src)
            except BaseException as exc:
                ch.left(seq, exc, op=_OP)
                raise
    return tensor


def _root(ch, tensor: torch.Tensor, dt: int, src: int) -> None:
    """The root only lends its tensor (staged into the heap if need be) and never writes it."""
    operand = Operand(ch, tensor, op=_OP, role="tensor", read=True, write=False)
    try:
        _call(ch, tensor, operand.addr, operand.offset, dt, src, operand.error, operand.kind)
    finally:
        operand.finish()


def _receive(ch, tensor: torch.Tensor, dt: int, src: int) -> None:
    """A receiver copies the root's bytes into its tensor (through a contiguous buffer if need be)."""
    dst = tensor if tensor.is_contiguous() else torch.empty_like(tensor, memory_format=torch.contiguous_format)
    _call(ch, dst, dst.data_ptr(), -1, dt, src, None)
    if dst is not tensor:
        tensor.copy_(dst)


def _call(ch, t: torch.Tensor, addr: int, offset: int, dt: int, src: int, error: str | None,
          kind: int = ERR_USAGE) -> None:
    algo, _ = choose(ch, OP_BROADCAST, t.dtype, t.numel() * t.element_size())
    nat = native_channel(ch)
    if nat is not None and error is None:
        ch.seq += 1
        rc = nat.broadcast(nat.handle, ch.seq, addr, offset, t.numel(), t.element_size(), dt, src, algo)
        if rc:
            nat.raise_for(rc, op=_OP, show=_show)
    else:
        _python_path(ch, addr, t.numel(), t.numel() * t.element_size(), dt, offset, src, algo, error, kind)


def _python_path(ch, addr: int, numel: int, nbytes: int, dt: int, offset: int, src: int, algo: int,
                 error: str | None, kind: int) -> None:
    hdrs = ch.begin([0, OP_BROADCAST, dt, 0, numel, numel, offset, -1, algo, src], op="broadcast",
                    error=error, kind=kind)
    ch.agree(hdrs, (Header.OP, Header.DTYPE, Header.IN_NUMEL, Header.ROOT, Header.ALGO), op="broadcast",
             show=_show)
    if ch.rank != src and nbytes:
        off = hdrs[src][Header.IN_OFF]
        if off < 0 or off + nbytes > ch.heap_size[src]:
            ch.end(op="broadcast")
            raise ZbcclInvalidUsageError(
                f"broadcast: root's tensor is outside its heap, got offset {off} + {nbytes} bytes", ranks=(src,))
        ch.prims.copy(addr, ch.heap_base[src] + off, nbytes, nthreads())
    ch.end(op="broadcast")


@collective("barrier")
def barrier(*, comm: Communicator | None = None, timeout: float | None = None) -> None:
    """Collective: return once every rank of ``comm`` entered (see ``Communicator.barrier``)."""
    comm.barrier(timeout)

