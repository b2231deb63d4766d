"""Usage: python examples/sglang_bench.py [--python .venv-sglang/bin/python] [--rounds 2] [--batch 1,8]
       [--hidden 2048] [--layers 4] [--new-tokens 32] [--model llama] [--json PATH]

SGLang's default CPU path (gloo on this machine) against ``--enable-zbccl`` (``ZBCCL_ENABLE=1``), same
model and prompts, interleaved runs (default, zbccl, default, zbccl, ...), each run a fresh
``sgl.Engine`` through ``examples/sglang_tp.py --bench`` (a warm-up generation, then one timed
generation of ``--new-tokens`` greedy tokens per prompt), TP=2, with ``ZBCCL_SGLANG_PROBE=1`` on both
paths so each TP worker times every op of its TP group and the model forward alike.

Prints per batch size and path: output tokens/s and ms per output token (median of the rounds); the
communication time per step (TP group ops summed over the timed generation, divided by the forward
steps): ``last arrival`` sums, per call, the time from the last rank's entry to the last rank's exit
(the collective itself without the ranks' compute skew, which neither path can shorten), ``mean`` is
the ranks' mean host time inside the calls (waiting for the slower rank included); its share of a
forward step (by ``last arrival``); whether the runs gave the same tokens; and the communication
memory per rank: zbccl's staged bytes during the timed generation (what it copied because an
operand was not a heap tensor: the only memory it uses beyond the payload) and, on both paths, the
TCP sockets of each worker (SGLang keeps its gloo groups for its control messages either way) with
the kernel memory they hold (``ss`` skmem). Refuses a run whose workers did not use the expected path.
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


def run(a, *, zbccl: bool) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), ZBCCL_SGLANG_PROBE="1")
    env.pop("ZBCCL_ENABLE", None)
    cmd = [a.python, str(ROOT / "examples" / "sglang_tp.py"), "--bench", "--api", "engine", "--model", a.model,
           "--batch", a.batch, "--hidden", str(a.hidden), "--layers", str(a.layers), "--new-tokens",
           str(a.new_tokens), "--model-dir", a.model_dir, "--mem-fraction", "0.3"] + (["--zbccl"] if zbccl else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    if proc.returncode:
        sys.exit(f"sglang_bench: run failed (zbccl={zbccl}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    results = [json.loads(ln[7:]) for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    for r in results:
        on = [w["zbccl"] for w in r["after"]]
        if len(on) != 2 or on != [zbccl, zbccl]:  # a run on the other path would be compared with itself
            sys.exit(f"sglang_bench: a {'zbccl' if zbccl else 'default'} run's workers reported zbccl={on}")
    return results


def _delta(r: dict) -> list[dict]:
    """Per rank: the timed generation's op times and spans (after minus before)."""
    out = []
    for w0, w1 in zip(r["before"], r["after"]):
        times = {k: [v[0] - w0["times"].get(k, [0, 0])[0], v[1] - w0["times"].get(k, [0, 0])[1]]
                 for k, v in w1["times"].items()}
        spans = {k: v[len(w0["spans"].get(k, [])):] for k, v in w1["spans"].items()}
        staged = (w1["memory"]["staged_bytes"] - w0["memory"]["staged_bytes"]) if "memory" in w1 else None
        out.append({"times": times, "spans": spans, "staged": staged})
    return out


def comm_ms(r: dict) -> tuple[float, float, float, int]:
    """(last arrival, mean over ranks of host time, forward ms, steps) per forward step of the timed generation."""
    d = _delta(r)
    steps = d[0]["times"]["forward"][0]
    ops = [k for k in d[0]["times"] if k != "forward"]
    keys = set.intersection(*(set(w["spans"]) for w in d)) & set(ops)
    last = 0
    for key in keys:
        for call in zip(*(w["spans"][key] for w in d)):
            last += max(t1 for _, t1 in call) - max(t0 for t0, _ in call)
    mean = statistics.mean(sum(w["times"][k][1] for k in ops) for w in d)
    fwd = statistics.mean(w["times"]["forward"][1] for w in d)
    return last / 1e6 / steps, mean / 1e6 / steps, fwd / 1e6 / steps, steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--python", default=str(ROOT / ".venv-sglang" / "bin" / "python"))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--model", default="llama")
    p.add_argument("--batch", default="1,8")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    tmp = tempfile.TemporaryDirectory(prefix="zbccl-sglang-bench-")
    a.model_dir = tmp.name
    runs: dict[tuple[str, int], list[dict]] = {}
    names = ["default", "zbccl"]
    for _ in range(a.rounds):
        for name in names:
            for r in run(a, zbccl=name == "zbccl"):
                runs.setdefault((name, r["batch"]), []).append(r)
    print(f"# SGLang TP=2 {a.model} hidden {a.hidden} layers {a.layers}, {a.new_tokens} new tokens, "
          f"{a.rounds} interleaved rounds (median), torch threads per worker "
          f"{runs[(names[0], int(a.batch.split(',')[0]))][0]['after'][0]['threads']}")
    print("| batch | path | tok/s | ms/token | forward ms/step | comm ms/step (last arrival) | (mean rank) | "
          "comm share of a step | same tokens | staged B/rank | TCP sockets/rank (kernel B held) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for batch in sorted({b for _, b in runs}):
        every = [json.dumps(r["tokens"]) for n in names for r in runs[(n, batch)]]
        common = max(set(every), key=every.count)
        for name in names:
            rs = runs[(name, batch)]
            tps = statistics.median(r["tokens_per_s"] for r in rs)
            mpt = statistics.median(r["ms_per_token"] for r in rs)
            last, mean, fwd, _ = (statistics.median(comm_ms(r)[i] for r in rs) for i in range(4))
            same = f"{sum(json.dumps(r['tokens']) == common for r in rs)}/{len(rs)}"
            staged = "-" if name == "default" else str(max(w["staged"] for r in rs for w in _delta(r)))
            tcp = rs[0]["tcp_memory"]
            socks = "/".join(f"{v['sockets']} ({v['allocated']})" for v in tcp.values())
            print(f"| {batch} | {name} | {tps:.1f} | {mpt:.1f} | {fwd:.1f} | {last:.3f} | {mean:.3f} | "
                  f"{100 * last / fwd:.1f}% | {same} | {staged} | {socks} |")
    for batch in sorted({b for _, b in runs}):
        c = {n: statistics.median(comm_ms(r)[0] for r in runs[(n, batch)]) for n in names}
        t = {n: statistics.median(r["tokens_per_s"] for r in runs[(n, batch)]) for n in names}
        per_op = {}
        for n in names:
            r = runs[(n, batch)][0]
            d = _delta(r)
            per_op[n] = {k.split(".", 1)[-1]: d[0]["times"][k][0] for k in d[0]["times"] if k != "forward"}
        print(f"batch {batch}: comm per step zbccl/default {c['zbccl'] / c['default']:.2f}x, tokens/s "
              f"zbccl/default {t['zbccl'] / t['default']:.2f}x; calls in the timed generation: {per_op['zbccl']}")
    if a.json:
        Path(a.json).write_text(json.dumps({f"{k[0]}-{k[1]}": v for k, v in runs.items()}))


if __name__ == "__main__":
    main()
