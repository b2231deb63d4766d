"""What the engine end-to-end tests (vLLM, SGLang) share: finding the engine's venv, and the processes of a run."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

__all__ = ["ROOT", "engine_python", "tagged_pids"]

ROOT = Path(__file__).resolve().parents[2]


def engine_python(venv: str) -> Path | None:
    """``<venv>/bin/python`` of this checkout, or of the main worktree when this is a linked one; None if absent."""
    roots = [ROOT]
    try:
        common = subprocess.run(["git", "rev-parse", "--git-common-dir"], cwd=ROOT, capture_output=True,
                                text=True, timeout=10).stdout.strip()
        if common:
            roots.append((ROOT / common).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        pass
    for root in roots:
        py = root / venv / "bin" / "python"
        if py.exists():
            return py
    return None


def tagged_pids(var: str, tag: str) -> list[int]:
    """Pids of live processes whose environment carries ``var=tag`` (a run's whole process tree)."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if f"{var}={tag}".encode() in f.read().split(b"\0"):
                    pids.append(int(name))
        except OSError:
            continue
    return pids
