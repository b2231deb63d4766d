"""The shm transport: host memory shared between the processes of one host (memfd + pidfd)."""

from .transport import ShmTransport

__all__ = ["ShmTransport"]
