"""Every Python snippet of README.md runs, as the README tells a reader to run it.

Each ```python block must be preceded by ``<!-- snippet: torchrun [hf] -->`` (run with
``torchrun --standalone --nproc-per-node 2``) or ``<!-- snippet: python -->`` (one process); an
untagged block fails the test, so no snippet escapes. ``hf`` snippets need the hf extra, ``cuda``
snippets a CUDA device and the cuda extra (each skipped, saying why, without them; the GPU check runs
the CUDA ones). Each runs in its own temporary directory with this checkout's ``src`` on PYTHONPATH.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
_BLOCK = re.compile(r"(?:<!-- snippet: (?P<tag>[^>]*?) -->\n)?```python\n(?P<code>.*?)```", re.S)


def snippets() -> list[tuple[str, str, str]]:
    """``(id, tag, code)`` of every python block, in order; tag '' for an untagged one."""
    out, text = [], README.read_text()
    for m in _BLOCK.finditer(text):
        line = text[:m.start("code")].count("\n") + 1
        out.append((f"line{line}", (m.group("tag") or "").strip(), m.group("code")))
    return out


def test_every_python_block_is_tagged() -> None:
    found = snippets()
    assert len(found) >= 4, found
    untagged = [sid for sid, tag, _ in found if tag.split()[:1] not in (["torchrun"], ["python"])]
    assert not untagged, f"README python blocks without a '<!-- snippet: torchrun|python -->' tag: {untagged}"


@pytest.mark.parametrize("sid,tag,code", snippets(), ids=[s[0] for s in snippets()])
def test_snippet_runs(sid: str, tag: str, code: str, tmp_path: Path) -> None:
    words = tag.split()
    if "hf" in words and (importlib.util.find_spec("transformers") is None
                          or importlib.util.find_spec("accelerate") is None):
        pytest.skip("needs the hf extra: pip install -e '.[hf]'")
    if "cuda" in words:
        import torch

        if not torch.cuda.is_available() or importlib.util.find_spec("cuda") is None:
            pytest.skip("needs a CUDA device and the cuda extra: pip install -e '.[cuda]'")
    script = tmp_path / f"snippet_{sid}.py"
    script.write_text(code)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(script)] if words[0] == "python" else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"README snippet at {sid} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
