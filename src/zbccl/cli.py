"""The ``zbccl`` command: ``--version``, ``info``, ``demo``, ``build``."""

from __future__ import annotations

import argparse
import sys

from ._version import __version__

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zbccl", description="zero-buffer collectives over a shared heap")
    p.add_argument("--version", action="version", version=f"zbccl {__version__}")
    sub = p.add_subparsers(dest="cmd")
    info = sub.add_parser("info", help="environment, topology, shm capacity, native build, configuration")
    info.add_argument("--json", action="store_true", help="print JSON")
    demo = sub.add_parser("demo", help="multi-process heap demo (ranks write into each other's tensors)")
    demo.add_argument("--world-size", "-n", type=int, default=2)
    demo.add_argument("--size", default="16M", help="bytes per peer write (e.g. 4M)")
    demo.add_argument("--iters", type=int, default=20)
    sub.add_parser("build", help="compile and cache the native code now")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.cmd == "info":
        from .tools.info import print_info

        print_info(as_json=args.json)
        return 0
    if args.cmd == "demo":
        from .env import parse_size
        from .tools.demo import run_demo

        return run_demo(world_size=args.world_size, nbytes=parse_size(args.size), iters=args.iters)
    if args.cmd == "build":
        from . import native

        native.build_all()
        print("native code built:", native.status())
        return 0
    _parser().print_help()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
