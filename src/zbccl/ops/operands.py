"""Where a collective's tensors live: in the heap (zero-copy) or staged into it.

Zero-buffer contract: a contiguous tensor in this rank's heap is used in
place; nothing is copied and ``staged_bytes`` does not move. Any other tensor
(outside the heap, or non-contiguous) is copied through a heap block for the
op, and the copied bytes are added to ``memory_stats()["staged_bytes"]``; in
strict mode (``with zbccl.strict_heap():`` or ``ZBCCL_STRICT_HEAP=1``) it is an
error instead. Staging decisions are per rank and per operand: a peer only
ever sees an offset in this rank's heap.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from .. import env
from ..errors import ZbcclOutOfMemoryError
from ..native.abi import ERR_NOMEM, ERR_USAGE

if TYPE_CHECKING:
    from .channel import OpChannel

__all__ = ["Operand", "strict_heap", "is_strict"]

_tls = threading.local()


@contextlib.contextmanager
def strict_heap(enabled: bool = True) -> Iterator[None]:
    """Inside this block (this thread), collectives refuse tensors outside the heap."""
    prev = getattr(_tls, "strict", None)
    _tls.strict = enabled
    try:
        yield
    finally:
        _tls.strict = prev


def is_strict() -> bool:
    """Strict mode for this thread: ``strict_heap()`` if inside one, else ``ZBCCL_STRICT_HEAP``."""
    value = getattr(_tls, "strict", None)
    return env.STRICT_HEAP.get() if value is None else value


class Operand:
    """One tensor argument of a collective, resolved to an offset in this rank's heap.

    ``read``: peers or this rank read its values (stage them in). ``write``:
    the op writes it (copy back at :meth:`finish`). ``error`` is set instead
    of raising, so the group can fail together after the handshake.
    """

    __slots__ = ("t", "nbytes", "offset", "addr", "block", "write", "error", "kind", "_ch")

    def __init__(self, ch: OpChannel, t: torch.Tensor, *, op: str, role: str, read: bool, write: bool) -> None:
        self._ch, self.t, self.write = ch, t, write
        self.nbytes = t.numel() * t.element_size()
        self.block = None
        self.error: str | None = None
        self.kind = ERR_USAGE  # what kind of error ``error`` is, for the handshake (abi.ERR_*)
        self.offset = ch.offset_of(t) if self.nbytes else 0  # nothing to move for an empty tensor
        if self.offset < 0:
            if is_strict():
                self.error = (f"{op}: {role} is not a contiguous tensor in this rank's heap and strict mode is on; "
                              "allocate it with zbccl.empty()/heap_scope()")
                self.offset = 0
            else:
                try:
                    self._stage(read)
                except ZbcclOutOfMemoryError as exc:
                    # Reported through the handshake so every rank fails together, none hangs.
                    self.error = f"{op}: cannot stage the {role} ({self.nbytes} bytes) through the heap: {exc}"
                    self.kind = ERR_NOMEM
                    self.offset = 0
        # The native op's address of the operand: the tensor's own in the heap; else its staging block's, or the
        # heap's byte 0 when nothing moves (an error, no bytes), from the transport's native handle.
        if self.block is None and not self.error and self.nbytes:
            self.addr = t.data_ptr()
        else:
            self.addr = ch.block_addr(self.offset, self.nbytes if self.block is not None else 0)

    def _stage(self, read: bool) -> None:
        sma = self._ch.ctx.sma
        self.block = sma.malloc(max(self.nbytes, 1), kind="staging")
        self.offset = self.block
        if read and self.nbytes:
            self.view().copy_(self.t)
            sma.record_staged(self.nbytes)

    def view(self) -> torch.Tensor:
        """The heap bytes of this operand as a tensor shaped like the argument."""
        ch = self._ch
        return ch.ctx.heap.view(ch.ctx.rank, self.offset, self.t.shape, self.t.dtype, op="collective")

    def finish(self) -> None:
        """Copy a staged output back to the caller's tensor and release the block."""
        if self.block is None:
            return
        sma = self._ch.ctx.sma
        try:
            if self.write and self.nbytes:
                self.t.copy_(self.view())
                sma.record_staged(self.nbytes)
        finally:
            sma.free(self.block)
            self.block = None
