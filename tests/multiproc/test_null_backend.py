"""World size 1 runs every collective with no native core (the null backend), in a subprocess whose
core import fails; world size 2 without the core refuses clearly at init (ZbcclSystemError), and the
torch backend then runs the group on gloo after one warning, with zbccl.empty() saying why."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from tests.spawn import run_world

SRC = Path(__file__).resolve().parents[2] / "src"

_NO_CORE = """
import zbccl.native
from zbccl.errors import ZbcclSystemError

def _no_core():
    raise ZbcclSystemError("native build: no c compiler (test)")

zbccl.native.core = _no_core
"""

_WORLD_1 = """
import torch
import zbccl
from zbccl.heap.flags import primitives
from zbccl.ops.reference import all_gather_ref, all_reduce_ref, reduce_scatter_ref

comm = zbccl.init(heap_size="4M")
assert not hasattr(primitives(), "chan_new"), "the native core must be unavailable here"
x = torch.arange(12, dtype=torch.float32)
for heap in (True, False):
    t = zbccl.empty(12) if heap else torch.empty(12)
    t.copy_(x)
    for op, code in (("sum", 0), ("avg", 4), ("max", 2)):
        zbccl.all_reduce(t, op)
        assert torch.equal(t, all_reduce_ref([x], code)), op
    out = torch.empty(12)
    zbccl.all_gather_into_tensor(out, t)
    assert torch.equal(out, all_gather_ref([x]))
    zbccl.all_gather_v(out.view(6, 2), t.view(6, 2), [6])
    assert torch.equal(out, x)
    zbccl.reduce_scatter_tensor(out, t)
    assert torch.equal(out, reduce_scatter_ref([x], 0, [12], 0))
    zbccl.reduce_scatter_v(out.view(4, 3), t.view(4, 3), [4])
    assert torch.equal(out, x)
    out.zero_()
    zbccl.all_to_all_single(out, t)
    assert torch.equal(out, x)
    zbccl.all_to_all_single(out.view(6, 2), t.view(6, 2), [6], [6])
    assert torch.equal(out, x)
    zbccl.broadcast(t, 0)
    assert torch.equal(t, x)
zbccl.barrier()
try:
    zbccl.all_reduce(torch.ones(2, dtype=torch.int32), "avg")
except zbccl.ZbcclInvalidUsageError as exc:
    assert "avg needs a floating dtype" in str(exc)
else:
    raise AssertionError("avg of ints must be refused")
del t, out
zbccl.finalize()
print("null backend ok")
"""


def test_every_op_at_world_1_without_the_native_core(tmp_path):
    script = tmp_path / "world1.py"
    script.write_text(textwrap.dedent(_NO_CORE + _WORLD_1))
    env = {"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin", "ZBCCL_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "null backend ok" in proc.stdout


def _world_2_without_core(ctx):
    import pytest

    exec(_NO_CORE, {})

    import zbccl

    with pytest.raises(zbccl.ZbcclSystemError, match="init: the native core is required for world size 2: "
                       "native build: no c compiler"):
        ctx.init(heap_size=1 << 20, timeout=30)
    assert not zbccl.is_initialized()
    return True


def test_world_2_without_the_native_core_fails_at_init():
    assert run_world(_world_2_without_core, 2, timeout=60) == [True, True]


def _backend_without_core(ctx):
    import warnings

    import pytest

    exec(_NO_CORE, {})
    import torch
    import torch.distributed as dist

    import zbccl

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist.init_process_group("zbccl", store=ctx.store(), rank=ctx.rank, world_size=ctx.world_size)
    fallbacks = [str(w.message) for w in caught if "runs every op" in str(w.message)]
    assert len(fallbacks) == 1 and "native core is required" in fallbacks[0], fallbacks
    t = torch.full((4,), float(ctx.rank + 1))
    dist.all_reduce(t)  # on gloo
    assert torch.equal(t, torch.full((4,), 3.0))
    with pytest.raises(zbccl.ZbcclInvalidUsageError,
                       match=r"empty: zbccl is not initialized.*ran this job on gloo instead.*native core is required"):
        zbccl.empty(4)
    dist.destroy_process_group()
    return True


def test_backend_without_the_native_core_falls_back_to_gloo_once():
    assert run_world(_backend_without_core, 2, timeout=60) == [True, True]
