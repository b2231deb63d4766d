"""docs/design.md stays true to the tree: cited paths exist, named zbccl symbols resolve, chapters follow the seed.

A path is cited in backticks (``src/zbccl/ops/channel.py``, or short as ``ops/channel.py``,
resolved under ``src/zbccl/``) or inside a mermaid block; ``file.py::test_name`` also names a
test function, and a bare ``::test_name`` refers to the last test file cited on the same line.
Paths of planned work are listed in ``PLANNED``: they must *not* exist yet, so the day one
lands this test fails and asks for the document to be updated. Rendering the diagrams needs a
browser: ``scripts/check_design_doc.py`` (not run here).
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "design.md"

#: Paths the document marks 【规划】 (planned): they must not exist while the text says so.
PLANNED: set[str] = set()

_SUBPACKAGES = "bootstrap|heap|sma|runtime|ops|ep|adapters|native|bench|tools|integrations"
_PATH = re.compile(
    r"(?<![\w/.:-])("
    r"(?:src|tests|docs|scripts|examples)/[\w./-]*"
    rf"|(?:{_SUBPACKAGES})/[\w./-]+"
    r"|README\.md|Makefile|pyproject\.toml"
    r")(?:::(\w+))?"
)
_BARE_TEST = re.compile(r"^::(\w+)$")
_SYMBOL = re.compile(r"(?<![\w.])zbccl(?:\.[A-Za-z_]\w*)+")
_ATTR = re.compile(r"(?<![\w.])([A-Z][A-Za-z]+)\.([a-z_]\w*)")
_SPAN = re.compile(r"`([^`\n]+)`")
_MERMAID = re.compile(r"^```mermaid[ \t]*\n(.*?)^```", re.S | re.M)

#: The seed's nine chapters and their sections, in order (issue 10: "follow the seed exactly").
CHAPTERS = [
    "# 1. 设计背景与目标", "# 2. 需求分析", "## 2.1 功能性需求", "## 2.2 非功能性需求",
    "# 3. 总体架构设计", "## 3.1 架构设计思路", "## 3.2 总体架构图", "# 4. 核心模块设计",
    "# 5. 数据流与控制流设计", "# 6. 关键技术点与设计取舍", "# 7. 可扩展性与演进设计",
    "# 8. 异常处理与容错设计", "# 9. 总结",
]


def _text() -> str:
    return DOC.read_text(encoding="utf-8")


def _repo_path(token: str) -> str:
    token = token.rstrip(".")
    if re.match(rf"(?:{_SUBPACKAGES})/", token):
        token = "src/zbccl/" + token
    return token.rstrip("/")


def _citations() -> list[tuple[int, str, str | None]]:
    """Every cited (line number, repo path, test name or None)."""
    out = []
    mermaid_lines = set()
    text = _text()
    for m in _MERMAID.finditer(text):
        first = text.count("\n", 0, m.start()) + 1
        for i, line in enumerate(m.group(1).splitlines(), first + 1):
            mermaid_lines.add(i)
            out += [(i, _repo_path(p.group(1)), p.group(2)) for p in _PATH.finditer(line)]
    for no, line in enumerate(text.splitlines(), 1):
        if no in mermaid_lines:
            continue
        last_test_file = None
        for span in _SPAN.findall(line):
            bare = _BARE_TEST.match(span.strip())
            if bare:
                assert last_test_file, f"docs/design.md:{no}: `{span}` follows no test file on its line"
                out.append((no, last_test_file, bare.group(1)))
                continue
            for p in _PATH.finditer(span):
                path = _repo_path(p.group(1))
                if path.endswith(".py") and path.startswith("tests/"):
                    last_test_file = path
                out.append((no, path, p.group(2)))
    return out


def test_every_cited_path_exists():
    cited = _citations()
    assert len(cited) > 100, f"design doc: too few citations found, expected > 100, got {len(cited)}"
    bad = []
    for no, path, test in cited:
        target = ROOT / path
        if path in PLANNED:
            if target.exists():
                bad.append(f"line {no}: {path} is marked planned but exists now: update docs/design.md "
                           "(describe it as built) and drop it from PLANNED")
            continue
        if not target.exists():
            bad.append(f"line {no}: {path} does not exist")
        elif test and not re.search(rf"^\s*def {re.escape(test)}\(", target.read_text(), re.M):
            bad.append(f"line {no}: {path} has no test function {test}")
    assert not bad, "docs/design.md cites paths the tree does not have:\n" + "\n".join(bad)


def _resolve(name: str) -> None:
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return
    raise ModuleNotFoundError(name)


def test_every_named_zbccl_symbol_resolves():
    names = sorted({m.group(0) for span in _SPAN.findall(_text()) for m in _SYMBOL.finditer(span)})
    assert len(names) > 10, f"design doc: too few zbccl names found, expected > 10, got {len(names)}"
    bad = []
    for name in names:
        if any(name.startswith(p.replace("src/", "").replace("/", ".")) for p in PLANNED):
            continue
        try:
            _resolve(name)
        except (ImportError, AttributeError) as exc:
            bad.append(f"{name}: {type(exc).__name__}: {exc}")
    assert not bad, "docs/design.md names zbccl symbols that do not resolve:\n" + "\n".join(bad)


def _classes() -> dict[str, list[type]]:
    """Every class defined in a zbccl module, by name (integrations excluded: imported lazily)."""
    import zbccl

    out: dict[str, list[type]] = {}
    for info in pkgutil.walk_packages(zbccl.__path__, "zbccl."):
        if info.name.startswith(("zbccl.integrations", "zbccl.__main__")):
            continue
        mod = importlib.import_module(info.name)
        for obj in vars(mod).values():
            if isinstance(obj, type) and obj.__module__ == info.name:
                out.setdefault(obj.__name__, []).append(obj)
    return out


def test_every_named_class_attribute_exists():
    """``Communicator.host_state``, ``OpChannel.run``...: the class exists in zbccl and has the attribute."""
    refs = sorted({m.groups() for span in _SPAN.findall(_text()) for m in _ATTR.finditer(span)})
    classes = _classes()
    bad = [f"{c}.{a}" for c, a in refs if c in classes and not any(hasattr(k, a) for k in classes[c])]
    assert not bad, "docs/design.md names attributes zbccl classes do not have: " + ", ".join(bad)
    known = [f"{c}.{a}" for c, a in refs if c in classes]
    assert len(known) >= 3, f"design doc: expected some Class.attribute references, got {known}"


def test_chapters_follow_the_seed():
    headings = [line.strip() for line in _text().splitlines() if re.match(r"#{1,2} \d", line)]
    wanted = [h for h in headings if h in CHAPTERS]
    assert wanted == CHAPTERS, f"design doc: chapters, expected {CHAPTERS}, got {wanted}"
    assert len(_MERMAID.findall(_text())) >= 4, "design doc: expected at least 4 mermaid diagrams"


def _planned_problems(text: str, planned: set[str], exists) -> list[str]:
    """What is wrong with ``planned`` paths in a document ``text``: cited on a line not marked 【规划】,
    never cited at all (a stale entry), or existing already (``exists(path)``)."""
    bad = []
    for path in sorted(planned):
        short = path.replace("src/zbccl/", "")
        lines = [line for line in text.splitlines() if short in line]
        if not lines:
            bad.append(f"{path} is in PLANNED but the document never cites it")
        bad += [f"{path} is cited on a line not marked 【规划】: {line.strip()}" for line in lines if "规划" not in line]
        if exists(path):
            bad.append(f"{path} is marked planned but exists now")
    return bad


def test_planned_markers_cover_the_planned_paths():
    problems = _planned_problems(_text(), PLANNED, lambda p: (ROOT / p).exists())
    assert not problems, "design doc: planned paths out of step:\n" + "\n".join(problems)
    # The check itself, on a document of our own (PLANNED may be empty in the real one):
    doc = "- `ops/soak.py` runs the soak【规划】\n- the soak lives in `ops/soak.py`\n"
    got = _planned_problems(doc, {"src/zbccl/ops/soak.py", "src/zbccl/ops/gone.py", "src/zbccl/ops/args.py"},
                            lambda p: (ROOT / p).exists())
    assert got == ["src/zbccl/ops/args.py is in PLANNED but the document never cites it",
                   "src/zbccl/ops/args.py is marked planned but exists now",
                   "src/zbccl/ops/gone.py is in PLANNED but the document never cites it",
                   "src/zbccl/ops/soak.py is cited on a line not marked 【规划】: - the soak lives in `ops/soak.py`"], got
