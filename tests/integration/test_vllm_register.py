"""The vLLM plugin's switch and version pin (no engine is started).

Without ``ZBCCL_VLLM`` the hook returns before importing vLLM at all. Under ``.venv-vllm`` (skipped
without it): another vLLM version is refused with exactly one warning and leaves the platform's
communicator alone; the pinned one routes it to ``ZbcclCpuCommunicator``, idempotently.
"""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest

from tests.integration.test_vllm_plugin import ROOT, _venv_python

_CHILD = r"""
import os, warnings
os.environ["ZBCCL_VLLM"] = "1"
import vllm
from vllm.platforms.cpu import CpuPlatform
import zbccl.integrations.vllm as plugin

own = CpuPlatform.get_device_communicator_cls()
real = vllm.__version__
vllm.__version__ = "0.31.1"
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    plugin.register(); plugin.register()
refused = [str(x.message) for x in w if issubclass(x.category, RuntimeWarning)]
assert len(refused) == 1 and "expected 0.32.0, got 0.31.1" in refused[0], refused
assert CpuPlatform.get_device_communicator_cls() == own, CpuPlatform.get_device_communicator_cls()
vllm.__version__ = real
plugin.register(); plugin.register()
assert CpuPlatform.get_device_communicator_cls().endswith("ZbcclCpuCommunicator")
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
assert getattr(CPUModelRunner._model_forward, "_zbccl_heap_scope", False)
assert getattr(CPUModelRunner.execute_model.__wrapped__, "_zbccl_heap_scope", False) is False
print("OK")
"""


def test_register_is_a_no_op_without_the_variable(monkeypatch):
    monkeypatch.delenv("ZBCCL_VLLM", raising=False)
    from zbccl.integrations import vllm as plugin

    had_vllm = "vllm" in sys.modules
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plugin.register()
    assert ("vllm" in sys.modules) == had_vllm
    assert plugin.supported("0.32.0") and plugin.supported("0.32.0+cpu")
    assert not plugin.supported("0.31.1") and not plugin.supported("0.32.1")


@pytest.mark.vllm
def test_version_pin_and_patch_under_vllm():
    py = _venv_python()
    if py is None:
        pytest.skip("needs .venv-vllm (make vllm-e2e)")
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([str(py), "-c", _CHILD], env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), (proc.stdout + proc.stderr)[-4000:]
