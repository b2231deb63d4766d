"""The device kernels' GPU path compiles on a machine without a GPU, with 16-byte accesses on bulk paths.

The interpreter tests never compile the GPU branches (nanosleep, %globaltimer, the hardware bfloat16
conversion, the alignment hints); this compiles a few kernels for sm_90 with triton's bundled ptxas
and reads the PTX.
"""

from __future__ import annotations

import importlib.util
import re

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (pip install zbccl[cuda])")


def _ptx(fn, constexprs: dict, tmp_path, monkeypatch) -> str:
    import triton
    from triton.backends.compiler import GPUTarget

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    pointers = {"data", "pads", "splits"}
    sig = {a: "constexpr" if a in constexprs else "*i64" if a in pointers else "i64" for a in fn.arg_names}
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=constexprs,
                                    attrs={(0,): [["tt.divisibility", 16]]})
    try:
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    except RuntimeError as exc:
        if "ptxas" in str(exc) or "backend" in str(exc).lower():
            pytest.skip(f"no CUDA compiler backend here: {exc}")
        raise
    return compiled.asm["ptx"]


def _accesses(ptx: str) -> set[str]:
    return {m.group(1) for m in re.finditer(r"((?:ld|st)\.global[.\w]*)", ptx)}


def test_one_shot_all_reduce_compiles_with_vector_accesses(tmp_path, monkeypatch):
    from zbccl.native.triton import kernels as k
    from zbccl.native.triton.prims import INTERPRET

    if INTERPRET:
        pytest.skip("TRITON_INTERPRET is set in this process")
    ptx = _ptx(k.all_reduce_kernel, {"W": 4, "DT": 1, "ESZ": 2, "RED": 0, "TWO_SHOT": False, "INPLACE": False,
                                     "BLOCK": 4096, "KW": 16, "INTERP": False}, tmp_path, monkeypatch)
    assert {"ld.global.v4.b32", "st.global.v4.b32"} <= _accesses(ptx)
    assert "nanosleep" in ptx and "%globaltimer" in ptx
    assert "atom.global.sys.release.exch.b64" in ptx and "atom.global.sys.acquire.add.u64" in ptx


def test_all_gather_copies_eight_byte_words(tmp_path, monkeypatch):
    from zbccl.native.triton import kernels as k
    from zbccl.native.triton.prims import INTERPRET

    if INTERPRET:
        pytest.skip("TRITON_INTERPRET is set in this process")
    ptx = _ptx(k.all_gather_kernel, {"W": 2, "CDT": 5, "ESZ": 1, "VAR": False, "ROWS": False, "SKIP_SELF": False,
                                     "BLOCK": 8192, "KW": 16, "INTERP": False}, tmp_path, monkeypatch)
    assert {"ld.global.v2.b64", "st.global.v2.b64"} <= _accesses(ptx)


def test_every_kernel_compiles_with_any_int_argument_specialised_to_one(tmp_path, monkeypatch):
    """On a GPU, triton turns an int argument equal to 1 into a constexpr (a plain int in the kernel): rank 1's
    ``me``, a count of 1. A kernel that calls a tensor method on such an argument (``me.to(...)``) compiles
    on rank 0 and fails on rank 1 only, whose peers then wait for it (GPU run 2's reduce_scatter hang)."""
    from zbccl.native.triton import kernels as k
    from zbccl.native.triton.prims import INTERPRET

    if INTERPRET:
        pytest.skip("TRITON_INTERPRET is set in this process")
    common = {"BLOCK": 1024, "KW": 16, "INTERP": False}
    variants = [
        (k.all_reduce_kernel, {"W": 2, "DT": 0, "ESZ": 4, "RED": 0, "TWO_SHOT": True, "INPLACE": False}),
        (k.all_gather_kernel, {"W": 2, "CDT": 7, "ESZ": 4, "VAR": False, "ROWS": False, "SKIP_SELF": False}),
        (k.reduce_scatter_kernel, {"W": 2, "DT": 0, "ESZ": 4, "RED": 0, "VAR": False, "ROWS": False}),
        (k.all_to_all_kernel, {"W": 2, "CDT": 7, "ESZ": 4, "VAR": False, "GATHER": False}),
        (k.all_to_all_kernel, {"W": 2, "CDT": 7, "ESZ": 4, "VAR": True, "GATHER": False}),
        (k.all_to_all_kernel, {"W": 2, "CDT": 6, "ESZ": 2, "VAR": True, "GATHER": True}),
        (k.broadcast_kernel, {"W": 2, "CDT": 7, "ESZ": 4}),
    ]
    for fn, cx in variants:
        ones = {a: 1 for a in ("me", "cnt", "inner", "outer", "root", "N") if a in fn.arg_names}
        _ptx(fn, {**cx, **common, **ones}, tmp_path, monkeypatch)
