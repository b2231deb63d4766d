"""A stand-in ``sgl_kernel`` for .venv-sglang on a CPU without AMX (installed by setup_sglang.sh).

Exists only because SGLang's CPU packaging on PyPI is incomplete: PyPI has no CPU build of
sgl_kernel (``sglang-kernel`` 0.4.10 is CUDA-only), yet SGLang 0.5.23 does
``from sgl_kernel import copy_all_layer_kv_cache_cpu`` at import time when
SGLANG_USE_CPU_ENGINE=1 (kernels/ops/kvcache/cache_move.py). On a CPU without AMX every other
sgl_kernel CPU op is gated off by cpu_has_amx_support(), which stays False because this stub
registers no ``torch.ops.sgl_kernel`` ops (so SGLang's shared-memory all-reduce stays off too).
Any name imported from here is a function that raises NotImplementedError when called; none is
called on the torch_native CPU path. On a Xeon with AMX, build the real CPU sgl_kernel instead.
"""


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name}: not available, expected SGLang's CPU sgl_kernel "
                                  f"(built from source for AMX CPUs), got the stub of zbccl's setup_sglang.sh")

    missing.__name__ = name
    return missing
