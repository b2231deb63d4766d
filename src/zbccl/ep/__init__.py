"""``zbccl.ep``: DeepEP-compatible MoE expert parallelism (``import zbccl.ep as deep_ep``).

Dispatch and combine over the shared heap with exact-size receive tensors: every rank publishes a
small header (its counts and heap offsets) in its heap, a barrier makes them visible, then each
receiver pulls its rows straight from the senders' memory (native kernels in ``native/csrc/ep.c``; their
plain-torch oracle is :mod:`zbccl.ep.reference`). See :class:`Buffer`.
"""

from .buffer import Buffer
from .config import Config, get_low_latency_rdma_size_hint, topk_idx_t
from .event import EventHandle, EventOverlap

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "topk_idx_t", "get_low_latency_rdma_size_hint"]
