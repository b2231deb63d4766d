"""The CUDA VMM wrapper and its selfcheck, on a machine without a GPU: imports, clear errors, arguments.

What needs a GPU (creating, exporting, importing and mapping memory) is checked by
``python -m zbccl.heap.transports.cuda.selfcheck`` and ``tests/gpu/`` on one.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from zbccl.errors import ZbcclInvalidUsageError, ZbcclSystemError
from zbccl.heap.transports.cuda import selfcheck, vmm


def _has_driver() -> bool:
    try:
        vmm.driver()
    except ZbcclSystemError:
        return False
    return True


@pytest.fixture
def fresh_driver(monkeypatch):
    """vmm with no cached driver module (restored afterwards)."""
    monkeypatch.setattr(vmm, "_driver", None)
    return vmm


def test_import_zbccl_loads_no_cuda_bindings():
    # torch may import cuda.bindings itself: only what zbccl adds on top counts
    code = ("import sys, torch; before = set(sys.modules); "
            "import zbccl, zbccl.heap.transports, zbccl.heap.transports.cuda.vmm, "
            "zbccl.heap.transports.cuda.tensors, zbccl.heap.transports.cuda.kernels; "
            "print(sorted(m for m in set(sys.modules) - before if m.startswith(('cuda', 'triton'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_missing_bindings_say_how_to_install(fresh_driver, monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # import cuda.bindings -> ImportError
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", None)
    with pytest.raises(ZbcclSystemError, match=r"cuda-bindings.*pip install zbccl\[cuda\]"):
        fresh_driver.driver()


@pytest.mark.skipif(_has_driver(), reason="this machine has an NVIDIA driver")
def test_no_driver_is_a_clear_error(fresh_driver):
    pytest.importorskip("cuda.bindings.driver", reason="needs cuda-bindings (the test extra has it)")
    with pytest.raises(ZbcclSystemError, match="no NVIDIA driver found, expected libcuda.so to load"):
        fresh_driver.driver()
    # every entry point goes through it
    with pytest.raises(ZbcclSystemError, match="no NVIDIA driver"):
        fresh_driver.granularity(0)
    with pytest.raises(ZbcclSystemError, match="no NVIDIA driver"):
        fresh_driver.Mapping.reserve(0, 1 << 20)


def test_errors_name_the_call_and_the_cuda_error(monkeypatch):
    """A failing driver call raises with the call's name and the CUDA error's name (OOM: out-of-memory class)."""
    drv = pytest.importorskip("cuda.bindings.driver")

    class Fake:
        CUresult = drv.CUresult

        @staticmethod
        def cuGetErrorString(err):
            raise RuntimeError("no driver to describe it")

    monkeypatch.setattr(vmm, "_driver", Fake)
    with pytest.raises(ZbcclSystemError, match="heap: cuMemMap failed, expected CUDA_SUCCESS, got "
                                                "CUDA_ERROR_INVALID_VALUE"):
        vmm.check((drv.CUresult.CUDA_ERROR_INVALID_VALUE,), "cuMemMap")
    from zbccl.errors import ZbcclOutOfMemoryError

    with pytest.raises(ZbcclOutOfMemoryError, match="cuMemCreate failed.*CUDA_ERROR_OUT_OF_MEMORY"):
        vmm.check((drv.CUresult.CUDA_ERROR_OUT_OF_MEMORY, None), "cuMemCreate")
    assert vmm.check((drv.CUresult.CUDA_SUCCESS, 5), "x") == 5
    assert vmm.check((drv.CUresult.CUDA_SUCCESS, 5, 6), "x") == (5, 6)
    assert vmm.check((drv.CUresult.CUDA_SUCCESS,), "x") is None


def test_the_mapper_threads_capture_mode_is_relaxed_through_the_driver(monkeypatch):
    """``relax_capture_mode`` asks the driver for the relaxed mode (a mapper's maps never invalidate a capture of
    another thread) and raises, naming the call, when the driver refuses."""
    drv = pytest.importorskip("cuda.bindings.driver")
    asked = []

    class Fake:
        CUresult, CUstreamCaptureMode = drv.CUresult, drv.CUstreamCaptureMode
        result = drv.CUresult.CUDA_SUCCESS

        @classmethod
        def cuThreadExchangeStreamCaptureMode(cls, mode):
            asked.append(mode)
            return cls.result, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL

        @staticmethod
        def cuGetErrorString(err):
            return drv.CUresult.CUDA_SUCCESS, b"refused"

    monkeypatch.setattr(vmm, "_driver", Fake)
    vmm.relax_capture_mode()
    assert asked == [drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED]
    Fake.result = drv.CUresult.CUDA_ERROR_INVALID_VALUE
    with pytest.raises(ZbcclSystemError, match="cuda: cuThreadExchangeStreamCaptureMode failed"):
        vmm.relax_capture_mode()


def test_chunk_sizes_are_checked_before_the_driver(monkeypatch):
    monkeypatch.setattr(vmm, "_gran", {(0, False): 2 << 20})
    with pytest.raises(ZbcclInvalidUsageError, match="multiple of 2097152, got 4096"):
        vmm.create(4096, 0)
    with pytest.raises(ZbcclInvalidUsageError, match="got 0"):
        vmm.create(0, 0)
    assert vmm.round_up(1, 2 << 20) == 2 << 20 and vmm.round_up(2 << 20, 2 << 20) == 2 << 20


def test_selfcheck_arguments_and_no_gpu_report(capsys):
    with pytest.raises(SystemExit) as info:
        selfcheck.main(["--timeout", "-1"])
    assert info.value.code == 2
    with pytest.raises(SystemExit):
        selfcheck.main(["--device", "-3"])
    if not _torch_cuda():
        assert selfcheck.main(["--timeout", "5"]) == 1
        out = capsys.readouterr().out
        assert "ENV python=" in out and "torch=" in out and "cuda.bindings=" in out
        assert "CHECK cuda_available FAIL torch sees no CUDA device" in out


def _torch_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def test_dlpack_views_alias_memory_and_call_release_once():
    """The DLPack way in (used for a peer GPU's memory) on host memory: zero-copy, release when the last view dies."""
    import ctypes
    import gc

    import torch

    from zbccl.heap.transports.cuda import tensors

    buf = (ctypes.c_uint8 * 64)(*range(64))
    released = []
    t = tensors.dlpack_tensor(ctypes.addressof(buf), 64, tensors.KDLCPU, 0, lambda: released.append(1))
    assert t.dtype == torch.uint8 and t.shape == (64,) and t.data_ptr() == ctypes.addressof(buf)
    assert t[:4].tolist() == [0, 1, 2, 3]
    t[0] = 99
    assert buf[0] == 99
    words = t.view(torch.int64)[1:3]
    del t
    gc.collect()
    assert released == []  # a view still uses the storage
    del words
    gc.collect()
    assert released == [] and tensors._deleted  # the deleter only queued it (no Python code at the death)
    from zbccl.heap import releases

    releases.drain()
    assert released == [1] and not tensors._alive


_KERNELS = """
import torch
from zbccl.heap.transports.cuda import kernels
w = torch.tensor([5, 0], dtype=torch.int64)
out = torch.zeros(1, dtype=torch.int64)
kernels.fetch_add(w.data_ptr(), 3, out)
assert (out.item(), w.tolist()) == (5, [8, 0]), (out, w)
kernels.fetch_add(w.data_ptr() + 8, -2, out)
assert (out.item(), w.tolist()) == (0, [8, -2]), (out, w)
a = torch.arange(3000, dtype=torch.int64) + 1_000_000
b = torch.arange(3000, dtype=torch.int64) + 2_000_000
rows = kernels.gather_rows(torch.tensor([b.data_ptr(), a.data_ptr()], dtype=torch.int64), 2500)
assert torch.equal(rows[0], b[:2500]) and torch.equal(rows[1], a[:2500]), rows[:, :4]
print("ok")
"""


def test_transport_kernels_under_the_triton_interpreter():
    """The transport's own kernels (fetch_add's system-scope atomic, loads through an int64 pointer table) run
    under TRITON_INTERPRET=1 on host memory by raw address, as they do on device memory on a GPU."""
    pytest.importorskip("triton")
    import os

    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", _KERNELS], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_transport_kernels_compile_for_hopper_without_a_gpu():
    """fetch_add must become a system-scope acq_rel atomic (peers are other processes), down to a cubin."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from zbccl.heap.transports.cuda import kernels

    k = kernels._build()
    target = GPUTarget("cuda", 90, 32)
    fa = triton.compile(ASTSource(fn=k["fetch_add"], signature={"addr": "i64", "delta": "i32", "out": "*i64"},
                                  constexprs={}), target=target)
    assert "cubin" in fa.asm and "atom.global.sys.acq_rel.add.u64" in fa.asm["ptx"]
    ga = triton.compile(ASTSource(fn=k["gather"], signature={"ptrs": "*i64", "out": "*i64", "n": "i32",
                                                             "BLOCK": "constexpr"}, constexprs={"BLOCK": 1024}),
                        target=target)
    assert "cubin" in ga.asm
