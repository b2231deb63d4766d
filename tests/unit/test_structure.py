"""Architecture rules the tree must keep: one-way layering, explicit __all__, declared env vars."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import zbccl
from zbccl import env

SRC = Path(zbccl.__file__).parent
ROOT = SRC.parent.parent

# Lower number = lower layer. A module may import only from its own layer or below.
LAYERS = {
    "_version": 0, "errors": 0, "env": 0,
    "native": 1,
    "bootstrap": 2,
    "heap": 3,
    "sma": 3,
    "runtime": 4,
    "ops": 5,
    "ep": 6,
    "adapters": 7,
    "integrations": 8,
    "tools": 9, "bench": 9, "cli": 9, "__main__": 9, "__init__": 9,
}


def _layer_of(parts: tuple[str, ...]) -> str:
    return parts[0] if parts else "__init__"


def _imports(path: Path) -> list[tuple[str, ...]]:
    rel = path.relative_to(SRC).with_suffix("").parts
    pkg = rel[:-1] if path.name != "__init__.py" else rel[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - (node.level - 1)] if node.level > 1 else pkg
                mod = tuple(base) + (tuple(node.module.split(".")) if node.module else ())
                if not node.module:
                    out.extend(mod + (a.name,) for a in node.names)
                    continue
                out.append(mod)
            elif node.module and node.module.split(".")[0] == "zbccl":
                out.append(tuple(node.module.split(".")[1:]))
        elif isinstance(node, ast.Import):
            out.extend(tuple(a.name.split(".")[1:]) for a in node.names if a.name.split(".")[0] == "zbccl")
    return out


def test_dependencies_flow_one_way():
    bad = []
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).with_suffix("").parts
        me = _layer_of(rel)
        if me not in LAYERS:
            bad.append(f"{path}: unknown layer {me!r}; add it to LAYERS")
            continue
        for target in _imports(path):
            other = _layer_of(target)
            if other in LAYERS and LAYERS[other] > LAYERS[me]:
                bad.append(f"{'/'.join(rel)} ({me}) imports {'.'.join(target)} ({other})")
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_integrations_are_not_imported_by_the_package_init():
    text = (SRC / "__init__.py").read_text()
    assert "integrations" not in text


def test_every_init_has_explicit_all():
    missing = [str(p.relative_to(SRC)) for p in SRC.rglob("__init__.py") if "__all__" not in p.read_text()]
    assert not missing, missing


def test_public_api_names():
    for name in ["init", "finalize", "Communicator", "empty", "zeros", "empty_like", "is_heap_tensor",
                 "export", "heap_scope", "memory_stats", "ZbcclError", "ZbcclTimeoutError",
                 "ZbcclInvalidUsageError", "ZbcclRemoteError", "ZbcclOutOfMemoryError"]:
        assert name in zbccl.__all__ and hasattr(zbccl, name), name


def test_env_vars_declared_once_and_documented_in_readme():
    used = set()
    for path in SRC.rglob("*.py"):
        text = path.read_text()
        constants = set(re.findall(r"^(ZBCCL_[A-Z_]+)\s*[:=]", text, flags=re.M))  # Python names, not env
        used |= set(re.findall(r"[\"'](ZBCCL_[A-Z_]+)", text)) - constants
    declared = {v.name for v in env.VARIABLES}
    assert used <= declared, f"ZBCCL_* names used but not declared in env.py: {sorted(used - declared)}"
    readme = (ROOT / "README.md").read_text()
    table = set(re.findall(r"^\| `(ZBCCL_[A-Z_]+)` \|", readme, flags=re.M))
    assert table == declared, f"README table differs from env.VARIABLES: {sorted(table ^ declared)}"


def test_env_parsing():
    assert env.parse_size("256M") == 256 << 20
    assert env.parse_size("1GiB") == 1 << 30
    assert env.parse_size("4096") == 4096
    assert env.parse_size(77) == 77
    assert env.format_size(64 << 20) == "64.0 MiB"


def test_no_environment_writes_at_import():
    for path in SRC.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in tree.body:  # module level only
            src = ast.unparse(node)
            assert "os.environ[" not in src or isinstance(node, (ast.FunctionDef, ast.ClassDef)), path
            assert "putenv" not in src, path


# Raw access to memory by address belongs to the transports (heap/transports/<name>/): everything above the
# seam, the native layer's Python included, goes through the transport's verbs and views, and reads what
# native code owns through the native module's own functions.
_SEAM = ("heap/transports/",)
#: The words the project's before-stop hook counts, as text (comments and docstrings too), outside the transports:
#: grep -rnE "<this>" --include=*.py src/zbccl | grep -v "^src/zbccl/heap/transports/"
_RAW_WORDS = re.compile(r"from_address|frombuffer|ctypes\.memset|ctypes\.memmove|ctypes\.string_at")
_RAW_CALLS = {"from_address", "memset", "memmove", "string_at", "pidfd_open", "wrap_address"}


def _raw_access(path: Path, root: Path = SRC) -> list[str]:
    """The raw-address calls in ``path``: ``x.from_address``, ``ctypes.memset``/``memmove``/``string_at``,
    ``os.pidfd_open``, and ``frombuffer`` over a ctypes object (an address)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        fn = node.func
        name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
        owner = ast.unparse(fn.value) if isinstance(fn, ast.Attribute) else ""
        if name == "from_address" or name == "wrap_address" or name == "pidfd_open":
            found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(fn)}")
        elif name in ("memset", "memmove", "string_at") and owner in ("ctypes", "_libc", "libc"):
            found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(fn)}")
        elif name == "frombuffer" and node.args and "ctypes" in ast.unparse(node.args[0]):
            found.append(f"{path.relative_to(root)}:{node.lineno}: frombuffer({ast.unparse(node.args[0])})")
    return found


def test_raw_memory_access_stays_under_the_transports():
    bad = []
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).as_posix()
        if not rel.startswith(_SEAM):
            bad += _raw_access(path)
    assert not bad, "raw address access outside heap/transports/ (use the transport's verbs):\n" + "\n".join(bad)


def _raw_words(root: Path) -> list[str]:
    """The lines of ``root``'s Python files outside ``heap/transports/`` that name a raw-address call (the hook's
    grep: textual, so a comment or docstring naming one counts too)."""
    return [f"{rel}:{i}: {line.strip()}" for path in sorted(root.rglob("*.py"))
            if not (rel := path.relative_to(root).as_posix()).startswith(_SEAM)
            for i, line in enumerate(path.read_text().splitlines(), 1) if _RAW_WORDS.search(line)]


def test_no_raw_address_words_above_the_seam():
    bad = _raw_words(SRC)
    assert not bad, ("raw-address words outside heap/transports/ (the before-stop hook's grep; use the "
                     "transport's verbs, or the native module's accessors):\n" + "\n".join(bad))


def test_the_raw_words_check_matches_the_hook(tmp_path):
    (tmp_path / "heap" / "transports").mkdir(parents=True)
    (tmp_path / "heap" / "transports" / "ok.py").write_text("x = y.from_address(8)\n")
    (tmp_path / "above.py").write_text("import ctypes\n# np.frombuffer in a comment\nctypes.memmove(8, 16, 1)\n"
                                       "ctypes.string_at(8)\nctypes.memset(8, 0, 1)\nc.from_address(8)\n"
                                       "prims.memset(8, 0, 1)\n")
    assert [f.split(":")[1] for f in _raw_words(tmp_path)] == ["2", "3", "4", "5", "6"]


def test_the_raw_access_check_sees_each_form(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import ctypes, os, numpy as np\n"
                      "ctypes.c_int64.from_address(8)\nctypes.memset(8, 0, 1)\nctypes.memmove(8, 16, 1)\n"
                      "os.pidfd_open(1)\nnp.frombuffer((ctypes.c_char * 4).from_address(8))\n"
                      "np.frombuffer(bytearray(4))\n")
    found = _raw_access(sample, tmp_path)
    assert [f.split(":")[1] for f in found] == ["2", "3", "4", "5", "6", "6"], found
