"""The transport registry: chosen by topology and device, clear errors for what is not built."""

from __future__ import annotations

import pytest

from zbccl.bootstrap.topology import HostInfo, Topology
from zbccl.errors import ZbcclInvalidUsageError
from zbccl.heap import transports
from zbccl.heap.transports.base import Transport
from zbccl.heap.transports.shm import ShmTransport


def _topo(hosts: list[str]) -> Topology:
    return Topology(0, tuple(HostInfo(h, f"host-{h}", 100 + r, 2, (0, 1)) for r, h in enumerate(hosts)))


def test_cpu_on_one_host_is_shm():
    assert transports.select(_topo(["a", "a"]), "cpu") is ShmTransport
    t = transports.create(_topo(["a", "a"]), "cpu", populate=False)
    assert isinstance(t, Transport) and t.name == "shm" and t.device.type == "cpu"
    t.close(unmap=True)


def test_several_cpu_hosts_map_each_host_over_shm():
    # No inter-host transport yet: each host maps its own ranks, whole-world collectives refuse.
    assert transports.select(_topo(["a", "b"]), "cpu") is ShmTransport


def test_cuda_is_the_cuda_transport_and_mooncake_is_reserved_with_a_clear_error():
    from zbccl.heap.transports.cuda.transport import CudaTransport

    assert transports.select(_topo(["a", "a"]), "cuda") is CudaTransport
    assert transports.select(_topo(["a", "a"]), "cuda:1") is CudaTransport
    assert transports.select(_topo(["a", "b"]), "cuda") is CudaTransport  # each host maps its own ranks
    t = transports.create(_topo(["a", "a"]), "cuda")  # nothing touches CUDA before establish
    assert t.name == "cuda" and t.device.type == "cuda" and t.stream is None
    t.close(unmap=True)
    with pytest.raises(ZbcclInvalidUsageError, match="no transport for device meta.*expected device cpu"):
        transports.select(_topo(["a", "a"]), "meta")
    with pytest.raises(ZbcclInvalidUsageError, match="mooncake transport is not available yet"):
        transports.resolve("mooncake")
    with pytest.raises(ZbcclInvalidUsageError, match="unknown transport.*got 'nvlink'"):
        transports.resolve("nvlink")
    assert {e.name for e in transports.entries()} >= {"shm", "cuda", "mooncake"}


def test_shm_refuses_a_device_it_cannot_hold():
    with pytest.raises(ZbcclInvalidUsageError, match="expected device cpu"):
        ShmTransport(device="cuda")


def test_cuda_refuses_a_host_device():
    from zbccl.heap.transports.cuda.transport import CudaTransport

    with pytest.raises(ZbcclInvalidUsageError, match="expected a cuda device, got cpu"):
        CudaTransport(device="cpu")
