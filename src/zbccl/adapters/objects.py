"""Python objects as uint8 tensors: how the engine plugins send an object through zbccl's tensor ops.

vLLM's ``send_tensor_dict`` header and SGLang's object broadcasts and gathers travel pickled, in a
uint8 tensor (one copy of the pickle, made by numpy from the bytes object: no view over memory
that Python owns, no address). Unpickling trusts the sender as torch's own object collectives do:
the peers are ranks of the same job.
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import torch

__all__ = ["object_to_tensor", "tensor_to_object"]


def object_to_tensor(obj: Any) -> torch.Tensor:
    """``obj`` pickled: a new uint8 tensor ``[len(pickle)]``."""
    return torch.from_numpy(np.array(memoryview(pickle.dumps(obj)), dtype=np.uint8))


def tensor_to_object(t: torch.Tensor) -> Any:
    """The object :func:`object_to_tensor` pickled into ``t`` (a contiguous uint8 tensor, or its copy)."""
    return pickle.loads(t.numpy().tobytes())
