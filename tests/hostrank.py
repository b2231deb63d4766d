"""One rank of a ``tests.hosts.run_hosts`` world: ``python -m tests.hostrank SPEC RANK``.

Imports the spec's function by name, calls it with a ``tests.spawn.RankContext`` and writes
``out-<rank>.json`` (``{"ok": result}`` or ``{"error": traceback}``) into the spec's folder.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback
from pathlib import Path


def main(spec_path: str, rank: int) -> int:
    spec = json.loads(Path(spec_path).read_text())
    from tests.spawn import RankContext

    ctx = RankContext(rank, spec["world_size"], spec["host"], spec["port"])
    out = Path(spec["out"]) / f"out-{rank}.json"
    try:
        module, name = spec["fn"].split(":")
        fn = getattr(importlib.import_module(module), name)
        result = {"ok": fn(ctx, **spec["kwargs"])}
        code = 0
    except BaseException:  # noqa: BLE001 - reported to the test process
        result = {"error": traceback.format_exc()}
        code = 1
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, out)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
