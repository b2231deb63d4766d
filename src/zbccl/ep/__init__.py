"""``zbccl.ep``: DeepEP-compatible MoE expert parallelism (``import zbccl.ep as deep_ep``).

Dispatch and combine over the shared heap with exact-size receive tensors: a small header
all_gather publishes every rank's counts and heap offsets, then each receiver pulls its rows
straight from the senders' memory. See :class:`Buffer`.
"""

from .buffer import Buffer
from .config import Config, get_low_latency_rdma_size_hint, topk_idx_t
from .event import EventHandle, EventOverlap

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "topk_idx_t", "get_low_latency_rdma_size_hint"]
