"""The transport seam, re-exported: see :mod:`zbccl.heap.transports.base`."""

from .transports.base import NativeHandle, Segment, SignalPad, Transport

__all__ = ["NativeHandle", "Segment", "SignalPad", "Transport"]
