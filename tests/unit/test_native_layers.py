"""The native code's three layers (``native/csrc``): core is the protocol engine in pure C over a transport's
verbs, cpu the CPU transport and its kernels, py the CPython bindings. Includes flow py -> core, cpu; cpu ->
core (the transport table's type); core -> nothing of the others."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from zbccl import native

CSRC = Path(native.__file__).parent / "csrc"
LAYERS = ("core", "cpu", "py")


def _sources(layer: str) -> list[Path]:
    return sorted(p for p in (CSRC / layer).iterdir() if p.suffix in (".c", ".h", ".cpp"))


def _code(path: Path) -> str:
    """The file without its comments (a comment may name Python; code may not)."""
    text = re.sub(r"/\*.*?\*/", "", path.read_text(), flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def test_the_tree_has_exactly_the_three_layers():
    assert sorted(p.name for p in CSRC.iterdir() if p.is_dir() and p.name != "__pycache__") == sorted(LAYERS)
    assert not [p.name for p in CSRC.iterdir() if p.is_file()], "a native source outside the layer folders"


@pytest.mark.parametrize("path", _sources("core"), ids=lambda p: p.name)
def test_the_core_is_pure_c(path):
    code = _code(path)
    assert not re.search(r"#\s*include\s*[<\"]Python\.h[>\"]", code), f"core/{path.name} includes Python.h"
    assert not re.search(r"\bPy[A-Z_]\w*", code), f"core/{path.name} names a CPython API: " + ", ".join(
        sorted(set(re.findall(r"\bPy[A-Z_]\w*", code))))
    assert "../cpu/" not in code and "../py/" not in code, f"core/{path.name} includes another layer"


@pytest.mark.parametrize("path", _sources("core"), ids=lambda p: p.name)
def test_the_protocol_moves_bytes_and_flags_only_through_its_transport(path):
    code = _code(path)
    for banned in (r"\bzb_copy\w*\(", r"\bzb_reduce\w*\(", r"\bmemcpy\(\s*c->base", r"SYS_futex", r"\bpoll\(",
                   r"__atomic_load_n\(\s*c->(arrive|done|phase|abort|rabort|state|size)"):
        assert not re.search(banned, code), f"core/{path.name}: {banned} bypasses the transport (core/transport.h)"


@pytest.mark.parametrize("path", _sources("cpu"), ids=lambda p: p.name)
def test_the_cpu_layer_has_no_python(path):
    code = _code(path)
    assert not re.search(r"#\s*include\s*[<\"]Python\.h[>\"]", code), f"cpu/{path.name} includes Python.h"
    assert not re.search(r"\bPyObject\b", code), f"cpu/{path.name} names PyObject"
    assert "../py/" not in code, f"cpu/{path.name} includes the binding layer"


def test_every_source_is_built_and_every_built_source_exists():
    listed = {src for name in native.LIBRARIES for src in native.spec(name).sources}
    on_disk = {p for layer in LAYERS for p in _sources(layer)}
    assert all(p.is_file() for p in listed), sorted(str(p) for p in listed if not p.is_file())
    assert on_disk == listed, f"not listed in native.LIBRARIES: {sorted(p.name for p in on_disk - listed)}"


def test_python_owns_every_policy_but_the_documented_one():
    # the store-kind learner is core policy, said so where it lives and where the core's rule is stated
    assert "CORE POLICY" in (CSRC / "core" / "kind.c").read_text()
    chan = (CSRC / "core" / "chan.c").read_text()
    assert "owns every policy but one" in chan and "kind.c" in chan
