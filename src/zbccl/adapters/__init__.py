"""PyTorch adapters: explicit heap tensors and the scoped heap allocator."""

from .tensors import empty, empty_like, export, is_heap_tensor, memory_snapshot, memory_stats, zeros

__all__ = ["empty", "zeros", "empty_like", "is_heap_tensor", "export", "memory_stats", "memory_snapshot"]
