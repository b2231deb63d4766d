"""``zbccl bench --baselines mpi --quick``: Open MPI interleaved with zbccl in the same mpirun ranks.

Runs only where ``mpirun`` and mpi4py exist (the ``mpi`` extra). MPI is timed in fp32 cells only;
bf16 cells show zbccl alone.
"""

from __future__ import annotations

import io

import pytest

from zbccl.bench import ab
from zbccl.bench.mpi import mpi_available
from zbccl.bench.runner import run_bench

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


@pytest.mark.skipif(mpi_available() is not None, reason="needs mpirun and mpi4py: the mpi extra")
def test_interleaved_mpi_quick():
    out = io.StringIO()
    doc = run_bench(world_size=2, ops=["all_reduce", "all_gather"], dtypes=["fp32", "bf16"], min_size="4K",
                    max_size="64K", baselines=["mpi"], quick=True, threads=1, idle_wait=0.0, progress=False, out=out)
    assert doc["mpi"]["dtypes"] == ["fp32"]
    for cell in doc["cells"]:
        assert cell["zbccl"]["wrong"] == 0 and cell["zbccl"]["staged_bytes"] == 0, cell
        if cell["dtype"] == "fp32":
            assert cell["mpi"]["wrong"] == 0 and cell["ab"]["rounds"] == ab.ab_rounds(doc["options"]["timing"]["reps"])
        else:
            assert "mpi" not in cell and "ab" not in cell
    assert "mpi/zbccl" in out.getvalue()
