"""What a newcomer meets first: heap tensors' device argument, the backend's devices, ``zbccl info``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zbccl
from zbccl.tools.info import display_value, native_lines


@pytest.fixture
def world1(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    zbccl.init(heap_size="2M")
    yield
    zbccl.finalize()


def test_heap_tensors_take_a_cpu_device(world1) -> None:
    for device in (None, "cpu", torch.device("cpu")):
        t = zbccl.empty(4, device=device)
        assert t.device.type == "cpu" and zbccl.is_heap_tensor(t)
    assert zbccl.zeros(2, 3, device="cpu").sum() == 0
    assert zbccl.is_heap_tensor(zbccl.empty_like(torch.ones(3), device="cpu"))
    # a job without a CUDA heap (init(device="cuda") builds one): a clear error, nothing allocated
    with pytest.raises(zbccl.ZbcclInvalidUsageError, match=r"empty: no cuda heap in this job, expected one built "
                                                           r"at init \(init\(device='cuda'\).*got heaps for \['cpu'\]"):
        zbccl.empty(4, device="cuda")
    with pytest.raises(zbccl.ZbcclInvalidUsageError, match="empty: no heap on that device, expected 'cpu' or "
                                                           "'cuda', got 'meta'"):
        zbccl.empty(4, device="meta")
    with pytest.raises(zbccl.ZbcclInvalidUsageError, match="memory_stats: no cuda heap in this job"):
        zbccl.memory_stats(device="cuda")
    with pytest.raises(zbccl.ZbcclInvalidUsageError, match="empty: bad device, expected 'cpu' or 'cuda', got "
                                                           "'nowhere'"):
        zbccl.zeros(4, device="nowhere")
    assert zbccl.memory_stats()["active_blocks"] == zbccl.memory_stats(device="cpu")["active_blocks"]
    with pytest.raises(zbccl.ZbcclInvalidUsageError, match="heap_scope: no cuda heap in this job"):
        with zbccl.heap_scope(device="cuda"):
            pass


def test_the_backend_registers_cpu_and_cuda(monkeypatch) -> None:
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    assert dist.Backend.backend_capability["zbccl"] == ["cpu", "cuda"]
    dist.init_process_group("cuda:zbccl", store=dist.HashStore(), rank=0, world_size=1)
    try:  # torch hands a Python process group the whole group: CPU tensors reach zbccl too
        t = torch.arange(5.0)
        dist.all_reduce(t)
        assert torch.equal(t, torch.arange(5.0)) and zbccl.is_initialized()
    finally:
        dist.destroy_process_group()
    assert not zbccl.is_initialized()


def test_info_shows_values_as_a_person_reads_them() -> None:
    assert display_value("ZBCCL_HEAP_MAX", None) == "auto"
    assert display_value("ZBCCL_THREADS", -1) == "auto" and display_value("ZBCCL_WAIT_POLL_US", -1.0) == "auto"
    assert display_value("ZBCCL_THREADS", 4) == "4"
    assert display_value("ZBCCL_SMA_CACHE_LIMIT", 1 << 62) == "unlimited"
    assert display_value("ZBCCL_HEAP_SIZE", 256 << 20) == "256.0 MiB"
    assert display_value("ZBCCL_STRICT", False) == "off" and display_value("ZBCCL_ALGO", "") == "(none)"
    lines = native_lines({"core": {"built": True, "origin": "prebuilt (wheel)", "loaded": True, "path": "/x/core.so"},
                          "hot": {"built": False, "error": "native build: no c++ compiler"}})
    assert lines == ["  core             prebuilt (wheel), loaded: /x/core.so",
                     "  hot              not built (native build: no c++ compiler)"]


def test_torch_versions_outside_the_matrix(monkeypatch) -> None:
    from zbccl import native

    monkeypatch.setattr(native, "_torch_checked", False)
    monkeypatch.setattr(torch, "__version__", "2.3.1+cpu")
    with pytest.raises(zbccl.ZbcclSystemError, match=r"init: torch too old, expected torch >= 2.4 .* got 2.3.1"):
        native.check_torch()
    monkeypatch.setattr(torch, "__version__", "2.12.0+cu130")
    with pytest.warns(RuntimeWarning, match=r"torch 2.12.0\+cu130 is untested \(the test suite ran on torch 2.13\)"):
        native.check_torch()
    native.check_torch()  # once per process: no second warning
    monkeypatch.setattr(native, "_torch_checked", False)
    monkeypatch.setattr(torch, "__version__", "2.13.0+cpu")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        native.check_torch()
