"""The transports the conformance suite runs over: add a registered transport's name to ``TRANSPORTS``."""

from __future__ import annotations

import pytest

#: Every transport that must pass the suite (``zbccl.heap.transports`` registry names).
TRANSPORTS = ["shm", "mooncake"]


@pytest.fixture(params=TRANSPORTS)
def transport_name(request) -> str:
    if request.param == "mooncake":
        from zbccl.heap.transports.mooncake import missing_reason

        reason = missing_reason()
        if reason:
            pytest.skip(f"mooncake transport unavailable: {reason}")
    return request.param
