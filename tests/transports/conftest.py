"""The transports the conformance suite runs over: add a registered transport's name to ``TRANSPORTS``."""

from __future__ import annotations

import pytest

#: Every transport that must pass the suite (``zbccl.heap.transports`` registry names).
TRANSPORTS = ["shm", "cuda", "mooncake"]


def unavailable(name: str) -> str | None:
    """Why transport ``name`` cannot run on this machine (None: it can)."""
    if name == "mooncake":
        from zbccl.heap.transports.mooncake import missing_reason

        return missing_reason()
    if name != "cuda":
        return None
    import torch

    from zbccl.heap.transports.cuda import kernels, vmm

    if not torch.cuda.is_available():
        return f"no CUDA device (torch {torch.__version__}, built for CUDA {torch.version.cuda})"
    try:
        vmm.driver()
    except Exception as exc:  # noqa: BLE001 - the reason is the message
        return str(exc)
    if not kernels.triton_available():
        return "triton is missing (pip install zbccl[cuda])"
    return None


@pytest.fixture(params=TRANSPORTS)
def transport_name(request) -> str:
    reason = unavailable(request.param)
    if reason:
        pytest.skip(f"{request.param} transport unavailable here: {reason}")
    return request.param
