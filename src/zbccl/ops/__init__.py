"""Zero-buffer collectives over the shared heap (torch.distributed spelling).

Each op file opens with its synchronisation protocol; :mod:`.channel` holds
the handshake they share, :mod:`.reference` the plain-torch references that
are the tests' oracle.
"""

from .allreduce import all_reduce, bind_all_reduce
from .barrier import barrier
from .broadcast import broadcast
from .exchange import all_gather_into_tensor, all_gather_v, all_to_all_single
from .operands import strict_heap
from .reduce_scatter import reduce_scatter_tensor, reduce_scatter_v

__all__ = ["all_reduce", "bind_all_reduce", "all_gather_into_tensor", "all_gather_v", "reduce_scatter_tensor", "reduce_scatter_v",
           "all_to_all_single", "broadcast", "barrier", "strict_heap"]
