"""The globally addressable heap: segment layout, transports, bounds-checked access."""

from .base import Segment, Transport
from .heap import GlobalHeap
from .views import HeapHandle, view_heap

__all__ = ["Segment", "Transport", "GlobalHeap", "HeapHandle", "view_heap"]
