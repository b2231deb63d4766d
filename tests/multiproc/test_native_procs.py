"""Native code across processes: one build for concurrent ranks, signal/wait between two processes.

Moved here from tests/unit: both spawn ranks through tests/spawn.py.
"""

from __future__ import annotations

import ctypes
import mmap
import shutil
import stat
from pathlib import Path

import pytest

from tests.spawn import run_world
from tests.unit.test_native_build import _source
from tests.unit.test_native_core import FLAG, Flags
from zbccl import native
from zbccl.native import build as nb


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("ZBCCL_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _build_rank(ctx, *, src: str) -> str:
    return str(nb.build("race", [Path(src)], lang="c"))


def test_concurrent_builds_compile_once(cache: Path, tmp_path: Path) -> None:
    log = tmp_path / "compiles.log"
    wrapper = tmp_path / "cc-wrapper"
    real = shutil.which("gcc") or shutil.which("cc")
    assert real is not None
    wrapper.write_text(
        f'#!/bin/sh\ncase "$1" in --version) ;; *) echo compile >> {log} ;; esac\nexec {real} "$@"\n'
    )
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    src = _source(tmp_path, 7)
    paths = run_world(_build_rank, 3, timeout=120, src=str(src),
                      env={"ZBCCL_CXX": str(wrapper), "ZBCCL_CACHE_DIR": str(cache)})
    assert len(set(paths)) == 1 and Path(paths[0]).is_file()
    assert log.read_text().count("compile") == 1


# -- two processes over one file-backed MAP_SHARED mapping -----------------------------------

ROUNDS = 200


def _pingpong_rank(ctx, *, path: str) -> dict:
    """Flags: 0 and 1 ping-pong counters, 2 a shared counter, 3 the wake-up flag, 4 never set."""
    import zbccl.native as zn

    c = zn.core()
    with open(path, "r+b") as fh:
        f = Flags(5, mmap.mmap(fh.fileno(), 4096))
    out: dict = {}
    if ctx.rank == 0:  # sleep in the futex phase until rank 1 wakes us (spin=0: yield at once)
        arr = (ctypes.c_uint64 * 1)(f[3])
        out["woken"] = c.wait_ge(ctypes.addressof(arr), 1, 1, 0, 30_000_000_000)
    else:
        while f.waiters(3) == 0:
            c.wait_eq(f[4], 1, 0, 100_000)  # a short pause
        c.signal(f[3], 1)
    for i in range(1, ROUNDS + 1):  # alternate spin=0 and spin=64
        spin = 0 if i % 2 else 64
        if ctx.rank == 0:
            c.signal(f[0], i)
            assert c.wait_eq(f[1], i, spin, 30_000_000_000)
        else:
            assert c.wait_eq(f[0], i, spin, 30_000_000_000)
            c.signal(f[1], i)
    for _ in range(1000):  # concurrent atomic adds on one counter
        c.fetch_add_signal(f[2], 1)
    out["adds"] = c.wait_ge(f.array + 2 * 8, 1, 2000, 0, 30_000_000_000)
    out["timeout_index"] = c.wait_ge(f.array + 2 * 8, 3, 1, 0, 20_000_000)  # flags 2, 3, 4
    return out


def test_two_processes_signal_and_wait(tmp_path: Path) -> None:
    native.core()  # build once in the parent so ranks only load it
    path = tmp_path / "flags"
    path.write_bytes(b"\0" * 4096)
    results = run_world(_pingpong_rank, 2, timeout=120, path=str(path))
    assert results[0]["woken"] == -1
    for r in results:
        assert r["adds"] == -1 and r["timeout_index"] == 2
    with open(path, "rb") as fh:
        data = fh.read()
    vals = [int.from_bytes(data[i * FLAG:i * FLAG + 8], "little", signed=True) for i in range(5)]
    assert vals == [ROUNDS, ROUNDS, 2000, 1, 0]
