"""The wheel's prebuilt libraries: the manifest check, the loader's choice, and what it says when nothing works."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from zbccl import native
from zbccl.errors import ZbcclSystemError
from zbccl.native import build as nb
from zbccl.native import prebuilt

ABI = "cpython-311-x"
MANIFEST = {"format": 1, "zbccl": "0.1.0", "abi": ABI,
            "libraries": {"core": prebuilt.entry("core", "core/core.so", "k-core", None),
                          "hot": prebuilt.entry("hot", "hot/hot.so", "k-hot", "2.13.0-cxx11abi1")}}


def test_check_accepts_only_an_exact_match() -> None:
    assert prebuilt.check(MANIFEST, "core", source_key="k-core", abi=ABI, torch=None) is None
    assert prebuilt.check(MANIFEST, "hot", source_key="k-hot", abi=ABI, torch="2.13.0-cxx11abi1") is None
    cases = {
        "other sources": dict(name="core", source_key="edited", abi=ABI, torch=None),
        "Python ABI": dict(name="core", source_key="k-core", abi="cpython-312-x", torch=None),
        "built against torch '2.13.0-cxx11abi1', this is torch '2.11.0-cxx11abi1'":
            dict(name="hot", source_key="k-hot", abi=ABI, torch="2.11.0-cxx11abi1"),
        "carries no prebuilt cpu_alloc_hook": dict(name="cpu_alloc_hook", source_key="k", abi=ABI, torch="t"),
    }
    for words, kw in cases.items():
        name = kw.pop("name")
        reason = prebuilt.check(MANIFEST, name, **kw)
        assert reason is not None and words in reason, (words, reason)
    assert "source or editable install" in prebuilt.check(None, "core", source_key="k", abi=ABI, torch=None)
    assert "format" in prebuilt.check({**MANIFEST, "format": 99}, "core", source_key="k-core", abi=ABI, torch=None)


def test_read_manifest(tmp_path: Path) -> None:
    assert prebuilt.read_manifest(tmp_path) is None
    (tmp_path / prebuilt.MANIFEST).write_text("{not json")
    doc = prebuilt.read_manifest(tmp_path)
    assert doc is not None and "unreadable" in doc["error"]
    assert "unreadable" in prebuilt.check(doc, "core", source_key="k", abi=ABI, torch=None)
    (tmp_path / prebuilt.MANIFEST).write_text(json.dumps(MANIFEST))
    assert prebuilt.read_manifest(tmp_path) == MANIFEST


@pytest.fixture(scope="module")
def core_cache() -> tuple[Path, Path]:
    """``(cache dir, core library)``: the core in the session's cache (``make test`` builds it first with
    ``make native``; every multi-process test needs it anyway), so this module compiles nothing."""
    from zbccl import env

    sp = native.spec("core")  # one recipe: the JIT cache's library is what setup.py ships
    return env.CACHE_DIR.get(), nb.build("core", list(sp.sources), lang=sp.lang, extra_flags=sp.flags,
                                         generated=sp.generated)


@pytest.fixture
def wheel_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, core_cache: tuple[Path, Path]) -> Path:
    """A prebuilt directory holding a copy of the JIT-built core, its manifest entry matching this install."""
    cache, built = core_cache
    monkeypatch.setenv("ZBCCL_CACHE_DIR", str(cache))
    directory = tmp_path / "_prebuilt"
    (directory / "core").mkdir(parents=True)
    shutil.copy2(built, directory / "core" / "core.so")
    manifest = {"format": 1, "zbccl": "0.1.0", "abi": nb.abi_tag(),
                "libraries": {"core": prebuilt.entry("core", "core/core.so", nb.source_key(native.spec("core")), None)}}
    (directory / prebuilt.MANIFEST).write_text(json.dumps(manifest))
    monkeypatch.setattr(prebuilt, "DIRECTORY", directory)
    return directory


def test_loader_prefers_a_matching_prebuilt_library(wheel_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path, reason = native._prebuilt("core")
    assert path == wheel_dir / "core" / "core.so" and reason == ""
    monkeypatch.setattr(native, "_origin", {})
    assert native._build("core") == path and native._origin["core"] == "prebuilt"
    assert native.status()["core"]["origin"] == "prebuilt (wheel)"
    # A library the wheel does not carry (or whose sources changed) comes from the JIT cache instead.
    assert native._prebuilt("hot")[0] is None
    manifest = json.loads((wheel_dir / prebuilt.MANIFEST).read_text())
    manifest["libraries"]["core"]["source_key"] = "stale"
    (wheel_dir / prebuilt.MANIFEST).write_text(json.dumps(manifest))
    path, reason = native._prebuilt("core")
    assert path is None and "other sources" in reason
    assert native._build("core").parent.parent.name == "native" and native._origin["core"] == "cache"


def test_no_prebuilt_and_no_compiler_says_what_to_install(wheel_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (wheel_dir / prebuilt.MANIFEST).unlink()
    monkeypatch.setenv("ZBCCL_CACHE_DIR", str(wheel_dir.parent / "empty-cache"))
    monkeypatch.setenv("ZBCCL_CXX", "/nonexistent/cc")
    with pytest.raises(ZbcclSystemError) as err:
        native._build("core")
    text = str(err.value)
    assert "native: core is not available (no prebuilt libraries (a source or editable install))" in text
    assert "cannot run" in text and "install a zbccl wheel" in text and "zbccl build" in text


def test_unwritable_cache_is_named_as_such(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("ZBCCL_CACHE_DIR", str(blocker / "cache"))  # root may write anywhere; not under a file
    src = tmp_path / "answer.c"
    src.write_text("int zb_answer(void) { return 1; }\n")
    with pytest.raises(ZbcclSystemError, match=r"cannot write the build cache, expected a writable directory in "
                                               r"ZBCCL_CACHE_DIR \(.*a-file/cache/native\), got NotADirectoryError"):
        nb.build("answer", [src], lang="c")


def test_a_prebuilt_library_that_does_not_load_falls_back_to_the_cache(wheel_dir: Path, monkeypatch) -> None:
    monkeypatch.setattr(native, "_origin", {})
    loaded = []

    def picky(path: Path) -> str:
        if path.parent.parent == wheel_dir:
            raise OSError(f"{path}: libgomp.so.1: cannot open shared object file")
        loaded.append(path)
        return "module"

    assert native._load("core", picky) == "module"
    assert loaded and loaded[0].parent.parent.name == "native" and native._origin["core"] == "cache"
