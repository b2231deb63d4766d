"""broadcast: every rank copies the root's tensor (pull).

Heap placement: the *root's* tensor must be in the heap (staged otherwise,
counted in ``staged_bytes``); the others' tensors may be private. After
``ARRIVE`` every non-root rank copies the root's bytes into its tensor;
``DONE`` tells the root that nobody reads its tensor any more.
"""

from __future__ import annotations

import torch

from ..errors import ZbcclInvalidUsageError
from ..runtime.communicator import Communicator
from ..runtime.registry import collective
from ..runtime.state import resolve_comm
from .allreduce import _show
from .channel import Header, channel_of
from .dtypes import dtype_code
from .fastpath import native_channel
from .operands import Operand
from .plan import OP_BROADCAST, choose, nthreads, profiled

__all__ = ["broadcast", "barrier"]


@collective("broadcast")
def broadcast(tensor: torch.Tensor, src: int, *, comm: Communicator | None = None) -> torch.Tensor:
    """Collective: copy rank ``src``'s ``tensor`` into every rank's ``tensor`` (in place)."""
    comm = resolve_comm(comm)
    with profiled("broadcast", tensor):
        W, me = comm.world_size, comm.rank
        try:
            dt = dtype_code(tensor.dtype, op="broadcast")
            if not isinstance(src, int) or not 0 <= src < W:
                raise ZbcclInvalidUsageError(f"broadcast: src out of range, expected [0, {W}), got {src!r}")
        except ZbcclInvalidUsageError as exc:
            if W == 1:
                raise
            channel_of(comm).fail_together(OP_BROADCAST, str(exc), op="broadcast")
        if W == 1:
            return tensor
        ch = channel_of(comm)
        nbytes = tensor.numel() * tensor.element_size()
        root = me == src
        operand = Operand(ch, tensor, op="broadcast", role="tensor", read=root, write=not root) if root else None
        dst = tensor if tensor.is_contiguous() else torch.empty_like(tensor, memory_format=torch.contiguous_format)
        try:
            algo, _ = choose(ch, OP_BROADCAST, tensor.dtype, nbytes)
            offset = operand.offset if root else -1
            err = operand.error if root else None
            nat = native_channel(ch)
            if nat is not None and err is None:
                ch.seq += 1
                target = operand.addr if root else dst.data_ptr()
                rc = nat.broadcast(nat.handle, ch.seq, target, offset, tensor.numel(), tensor.element_size(), dt,
                                   src, algo)
                if rc:
                    nat.raise_for(rc, op="broadcast", show=_show)
            else:
                _python_path(ch, dst, nbytes, dt, offset, src, algo, err)
        finally:
            if operand is not None:
                operand.finish()
        if dst is not tensor:
            tensor.copy_(dst)
        return tensor


def _python_path(ch, dst: torch.Tensor, nbytes: int, dt: int, offset: int, src: int, algo: int,
                 error: str | None) -> None:
    hdrs = ch.begin([0, OP_BROADCAST, dt, 0, dst.numel(), dst.numel(), offset, -1, algo, src], op="broadcast",
                    error=error)
    ch.agree(hdrs, (Header.OP, Header.DTYPE, Header.IN_NUMEL, Header.ROOT, Header.ALGO), op="broadcast",
             show=_show)
    if ch.rank != src and nbytes:
        off = hdrs[src][Header.IN_OFF]
        if off < 0 or off + nbytes > ch.heap_size[src]:
            ch.end(op="broadcast")
            raise ZbcclInvalidUsageError(
                f"broadcast: root's tensor is outside its heap, got offset {off} + {nbytes} bytes", ranks=(src,))
        ch.prims.copy(dst.data_ptr(), ch.heap_base[src] + off, nbytes, nthreads())
    ch.end(op="broadcast")


@collective("barrier")
def barrier(*, comm: Communicator | None = None, timeout: float | None = None) -> None:
    """Collective: return once every rank of ``comm`` entered (see ``Communicator.barrier``)."""
    resolve_comm(comm).barrier(timeout)

