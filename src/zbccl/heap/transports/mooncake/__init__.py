"""The mooncake transport: ranks on other hosts through Mooncake Transfer Engine (``pip install zbccl[internode]``).

Importing this package does not import Mooncake: the engine loads when a
transport is created (``engine.load``), with one clear error when the wheel
or ``libibverbs1`` is missing.
"""

from .engine import INSTALL, missing_reason
from .transport import MooncakeTransport

__all__ = ["INSTALL", "MooncakeTransport", "missing_reason"]
