"""The examples run: the plain torch.distributed one and the EP one under torchrun (2 ranks), and the vLLM
ones exit with a clear message where vLLM is not installed."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
                OMP_NUM_THREADS="1")


def _torchrun(script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(EXAMPLES / script), *args], env=_env(), cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def test_torch_distributed_example_checks_every_collective(tmp_path: Path) -> None:
    proc = _torchrun("torch_distributed.py", "--heap-scope", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for op in ("all_reduce", "all_gather_single", "all_gather", "reduce_scatter_single", "all_to_all_single",
               "broadcast", "reduce", "send/recv"):
        assert f"{op:<22} ok" in proc.stdout, (op, proc.stdout)
    assert "WRONG" not in proc.stdout and "staged_bytes 0" in proc.stdout


def test_ep_example_combines_what_plain_torch_computes(tmp_path: Path) -> None:
    proc = _torchrun("ep_dispatch_combine.py", "--tokens", "24", "--hidden", "128", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("combine ok") == 2, proc.stdout


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed in this Python")
def test_vllm_examples_say_what_is_missing(tmp_path: Path) -> None:
    for script, words in (("vllm_tp.py", "vLLM is not installed in this Python"),
                          ("vllm_bench.py", "no vLLM environment at")):
        args = ["--python", str(tmp_path / "no-such-python")] if script == "vllm_bench.py" else []
        proc = subprocess.run([sys.executable, str(EXAMPLES / script), *args], env=_env(), cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 1 and words in proc.stderr and "make vllm-baseline" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr, proc.stderr
