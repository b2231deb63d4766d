"""The null backend: every collective at world size 1, in plain torch, with no native core.

At world size 1 an op has no peer: a reduction of one tensor is that tensor
(``avg`` included), a gather or an exchange is a copy, a broadcast from the
only rank changes nothing. These need neither the handshake nor the C
channel, so ``zbccl.init()`` at world size 1 works on a machine without a
compiler (``zbccl info`` says whether the core is built). Arguments were
checked by the op before it got here, exactly as at larger world sizes.
"""

from __future__ import annotations

import torch

__all__ = ["all_reduce", "copy_into", "broadcast"]


def all_reduce(tensor: torch.Tensor, *_codes: int) -> None:
    """The reduction over one rank: ``tensor`` already holds it."""


def copy_into(output: torch.Tensor, input: torch.Tensor, *_rest) -> None:
    """all_gather, reduce_scatter and all_to_all over one rank: ``output`` gets ``input``."""
    if output.data_ptr() != input.data_ptr() or output.shape != input.shape:
        output.copy_(input.reshape(output.shape))


def broadcast(tensor: torch.Tensor, *_rest) -> None:
    """A broadcast from the only rank: nothing to move."""
