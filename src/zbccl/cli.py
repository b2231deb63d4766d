"""The ``zbccl`` command: ``--version``, ``info``, ``bench``, ``bench-gpu``, ``bench-tp``, ``tune``, ``demo``, ``soak``, ``faults``,
``build``."""

from __future__ import annotations

import argparse
import sys

from ._version import __version__

__all__ = ["main"]


def _count(lo: int, hi: int):
    """An argparse type: an integer in ``[lo, hi]`` (a bad one is a usage error, exit status 2)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"expected {lo} to {hi}, got {value}")
        return value
    return parse


def _number(lo: float, hi: float):
    """An argparse type: a finite number in ``[lo, hi]``."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not lo <= value <= hi:  # nan fails too
            raise argparse.ArgumentTypeError(f"expected {lo:g} to {hi:g}, got {text}")
        return value
    return parse


def _size(text: str) -> str:
    """An argparse type: a size as ``env.parse_size`` reads it (kept as text for the commands)."""
    from .env import parse_size

    try:
        parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _sizes_list(text: str) -> list[int]:
    """An argparse type: a comma list of world sizes, each 1 to 64."""
    parse = _count(1, 64)
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected a comma list of world sizes, e.g. 2,4, got {text!r}")
    return [parse(x) for x in items]


_WORLD = _count(1, 64)  # local ranks of a tool's world (one host)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zbccl", description="zero-buffer collectives over a shared heap")
    p.add_argument("--version", action="version", version=f"zbccl {__version__}")
    sub = p.add_subparsers(dest="cmd")
    info = sub.add_parser("info", help="environment, topology, shm capacity, native build, configuration")
    info.add_argument("--json", action="store_true", help="print JSON")
    demo = sub.add_parser("demo", help="multi-process heap demo (ranks write into each other's tensors)")
    demo.add_argument("--world-size", "-n", type=_WORLD, default=2, help="local ranks, 1 to 64 (default 2)")
    demo.add_argument("--size", type=_size, default="16M", help="bytes per peer write (e.g. 4M)")
    demo.add_argument("--iters", type=_count(1, 1 << 30), default=20)
    sub.add_parser("build", help="compile and cache the native code now")
    sub.add_parser("bench-gpu", add_help=False,
                   help="CUDA: every op and graph capture checked, bench vs memcpy and torch SymmetricMemory "
                        "(what scripts/gpu_check.sh runs; --help for its options)")
    tune = sub.add_parser("tune", help="measure this machine and save the algorithm table every rank loads")
    tune.add_argument("--world-size", "-n", type=_sizes_list, default=[2],
                      help="comma list of world sizes to tune, e.g. 2,4")
    tune.add_argument("--max-size", type=_size, default="64M", help="largest message (bytes per rank input)")
    tune.add_argument("--out", default=None, help="table path (default: ZBCCL_TUNE_FILE or the host's cache entry)")
    tune.add_argument("--hosts", type=int, default=0, metavar="N",
                      help="tune the choices between hosts instead, on N namespace hosts of this machine (root; "
                           "writes the table's \"hosts\" section, keeping its rules)")
    tune.add_argument("--ranks-per-host", type=int, default=2, help="with --hosts: ranks per host (default 2)")
    tune.add_argument("--quick", action="store_true", help="with --hosts: one size per choice (checks the tool)")
    tune.add_argument("--own-cores", action="store_true",
                      help="with --hosts: each host on its own cores, as separate machines (see bench --own-cores)")
    _add_bench(sub)
    _add_bench_tp(sub)
    _add_soak(sub)
    _add_faults(sub)
    return p


def _add_faults(sub) -> None:
    f = sub.add_parser("faults", help="SIGKILL/SIGSTOP/SIGINT one rank inside a random op: survivors must raise "
                                      "naming it in time, leak nothing and run again")
    f.add_argument("--trials", type=_count(1, 1 << 20), default=10, help="trials per signal (default 10)")
    f.add_argument("--kinds", default="kill,stop,int", help="of kill,stop,int (default all three)")
    f.add_argument("--where", default=None,
                   help="of collective,p2p,ep,group,growth,init,finalize (default all: one drawn per trial)")
    f.add_argument("--world", "-n", type=_count(2, 8), default=2, help="local ranks (default 2)")
    f.add_argument("--seed", type=_count(0, (1 << 63) - 1), default=0)
    f.add_argument("--parallel", type=_count(1, 16), default=1,
                   help="trials at a time, each its own world (default 1; more is load for each other)")
    f.add_argument("--minutes", type=_number(0.01, 7 * 24 * 60), default=None,
                   help="stop starting rounds after this long (the table says how many ran)")
    f.add_argument("--json", action="store_true", help="print the summary as JSON (progress goes to stderr)")


def _add_soak(sub) -> None:
    from .tools.soak import THRESHOLDS

    s = sub.add_parser("soak", help="random ops for minutes, bit-exact against the reference; RSS/fd/heap growth")
    s.add_argument("--world", "-n", type=_count(1, 64), default=2, help="local ranks (default 2; 3, 4 oversubscribe)")
    length = s.add_mutually_exclusive_group()
    length.add_argument("--minutes", type=_number(0.01, 7 * 24 * 60), default=None, help="run this long (default 1)")
    length.add_argument("--ops", type=_count(1, 1 << 40), default=None, help="run this many ops instead")
    s.add_argument("--seed", type=_count(0, (1 << 63) - 1), default=0, help="the op sequence's seed (default 0)")
    s.add_argument("--check-every", type=_count(1, 1 << 20), default=32,
                   help="ops between checkpoints (resources, agreement to stop; default 32)")
    s.add_argument("--report-every", type=_number(0, 86400), default=30.0, help="seconds between progress lines")
    s.add_argument("--heap-size", type=_size, default="64M", help="initial heap per rank (default 64M; it grows)")
    s.add_argument("--max-rss-growth", type=_size, default=str(THRESHOLDS["rss_anon_bytes"]),
                   help="anonymous RSS growth allowed per rank after the warm-up "
                        f"(default {THRESHOLDS['rss_anon_bytes'] >> 20}M)")
    s.add_argument("--no-ep", action="store_true", help="leave out EP dispatch/combine")
    s.add_argument("--hosts", type=_count(1, 64), default=1,
                   help="split the ranks over this many hosts of this machine (ZBCCL_HOST_ID per rank, a job "
                        "cookie): ranks on one host share memory, the others go through Mooncake (default 1)")
    s.add_argument("--netns", action="store_true",
                   help="with --hosts: make them real hosts out of Linux namespaces (own network, PID and IPC "
                        "namespaces joined by veth pairs, as `bench --hosts`; root); --world must be a multiple")
    s.add_argument("--json", action="store_true", help="print the summary as JSON (progress goes to stderr)")


def _add_bench_tp(sub) -> None:
    from .bench.tp import __doc__ as tp_doc
    from .bench.tp import add_arguments

    usage, description = tp_doc.split("\n\n", 2)[:2]
    b = sub.add_parser("bench-tp", help="decode step of a HF transformers TP=2 model: zbccl vs gloo vs no comm",
                       usage=usage.removeprefix("Usage: "), description=description,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(b)


def _add_bench(sub) -> None:
    from .bench import __doc__ as bench_doc

    usage, description = bench_doc.split("\n\n", 2)[:2]
    b = sub.add_parser("bench", help="collective benchmark: zbccl vs gloo, memcpy and vLLM, with #wrong columns",
                       usage=usage.removeprefix("Usage: "), description=description,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("--world-size", "-n", type=_WORLD, default=2, help="local ranks (default 2; 3, 4 oversubscribe)")
    b.add_argument("--ops", default=None,
                   help="comma-separated (default: all five; with --hosts all but broadcast)")
    b.add_argument("--dtypes", default=None, help="fp32, bf16, fp16 (default fp32,bf16)")
    b.add_argument("--min-size", type=_size, default="4K", help="smallest bytes per rank input (default 4K; x4 steps)")
    b.add_argument("--max-size", type=_size, default="64M", help="largest bytes per rank input (default 64M)")
    b.add_argument("--baselines", default="gloo,memcpy",
                   help="of gloo,memcpy,vllm,mpi (default gloo,memcpy; vllm and mpi are timed interleaved with "
                        "zbccl in the same ranks; vllm needs 'make vllm-baseline', mpi the 'mpi' extra and Open MPI; "
                        "one of the two per run)")
    b.add_argument("--json", metavar="PATH", help="write every cell, all samples and machine info")
    b.add_argument("--plot", metavar="PATH", help="PNG of busbw vs size (needs matplotlib)")
    b.add_argument("--quick", action="store_true", help="3 sizes (x16 steps), short timing: a smoke run")
    b.add_argument("--threads", type=_count(1, 4096), default=None, help="intra-op threads per rank (default: cores/ranks)")
    b.add_argument("--idle-wait", type=_number(0, 3600), default=None,
                   help="max seconds to wait for an idle machine before each op block (default 30; quick 5)")
    b.add_argument("--no-zbccl", action="store_true", help="baselines only")
    b.add_argument("--gap-ms", type=_number(0, 60_000), default=0.0,
                   help="time each call as in a model step: this many ms of matmuls before it, every rank "
                        "entering at one instant (default 0: back-to-back calls; needs a core per rank)")
    h = b.add_argument_group("between hosts (root: Linux namespace hosts on this machine, Mooncake between them)")
    h.add_argument("--hosts", type=_count(2, 8), default=None,
                   help="run between this many namespace hosts instead (zbccl vs gloo over veth links, raw Mooncake "
                        "bandwidth, inter-host bytes per op, EP dispatch+combine)")
    h.add_argument("--ranks-per-host", type=_count(1, 4), default=1, help="ranks per host (default 1)")
    h.add_argument("--smoke", action="store_true", help="with --hosts: 2 small sizes, short timing (seconds, for CI)")
    h.add_argument("--no-ep", action="store_true", help="with --hosts: leave out EP dispatch+combine")
    h.add_argument("--own-cores", action="store_true",
                   help="with --hosts: give each host its own cores (this machine's split into disjoint sets, where "
                        "there are at least as many as hosts), as separate machines have")
    h.add_argument("--cpu", action="store_true",
                   help="with --hosts 2: instead, each small op's CPU per call without the network (each write "
                        "looped back into the rank's own slots) against its time with it, interleaved")


def _bench_hosts(args, split) -> int:
    import signal

    from .bench.hosts import HOST_OPS, run_hosts_bench
    from .tools.netns import HostsFailure, HostsUnavailable

    # SIGTERM (a `timeout`, a job scheduler) unwinds like Ctrl-C: the namespaces, veths and ranks are torn down
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        if args.cpu:
            from .bench.hosts_cpu import run_cpu_bench

            if args.hosts != 2 or args.ranks_per_host != 1:
                raise ValueError(f"--cpu runs between 2 hosts of 1 rank, got --hosts {args.hosts} and "
                                 f"--ranks-per-host {args.ranks_per_host}")
            doc = run_cpu_bench(calls=20 if args.smoke else 200, rounds=2 if args.smoke else 5, own_cores=args.own_cores)
            if args.json:
                from .bench import report

                report.write_json(doc, args.json)
            return 0
        doc = run_hosts_bench(hosts=args.hosts, ranks_per_host=args.ranks_per_host,
                              ops=split(args.ops) if args.ops else HOST_OPS,
                              dtypes=split(args.dtypes) if args.dtypes else ("fp32", "bf16"), min_size=args.min_size,
                              max_size=args.max_size, smoke=args.smoke, quick=args.quick, idle_wait=args.idle_wait,
                              ep=not args.no_ep, json_path=args.json, threads=args.threads,
                              own_cores=args.own_cores)
    except (ValueError, HostsUnavailable) as exc:
        print(f"zbccl bench --hosts: {exc}", file=sys.stderr)
        return 2
    except HostsFailure as exc:  # a rank failed: its traceback and the hosts' logs, not ours
        print(f"zbccl bench --hosts: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    bad = [c for c in doc["cells"] for k in ("zbccl", "gloo") if c.get(k) and (c[k].get("error") or c[k].get("wrong"))]
    from .bench.hosts import ep_rows

    ep = doc.get("ep") or {}
    ep_bad = ep.get("error") or any(r["wrong"] or r["ll_wrong"] for r in ep_rows(ep, ""))
    return 1 if bad or ep_bad else 0


def _bench(args) -> int:
    from .bench import run_bench

    split = lambda text: [x.strip() for x in text.split(",") if x.strip()]  # noqa: E731
    if args.hosts is not None:
        return _bench_hosts(args, split)
    if args.ranks_per_host != 1 or args.smoke or args.no_ep or args.own_cores or args.cpu:
        print("zbccl bench: --ranks-per-host, --smoke, --no-ep, --own-cores and --cpu need --hosts", file=sys.stderr)
        return 2
    args.ops = args.ops or "all_reduce,all_gather,reduce_scatter,all_to_all,broadcast"
    args.dtypes = args.dtypes or "fp32,bf16"
    try:
        doc = run_bench(world_size=args.world_size, ops=split(args.ops), dtypes=split(args.dtypes),
                        min_size=args.min_size, max_size=args.max_size, baselines=split(args.baselines),
                        json_path=args.json, plot_path=args.plot, quick=args.quick, threads=args.threads,
                        idle_wait=args.idle_wait, zbccl=not args.no_zbccl, gap_ms=args.gap_ms)
    except ValueError as exc:
        print(f"zbccl bench: {exc}", file=sys.stderr)
        return 2
    bad = [c for c in doc["cells"] for k in ("zbccl", "gloo", "vllm", "mpi")
           if c.get(k) and (c[k].get("error") or c[k].get("wrong"))]
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    from .errors import ZbcclInvalidUsageError

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench-gpu"]:  # its own parser (python -m zbccl.bench.gpu): every option passes through
        from .bench.gpu import main as gpu_main

        return gpu_main(argv[1:], prog="zbccl bench-gpu")
    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except ZbcclInvalidUsageError as exc:  # a bad setting or argument: its message, not a traceback
        print(f"zbccl {args.cmd}: error: {exc}", file=sys.stderr)
        return 2


def _run(args) -> int:
    if args.cmd == "info":
        from .tools.info import print_info

        print_info(as_json=args.json)
        return 0
    if args.cmd == "demo":
        from .env import parse_size
        from .tools.demo import run_demo

        return run_demo(world_size=args.world_size, nbytes=parse_size(args.size), iters=args.iters)
    if args.cmd == "bench":
        return _bench(args)
    if args.cmd == "faults":
        from .tools.faults import KINDS, run_faults
        from .tools.faults_rank import WHERE

        kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
        wheres = [w.strip() for w in args.where.split(",") if w.strip()] if args.where else None
        bad = [k for k in kinds if k not in KINDS] + [w for w in wheres or [] if w not in WHERE]
        if bad or not kinds:
            print(f"zbccl faults: error: unknown signal kind or workload, expected {','.join(KINDS)} and "
                  f"{','.join(WHERE)}, got {bad or args.kinds!r}", file=sys.stderr)
            return 2
        return run_faults(trials=args.trials, kinds=kinds, wheres=wheres, world=args.world, seed=args.seed,
                          as_json=args.json, minutes=args.minutes, parallel=args.parallel)
    if args.cmd == "soak":
        from .env import parse_size
        from .tools.soak import run_soak

        minutes = args.minutes if args.minutes is not None or args.ops is not None else 1.0
        if args.hosts > args.world:
            print(f"zbccl soak: --hosts must be at most --world, expected 1 to {args.world}, got {args.hosts}",
                  file=sys.stderr)
            return 2
        if args.netns and (args.hosts < 2 or args.world % args.hosts):
            print(f"zbccl soak: --netns needs --hosts of at least 2 dividing --world, got --hosts {args.hosts} "
                  f"--world {args.world}", file=sys.stderr)
            return 2
        return run_soak(world_size=args.world, minutes=minutes, ops=args.ops, seed=args.seed,
                        check_every=args.check_every, report_every=args.report_every,
                        heap_size=parse_size(args.heap_size), ep=not args.no_ep, as_json=args.json,
                        rss_growth=parse_size(args.max_rss_growth), hosts=args.hosts, netns=args.netns)
    if args.cmd == "bench-tp":
        from .bench.tp import run_from_args

        return run_from_args(args)
    if args.cmd == "tune":
        from pathlib import Path

        from .env import parse_size
        from .tools.tune import run_tune

        if args.hosts:
            from .tools.netns import HostsUnavailable
            from .tools.tune_hosts import run_tune_hosts

            try:
                run_tune_hosts(hosts=args.hosts, ranks_per_host=args.ranks_per_host, quick=args.quick,
                               out=Path(args.out) if args.out else None, own_cores=args.own_cores)
            except HostsUnavailable as exc:
                print(f"zbccl: {exc}", file=sys.stderr)
                return 2
            return 0
        run_tune(world_sizes=args.world_size, max_size=parse_size(args.max_size),
                 out=Path(args.out) if args.out else None)
        return 0
    if args.cmd == "build":
        from . import native
        from .tools.info import native_lines

        native.build_all()
        print("zbccl native libraries:")
        for line in native_lines(native.status()):
            print(line)
        return 0
    _parser().print_help()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
