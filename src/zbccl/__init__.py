"""zbccl: zero-buffer collective communication over a globally addressable heap.

Every rank's tensors can live in a shared heap that every peer maps, so
collectives read and write peers' tensors directly, without staging buffers.

Layers (one subpackage each, dependencies flow downwards only):
``adapters`` (torch-facing API) -> ``runtime`` (communicators, waits) ->
``sma`` (sub-allocator) -> ``heap`` (segments, transports) -> ``bootstrap``
(rendezvous, topology), with ``native`` (C/C++ inner loops) beside them.
Importing zbccl has no side effects: nothing is built or mapped until used.
"""

from ._version import __version__
from .adapters.backend import register as _register_backend
from .adapters.scope import heap_scope
from .adapters.tensors import (
    HeapHandle,
    empty,
    empty_like,
    export,
    is_heap_tensor,
    memory_snapshot,
    memory_stats,
    zeros,
)
from .errors import (
    ErrorCode,
    ZbcclError,
    ZbcclInvalidUsageError,
    ZbcclOutOfMemoryError,
    ZbcclRemoteError,
    ZbcclSystemError,
    ZbcclTimeoutError,
)
from .ops import (
    all_gather_into_tensor,
    all_gather_v,
    all_reduce,
    all_to_all_single,
    barrier,
    broadcast,
    reduce_scatter_tensor,
    reduce_scatter_v,
    strict_heap,
)
from .runtime.communicator import Communicator
from .runtime.state import abort, finalize, get_default, init, is_initialized

_register_backend()  # torch.distributed's "zbccl" backend: one name in torch's table, nothing built

__all__ = [
    "__version__",
    "init",
    "finalize",
    "abort",
    "is_initialized",
    "get_default",
    "Communicator",
    "HeapHandle",
    "empty",
    "zeros",
    "empty_like",
    "is_heap_tensor",
    "export",
    "heap_scope",
    "memory_stats",
    "memory_snapshot",
    "all_reduce",
    "all_gather_into_tensor",
    "all_gather_v",
    "reduce_scatter_tensor",
    "reduce_scatter_v",
    "all_to_all_single",
    "broadcast",
    "barrier",
    "strict_heap",
    "ErrorCode",
    "ZbcclError",
    "ZbcclInvalidUsageError",
    "ZbcclOutOfMemoryError",
    "ZbcclRemoteError",
    "ZbcclSystemError",
    "ZbcclTimeoutError",
]
