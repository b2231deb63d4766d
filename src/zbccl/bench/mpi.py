"""Open MPI as a second anchor of ``zbccl bench``: ``--baselines mpi`` (opt-in, the ``mpi`` extra).

The bench's ranks are started by ``mpirun -np W --oversubscribe
--allow-run-as-root python -m zbccl.bench.mpi OPTS.json`` instead of the
spawn launcher. Each MPI rank takes its rank from ``MPI.COMM_WORLD``; rank 0
opens the ``TCPStore`` (OS-assigned port, sent to the others with
``bcast``), and every rank then runs the ordinary sweep (``runner.rank_main``)
with :class:`MpiImpl` as the baseline that ``ab.measure_ab`` interleaves with
zbccl round by round on the same heap tensors:
``COMM_WORLD.Allreduce(MPI.IN_PLACE, buf)`` and ``Allgather(inp, out)`` on
numpy views of zbccl's tensors. MPI has no bf16 or fp16 datatype, so MPI is
timed in fp32 cells only (the other dtypes show zbccl and gloo alone).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import IO

import torch

__all__ = ["MPI_OPS", "MPI_DTYPES", "MPI_SETUP", "MpiImpl", "mpi_available", "run_under_mpirun", "main"]

MPI_OPS: tuple[str, ...] = ("all_reduce", "all_gather")
MPI_DTYPES: tuple[str, ...] = ("fp32",)  # MPI has no bf16/fp16 datatype
MPI_SETUP = ("apt-get install -y openmpi-bin libopenmpi-dev && "
             "pip install -e '.[mpi]' (mpi4py)")


def mpi_available() -> str | None:
    """None when ``mpirun`` and ``mpi4py`` are usable here, else what is missing."""
    import importlib.util

    missing = [what for what, ok in (("mpirun", shutil.which("mpirun")),
                                     ("mpi4py", importlib.util.find_spec("mpi4py"))) if not ok]
    return " and ".join(missing) or None


class MpiImpl:
    """Open MPI through mpi4py on numpy views of the caller's tensors (fp32 only)."""

    name = "mpi"
    dtypes = MPI_DTYPES

    def __init__(self) -> None:
        from mpi4py import MPI

        self.MPI, self.comm = MPI, MPI.COMM_WORLD

    def supports(self, op: str) -> bool:
        return op in MPI_OPS

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    def bind(self, op: str, out: torch.Tensor, inp: torch.Tensor) -> Callable[[], object]:
        if inp.dtype != torch.float32:
            raise TypeError(f"mpi: MPI has no datatype for {inp.dtype}, expected torch.float32")
        comm, buf = self.comm, inp.numpy()
        if op == "all_reduce":
            in_place = self.MPI.IN_PLACE
            return lambda: comm.Allreduce(in_place, buf)
        obuf = out.numpy()
        return lambda: comm.Allgather(buf, obuf)

    def sync(self) -> None:
        self.comm.Barrier()

    def staged_bytes(self) -> int:
        return 0


def run_under_mpirun(opts: dict, *, world_size: int, threads: int, out: IO[str], timeout: float) -> dict:
    """Start the sweep's ranks with ``mpirun``; rank 0's results (as ``launch_local``'s rank 0 returns them)."""
    missing = mpi_available()
    if missing:
        raise ValueError(f"--baselines mpi needs Open MPI and mpi4py, expected both here, got no {missing}; "
                         f"install: {MPI_SETUP}")
    src = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryDirectory(prefix="zbccl-bench-mpi-") as tmp:
        job, result = Path(tmp) / "opts.json", Path(tmp) / "result.json"
        job.write_text(json.dumps({"opts": opts, "threads": threads, "result": str(result), "timeout": timeout}))
        cmd = ["mpirun", "-np", str(world_size), "--oversubscribe", "--allow-run-as-root", "--bind-to", "none",
               sys.executable, "-m", "zbccl.bench.mpi", str(job)]
        # the ranks' output (rank 0's progress bar, any traceback) goes straight to our stderr
        proc = subprocess.Popen(cmd, stdout=2, stderr=2, env=env, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"bench: mpirun did not finish in {timeout:.0f}s (its ranks were killed)") from None
        finally:
            if proc.poll() is None:  # timed out or interrupted: leave no rank behind
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if proc.returncode != 0 or not result.exists():
            raise RuntimeError(f"bench: mpirun failed with exit code {proc.returncode} (its output is above)")
        return json.loads(result.read_text())


def main(argv: list[str] | None = None) -> int:
    """One MPI rank: ``python -m zbccl.bench.mpi OPTS.json`` (started by :func:`run_under_mpirun`)."""
    from mpi4py import MPI

    from .runner import rank_main

    job = json.loads(Path((argv or sys.argv[1:])[0]).read_text())
    comm = MPI.COMM_WORLD
    rank, world_size = comm.Get_rank(), comm.Get_size()
    torch.set_num_threads(job["threads"])
    server = None
    if rank == 0:
        server = torch.distributed.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True,
                                            wait_for_workers=False, timeout=timedelta(seconds=job["timeout"]))
    port = comm.bcast(server.port if server else None, root=0)
    store = torch.distributed.TCPStore("127.0.0.1", port, world_size, is_master=False,
                                       timeout=timedelta(seconds=120))
    t0 = time.perf_counter()
    result = rank_main(rank=rank, world_size=world_size, store=store, opts=job["opts"])
    comm.Barrier()
    if rank == 0:
        result["mpi"] = {"library": MPI.Get_library_version().replace("\0", "").strip().splitlines()[0],
                         "mpi4py": __import__("mpi4py").__version__, "dtypes": list(MPI_DTYPES),
                         "ranks_s": round(time.perf_counter() - t0, 1)}
        Path(job["result"]).write_text(json.dumps(result))
    del server
    return 0


if __name__ == "__main__":
    sys.exit(main())
