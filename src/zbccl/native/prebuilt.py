"""The native libraries a wheel carries, built when the wheel was built, and the check before loading one.

``setup.py`` compiles every library of :data:`zbccl.native.LIBRARIES` with the same recipe as the
JIT cache (:func:`zbccl.native.build.compile_into`) into ``zbccl/native/_prebuilt/<name>/`` and
writes ``_prebuilt/manifest.json``::

    {"format": 1, "zbccl": "0.9.0", "abi": "<python ABI tag>",
     "libraries": {"core": {"path": "core/core.so", "source_key": "...", "torch": null},
                   "hot":  {"path": "hot/hot.so",   "source_key": "...", "torch": "2.13.0-cxx11abi1"}}}

A library is used only when everything it was built from still holds: the installed sources hash to
its ``source_key`` (an edited checkout or a mismatched copy never loads stale code), the running
Python has its ABI, and, for a library linked against torch's C++ API, the running torch has the
release and string ABI it was built against (:func:`zbccl.native.build.torch_tag`). Otherwise the
loader says why and falls back to the JIT cache. An editable or source checkout has no manifest.

Pure data and file reads: nothing here compiles or loads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["DIRECTORY", "FORMAT", "MANIFEST", "check", "entry", "read_manifest"]

#: Where a wheel's libraries live, beside this module.
DIRECTORY = Path(__file__).parent / "_prebuilt"
MANIFEST = "manifest.json"
FORMAT = 1


def read_manifest(directory: Path | None = None) -> dict[str, Any] | None:
    """The manifest in ``directory`` (default :data:`DIRECTORY`), or None when there is none (a source or
    editable install)."""
    directory = DIRECTORY if directory is None else directory
    try:
        doc = json.loads((directory / MANIFEST).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        return {"error": f"unreadable {directory / MANIFEST}: {exc}"}
    return doc if isinstance(doc, dict) else {"error": f"{directory / MANIFEST} is not a JSON object"}


def entry(name: str, path: str, source_key: str, torch: str | None) -> dict[str, Any]:
    """One library's manifest entry (``path`` relative to the manifest's directory)."""
    return {"path": path, "source_key": source_key, "torch": torch}


def check(manifest: dict[str, Any] | None, name: str, *, source_key: str, abi: str,
          torch: str | None) -> str | None:
    """Why the prebuilt ``name`` must not be used (a sentence), or None when it matches.

    ``source_key``: the hash of the installed sources; ``abi``: the running Python's ABI tag;
    ``torch``: the running torch's tag for a library linked against torch, None for one that is not.
    """
    if manifest is None:
        return "no prebuilt libraries (a source or editable install)"
    if "error" in manifest:
        return str(manifest["error"])
    if manifest.get("format") != FORMAT:
        return f"prebuilt manifest format, expected {FORMAT}, got {manifest.get('format')!r}"
    lib = manifest.get("libraries", {}).get(name)
    if not isinstance(lib, dict):
        return f"the wheel carries no prebuilt {name}"
    if manifest.get("abi") != abi:
        return f"prebuilt {name} is for Python ABI {manifest.get('abi')!r}, this is {abi!r}"
    if lib.get("source_key") != source_key:
        return (f"prebuilt {name} was built from other sources (key {lib.get('source_key')!r}, the installed "
                f"sources hash to {source_key!r})")
    if torch is not None and lib.get("torch") != torch:
        return f"prebuilt {name} was built against torch {lib.get('torch')!r}, this is torch {torch!r}"
    return None
