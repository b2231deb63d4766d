"""One rank of a ``run_hosts`` world: ``python -m tests.hostrank SPEC RANK`` (kept for old command lines;
the runner is :func:`zbccl.tools.netns.rank_main`, which ``run_hosts`` now starts itself)."""

from __future__ import annotations

import sys

from zbccl.tools.netns import rank_main as main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
