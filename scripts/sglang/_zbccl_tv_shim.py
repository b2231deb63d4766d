"""Lets ``import torchvision`` work under CPU torch in .venv-sglang (loaded by _zbccl_tv_shim.pth).

Exists only because SGLang's CPU packaging on PyPI is incomplete: SGLang imports torchvision at
import time even for text models (srt/multimodal/internvl_utils.py), and PyPI's only torchvision
0.28.0 for Linux is the +cu130 build, whose _C.so needs libtorch_cuda.so. Its ops are then never
registered, and torchvision/_meta_registrations.py fails on
``register_fake("torchvision::nms")`` (and ``qnms``), the two registrations it does not guard.
Before torchvision is first imported, this defines those two schemas (no kernels: calling them
raises). Nothing else is changed; the finder removes itself after that one import.
"""

import importlib.abc
import sys


class _DefineTorchvisionSchemas(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision":
            sys.meta_path.remove(self)
            import torch

            lib = torch.library.Library("torchvision", "FRAGMENT")
            lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            _libs.append(lib)  # a Library deregisters its schemas when collected
        return None  # the real torchvision is then found as usual


_libs = []
if not any(isinstance(f, _DefineTorchvisionSchemas) for f in sys.meta_path):
    sys.meta_path.insert(0, _DefineTorchvisionSchemas())
