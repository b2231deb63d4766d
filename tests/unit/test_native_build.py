"""Build-and-cache of native code: keys, caching, errors, concurrency, status."""

from __future__ import annotations

import ctypes
import os
import subprocess
from pathlib import Path

import pytest

from zbccl import native
from zbccl.errors import ZbcclSystemError
from zbccl.native import build as nb

_SRC = "int zb_answer(void) { return %d; }\n"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("ZBCCL_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _source(tmp_path: Path, value: int = 42, name: str = "answer.c") -> Path:
    src = tmp_path / name
    src.write_text(_SRC % value)
    return src


def test_build_loads_and_second_call_is_cached(cache: Path, tmp_path: Path, monkeypatch, capfd) -> None:
    src = _source(tmp_path)
    lib = nb.build("answer", [src], lang="c")
    assert lib.is_file() and lib.parent.parent == cache / "native"
    assert "zbccl: building native library answer (first use, cached in" in capfd.readouterr().err
    assert ctypes.CDLL(str(lib)).zb_answer() == 42
    info = nb.read_build_info(lib.parent)
    assert info["seconds"] >= 0 and info["compiler"]

    def no_compiler(*args, **kwargs):
        raise AssertionError(f"compiler run on a cached build: {args}")

    monkeypatch.setattr(subprocess, "run", no_compiler)  # --version is memoized too
    assert nb.build("answer", [src], lang="c") == lib
    assert capfd.readouterr().err == ""


def test_key_covers_source_and_flags(cache: Path, tmp_path: Path) -> None:
    src = _source(tmp_path, 1)
    first = nb.build("answer", [src], lang="c")
    flagged = nb.build("answer", [src], lang="c", extra_flags=("-DZB_UNUSED=1",))
    src.write_text(_SRC % 2)
    changed = nb.build("answer", [src], lang="c")
    assert len({first, flagged, changed}) == 3
    assert ctypes.CDLL(str(changed)).zb_answer() == 2
    leftovers = [p.name for p in (cache / "native").iterdir() if p.name.startswith(".")]
    assert leftovers == []


def test_compile_error_names_command_and_stderr(cache: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.c"
    bad.write_text("int broken( { return }\n")
    with pytest.raises(ZbcclSystemError) as info:
        nb.build("bad", [bad], lang="c")
    msg = str(info.value)
    assert "command:" in msg and str(bad) in msg and "error" in msg
    assert not any(p.suffix != ".lock" for p in (cache / "native").iterdir())


def test_bad_lang_and_missing_compiler(cache: Path, tmp_path: Path, monkeypatch) -> None:
    with pytest.raises(ValueError, match="bad lang"):
        nb.build("x", [_source(tmp_path)], lang="fortran")  # type: ignore[arg-type]
    monkeypatch.setenv("ZBCCL_CXX", str(tmp_path / "no-such-cc"))
    with pytest.raises(ZbcclSystemError, match="cannot run compiler"):
        nb.build("x", [_source(tmp_path)], lang="c")


def test_status_reports_without_building(cache: Path) -> None:
    st = native.status()
    assert set(st) == set(native.LIBRARIES)
    for row in st.values():
        assert row["built"] is False and "path" in row and row["compiler"]
    assert not (cache / "native").exists() or not any((cache / "native").iterdir())


def test_build_all_and_status(cache: Path) -> None:
    paths = native.build_all()
    assert set(paths) == set(native.LIBRARIES) and all(p.is_file() for p in paths.values())
    st = native.status()
    for name, row in st.items():
        assert row["built"] and row["path"] == str(paths[name]) and row["build_seconds"] is not None
    assert os.path.basename(native.core().__file__).startswith("core")


def test_a_built_library_is_found_without_running_the_compiler(cache: Path, tmp_path: Path, monkeypatch) -> None:
    """Every rank of every later process finds its libraries without a fork: the compiler's --version is
    recorded in the cache (a full process table made that fork fail with EAGAIN under load)."""
    src = _source(tmp_path)
    lib = nb.build("answer", [src], lang="c")
    nb._compiler_version.cache_clear()  # as in a fresh process

    def no_spawn(*args, **kwargs):
        raise AssertionError(f"a process was spawned to find a built library: {args}")

    monkeypatch.setattr(subprocess, "run", no_spawn)
    assert nb.build("answer", [src], lang="c") == lib
    assert (cache / "native" / "compilers.json").is_file()


def test_compiler_runs_retry_when_fork_fails_with_eagain(monkeypatch) -> None:
    calls = []
    real = subprocess.run

    def flaky(*args, **kwargs):
        calls.append(args)
        if len(calls) < 3:
            raise BlockingIOError(11, "Resource temporarily unavailable")
        return real(*args, **kwargs)

    monkeypatch.setattr(subprocess, "run", flaky)
    monkeypatch.setattr(nb, "_SPAWN_BACKOFF_S", 0.001)
    assert nb._run(["true"], timeout=10).returncode == 0 and len(calls) == 3

    def always(*args, **kwargs):
        raise BlockingIOError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(subprocess, "run", always)
    with pytest.raises(BlockingIOError):
        nb._run(["true"], timeout=10)
