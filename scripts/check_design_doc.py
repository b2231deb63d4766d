#!/usr/bin/env python3
"""Usage: python scripts/check_design_doc.py [--doc docs/design.md] [--out DIR] [--mmdc PATH] [--browser PATH]

Render every ```mermaid block of the design document with the real mermaid renderer
(``mmdc`` from ``@mermaid-js/mermaid-cli``) and fail if any block does not render.

Setup (once; Debian's chromium is the browser, puppeteer downloads none):

    apt-get install -y chromium
    PUPPETEER_SKIP_DOWNLOAD=1 npm i -g @mermaid-js/mermaid-cli

Each block is written to a temporary ``.mmd`` file and rendered to SVG with a puppeteer
config pointing at the browser (``--no-sandbox``, as CI runs as root). A block passes when
``mmdc`` exits 0 and writes a non-empty SVG without mermaid's error marker. Exit status: 0
when every block rendered, 1 when one failed (its line number and mmdc's message are
printed), 2 when the document has no mermaid block or the tools are missing. ``--out DIR``
keeps the SVGs. Nothing is written into the repository.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"^```mermaid[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
ERROR_MARKERS = ("Syntax error in text", "Parse error")


def blocks(text: str) -> list[tuple[int, str]]:
    """Every mermaid block as (line number of its opening fence, source)."""
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in BLOCK.finditer(text)]


def render(src: str, out: Path, *, mmdc: str, config: Path, timeout: float) -> str | None:
    """Render one block to ``out``; None on success, else the reason."""
    mmd = out.with_suffix(".mmd")
    mmd.write_text(src, encoding="utf-8")
    cmd = [mmdc, "-i", str(mmd), "-o", str(out), "-p", str(config), "-q"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"mmdc did not finish within {timeout:.0f} s"
    if proc.returncode != 0:
        return (proc.stderr or proc.stdout).strip()[-2000:] or f"mmdc exited {proc.returncode}"
    if not out.exists() or out.stat().st_size == 0:
        return "mmdc wrote no SVG"
    svg = out.read_text(encoding="utf-8", errors="replace")
    for marker in ERROR_MARKERS:
        if marker in svg:
            return f"the SVG carries mermaid's error marker {marker!r}"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--doc", type=Path, default=ROOT / "docs" / "design.md")
    ap.add_argument("--out", type=Path, default=None, help="keep the rendered SVGs here")
    ap.add_argument("--mmdc", default=shutil.which("mmdc") or "mmdc")
    ap.add_argument("--browser", default=shutil.which("chromium") or "/usr/bin/chromium")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per block")
    args = ap.parse_args(argv)

    found = blocks(args.doc.read_text(encoding="utf-8"))
    if not found:
        print(f"check_design_doc: no mermaid block in {args.doc}, expected at least one", file=sys.stderr)
        return 2
    for tool in (args.mmdc, args.browser):
        if not shutil.which(tool) and not Path(tool).exists():
            print(f"check_design_doc: {tool} not found, expected mmdc and chromium installed "
                  "(see this script's usage)", file=sys.stderr)
            return 2
    failures = 0
    with tempfile.TemporaryDirectory(prefix="zbccl-design-") as tmp:
        tmpdir = Path(tmp)
        config = tmpdir / "puppeteer.json"
        config.write_text(json.dumps({"executablePath": args.browser, "args": ["--no-sandbox"]}))
        outdir = args.out or tmpdir
        outdir.mkdir(parents=True, exist_ok=True)
        for i, (line, src) in enumerate(found, 1):
            kind = src.strip().split(None, 1)[0] if src.strip() else "?"
            svg = outdir / f"diagram-{i:02d}.svg"
            why = render(src, svg, mmdc=args.mmdc, config=config, timeout=args.timeout)
            if why is None:
                print(f"ok    diagram {i} ({kind}, line {line}) -> {svg.name}")
            else:
                failures += 1
                print(f"FAIL  diagram {i} ({kind}, line {line}): {why}")
    print(f"{len(found) - failures} of {len(found)} mermaid diagrams rendered")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
