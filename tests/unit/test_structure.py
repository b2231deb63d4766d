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
