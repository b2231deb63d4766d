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


def test_several_cpu_hosts_route_remote_ranks_to_mooncake():
    from zbccl.heap.transports.mooncake import missing_reason
    from zbccl.heap.transports.routed import RoutedTransport

    # With Mooncake: shm within a host, mooncake between hosts. Without it: each host maps its own ranks
    # over shm, and whole-world collectives refuse, as before the inter-host transport.
    want = ShmTransport if missing_reason() else RoutedTransport
    assert transports.select(_topo(["a", "b"]), "cpu") is want
    assert transports.select(_topo(["a", "a"]), "cpu") is ShmTransport


def test_cuda_is_the_cuda_transport_and_a_missing_mooncake_says_how_to_install():
    from zbccl.errors import ZbcclSystemError
    from zbccl.heap.transports.cuda.transport import CudaTransport
    from zbccl.heap.transports.mooncake import MooncakeTransport, missing_reason

    assert transports.select(_topo(["a", "a"]), "cuda") is CudaTransport
    assert transports.select(_topo(["a", "a"]), "cuda:1") is CudaTransport
    assert transports.select(_topo(["a", "b"]), "cuda") is CudaTransport  # each host maps its own ranks
    t = transports.create(_topo(["a", "a"]), "cuda")  # nothing touches CUDA before establish
    assert t.name == "cuda" and t.device.type == "cuda" and t.stream is None
    t.close(unmap=True)
    with pytest.raises(ZbcclInvalidUsageError, match="no transport for device meta.*expected device cpu"):
        transports.select(_topo(["a", "a"]), "meta")
    assert transports.resolve("mooncake") is MooncakeTransport  # importable without the wheel
    if missing_reason():
        with pytest.raises(ZbcclSystemError, match=r"pip install 'zbccl\[internode\]'"):
            MooncakeTransport()
    with pytest.raises(ZbcclInvalidUsageError, match="unknown transport.*got 'nvlink'"):
        transports.resolve("nvlink")
    assert {e.name for e in transports.entries()} >= {"shm", "cuda", "mooncake", "routed"}


def test_a_missing_libibverbs_says_so(monkeypatch):
    import builtins

    from zbccl.errors import ZbcclSystemError
    from zbccl.heap.transports.mooncake import engine

    real = builtins.__import__

    def fake(name, *args, **kwargs):
        if name == "mooncake":
            raise ImportError("libibverbs.so.1: cannot open shared object file: No such file or directory")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake)
    with pytest.raises(ZbcclSystemError, match="apt-get install -y libibverbs1"):
        engine.load()


def test_shm_refuses_a_device_it_cannot_hold():
    with pytest.raises(ZbcclInvalidUsageError, match="expected device cpu"):
        ShmTransport(device="cuda")


def test_cuda_refuses_a_host_device():
    from zbccl.heap.transports.cuda.transport import CudaTransport

    with pytest.raises(ZbcclInvalidUsageError, match="expected a cuda device, got cpu"):
        CudaTransport(device="cpu")
