"""The transports the conformance suite runs over: add a registered transport's name to ``TRANSPORTS``."""

from __future__ import annotations

import pytest

#: Every transport that must pass the suite (``zbccl.heap.transports`` registry names).
TRANSPORTS = ["shm"]


@pytest.fixture(params=TRANSPORTS)
def transport_name(request) -> str:
    return request.param
