"""Usage: zbccl bench-tp [--batch 1,8] [--hidden 2048] [--layers 4] [--vocab 32000] [--dtype fp32|bf16]
                      [--steps 16] [--rounds 5] [--variants V,..] [--threads T] [--idle-wait S]
                      [--json PATH]

Decode-step benchmark of a Hugging Face transformers TP=2 Llama-style model
(``tp_plan="auto"``, random weights from its config, nothing downloaded) on
2 local ranks. Per decode step (batch B, one new token, KV cache) it times
five variants, interleaved in the same processes on the same sharded model:

- ``zbccl``: every collective on the ``zbccl`` process group (the default group);
- ``zbccl+scope``: the same inside ``zbccl.heap_scope()`` (activations and KV
  cache are heap tensors, so the collectives are zero-buffer);
- ``gloo``: the same calls on a gloo group of the same ranks
  (``dist.new_group(backend="gloo")``);
- ``none`` / ``none+scope``: the collectives removed (the lower bound).

How the collectives are switched: per forward the model makes 2 all_reduces
per layer (``transformers.distributed.tensor_parallel`` calls
``dist.all_reduce(out, group=tp)`` after each row-parallel linear), one
functional all_reduce (vocab-parallel embedding) and one functional
all_gather (lm_head), through DTensor. The benchmark routes exactly these
three entry points (``tensor_parallel.dist.all_reduce``,
``_functional_collectives.all_reduce`` and ``.all_gather_single``): to the
model's own group, to the gloo group, or to nothing (all_reduce returns its
input; the all_gather returns an uninitialised tensor of the gathered
shape). It counts the calls: a step that makes another number is reported.

Before each round rank 0 waits (at most ``--idle-wait`` s) for an idle
machine; ``load`` is the most CPU (cores) other processes used at a round's
start. Rows: ``step_us``, the median over rounds of each round's median step
time (max over ranks), ``min_us`` the fastest round (the host's fast
state), and the spread over rounds; ``x_none``, step over the
matching no-communication step; ``comm_us``, time inside the collective calls
per step (mean over ranks, median over rounds; it includes waiting for the
peer), and ``comm%`` of the step; speed-ups against gloo per step and per
communication time; ``staged_bytes`` per step; collectives per step; #wrong:
greedy tokens that differ from the gloo run (zbccl variants).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from typing import IO

import torch

__all__ = ["run_bench_tp", "rank_main", "VARIANTS"]

VARIANTS = ("none", "none+scope", "zbccl", "zbccl+scope", "gloo")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_PROMPT = 16


class _Router:
    """Routes the model's three collective entry points to one group, or to nothing; counts the calls."""

    def __init__(self, gloo) -> None:
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol

        self.dist, self.funcol, self.gloo = dist, funcol, gloo
        self.ar, self.fr, self.fg = dist.all_reduce, funcol.all_reduce, funcol.all_gather_single
        self.mode, self.calls, self.comm_s = "zbccl", 0, 0.0

    def all_reduce(self, tensor, op=None, group=None, async_op=False):
        self.calls += 1
        if self.mode == "none":
            return None
        t0 = time.perf_counter()
        group = self.gloo if self.mode == "gloo" else group
        work = self.ar(tensor, op=op or self.dist.ReduceOp.SUM, group=group, async_op=async_op)
        self.comm_s += time.perf_counter() - t0
        return work

    def _waited(self, result, t0: float):
        """The functional result waited for here, so its time is counted (DTensor waits at once anyway)."""
        if isinstance(result, self.funcol.AsyncCollectiveTensor):
            result = result.wait()
        self.comm_s += time.perf_counter() - t0
        return result

    def f_all_reduce(self, tensor, reduceOp, group, tag=""):  # noqa: N803 - torch's spelling
        self.calls += 1
        if self.mode == "none":
            return tensor
        t0 = time.perf_counter()
        return self._waited(self.fr(tensor, reduceOp, self.gloo if self.mode == "gloo" else group, tag), t0)

    def f_all_gather(self, tensor, gather_dim, group, tag=""):
        self.calls += 1
        if self.mode == "none":
            shape = list(tensor.shape)
            shape[gather_dim] *= self.dist.get_world_size()
            return tensor.new_empty(shape)
        t0 = time.perf_counter()
        return self._waited(self.fg(tensor, gather_dim, self.gloo if self.mode == "gloo" else group, tag), t0)

    @contextlib.contextmanager
    def installed(self):
        import transformers.distributed.tensor_parallel as tpmod

        shim = _DistShim(self)
        saved = tpmod.dist
        tpmod.dist, self.funcol.all_reduce, self.funcol.all_gather_single = shim, self.f_all_reduce, self.f_all_gather
        try:
            yield self
        finally:
            tpmod.dist, self.funcol.all_reduce, self.funcol.all_gather_single = saved, self.fr, self.fg


class _DistShim:
    """``torch.distributed`` with ``all_reduce`` replaced by the router's (what tensor_parallel sees as ``dist``)."""

    def __init__(self, router: _Router) -> None:
        self.all_reduce = router.all_reduce
        self._dist = router.dist

    def __getattr__(self, name: str):
        return getattr(self._dist, name)


def _decode(model, router: _Router, variant: str, *, batch: int, steps: int, vocab: int):
    """One prefill and ``steps`` timed decode steps.

    Returns ``(step seconds, tokens [batch, steps], staged bytes / step, collectives / step, seconds inside
    collectives / step, heap_scope fallback allocations)``.
    """
    from transformers import DynamicCache

    import zbccl

    from .hf import staged_bytes

    router.mode = variant.split("+")[0]
    scope = zbccl.heap_scope() if variant.endswith("+scope") else contextlib.nullcontext()
    g = torch.Generator().manual_seed(batch)
    prompt = torch.randint(0, vocab, (batch, _PROMPT), generator=g)
    times, toks = [], []
    with torch.no_grad(), scope:
        cache = DynamicCache(config=model.config)
        out = model(input_ids=prompt, past_key_values=cache, use_cache=True)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        router.dist.barrier(group=router.gloo)
        s0, c0, f0, comm0 = staged_bytes(), router.calls, _fallbacks(), router.comm_s
        for _ in range(steps):
            t0 = time.perf_counter()
            out = model(input_ids=tok, past_key_values=cache, use_cache=True)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            times.append(time.perf_counter() - t0)
            toks.append(tok)
        staged, calls, fallbacks = staged_bytes() - s0, router.calls - c0, _fallbacks() - f0
        comm = router.comm_s - comm0
        del cache, out
    return times, torch.cat(toks, 1), staged / steps, calls / steps, comm / steps, fallbacks


def _fallbacks() -> int:
    """heap_scope allocations that missed the heap (full) so far: they would stage, so the bench reports them."""
    import zbccl

    return int(zbccl.memory_stats()["fallback_allocs"])


def rank_main(*, rank: int, world_size: int, store, opts: dict) -> dict | None:
    """One rank (called by ``launch_local``): load the TP model, run every (batch, round, variant)."""
    import torch.distributed as dist

    import zbccl  # noqa: F401 - registers the backend

    from . import hf

    if rank == 0:
        root = tempfile.mkdtemp(prefix="zbccl-bench-tp-")
        hf.build_checkpoint("llama", os.path.join(root, "m"), dtype=_DTYPES[opts["dtype"]], **opts["config"])
        store.set("bench_tp/root", root)
    root = store.get("bench_tp/root").decode()
    dist.init_process_group("zbccl", store=dist.PrefixStore("bench_tp", store), rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=300))
    try:
        gloo = dist.new_group(backend="gloo")
        model = hf.load(os.path.join(root, "m"), tp=True, dtype=_DTYPES[opts["dtype"]])
        dist.barrier(group=gloo)
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)
        router = _Router(gloo)
        router.store = store
        rows = []
        with router.installed():
            for batch in opts["batches"]:
                rows.extend(_batch_rows(model, router, batch, opts, rank))
        samples = [None] * world_size
        dist.all_gather_object(samples, rows, group=gloo)
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return None
    return {"samples": samples, "threads": torch.get_num_threads()}


def _batch_rows(model, router: _Router, batch: int, opts: dict, rank: int) -> list[dict]:
    from .timing import leader_then_all, wait_for_idle

    rows = {v: {"batch": batch, "variant": v, "round_medians": [], "comm": [], "staged": [], "calls": [],
                "wrong": 0, "fallback_allocs": 0, "load": []}
            for v in opts["variants"]}
    vocab = opts["config"]["vocab_size"]
    for rnd in range(opts["rounds"] + 1):  # round 0 warms up and is dropped
        gate = leader_then_all(router.store, f"bench_tp/idle/{batch}/{rnd}", rank,
                               lambda: wait_for_idle(max_wait_s=opts["idle_wait"]), timeout_s=opts["idle_wait"] + 60)
        if rnd:
            for r in rows.values():
                r["load"].append(gate["load_cores"])
        order = list(opts["variants"])
        order = order[rnd % len(order):] + order[:rnd % len(order)]
        tokens = {}
        for v in order:
            times, toks, staged, calls, comm, fallbacks = _decode(model, router, v, batch=batch,
                                                                  steps=opts["steps"], vocab=vocab)
            tokens[v] = toks
            rows[v]["fallback_allocs"] += fallbacks
            if rnd:
                rows[v]["round_medians"].append(statistics.median(times))
                rows[v]["comm"].append(comm)
                rows[v]["staged"].append(staged)
                rows[v]["calls"].append(calls)
        if "gloo" in tokens:
            for v in tokens:
                if v.startswith("zbccl"):
                    rows[v]["wrong"] += int((tokens[v] != tokens["gloo"]).sum())
        if rank == 0 and opts["progress"]:
            print(f"  batch {batch} round {rnd}/{opts['rounds']} done", file=sys.stderr, flush=True)
    return list(rows.values())


# ----------------------------------------------------------------------------- the report
def _combine(samples: list[list[dict]]) -> list[dict]:
    """Per (batch, variant): the max over ranks of each round's median, then the median over rounds."""
    out = []
    for rows in zip(*samples):
        r0 = rows[0]
        per_round = [max(vals) for vals in zip(*(r["round_medians"] for r in rows))]
        med = statistics.median(per_round)
        out.append({"batch": r0["batch"], "variant": r0["variant"], "step_us": med * 1e6,
                    "min_us": min(per_round) * 1e6,
                    "spread_pct": 100 * (max(per_round) - min(per_round)) / med,
                    "rounds_us": [round(x * 1e6, 1) for x in per_round],
                    "comm_us": statistics.median(statistics.fmean(c) for c in zip(*(r["comm"] for r in rows))) * 1e6,
                    "load_cores": max(rows[0].get("load") or [0.0]),
                    "staged_per_step": max(max(r["staged"]) for r in rows),
                    "calls_per_step": max(max(r["calls"]) for r in rows),
                    "wrong": sum(r["wrong"] for r in rows),
                    "fallback_allocs": sum(r.get("fallback_allocs", 0) for r in rows)})
    by = {(r["batch"], r["variant"]): r for r in out}
    for r in out:
        base = by.get((r["batch"], "none+scope" if r["variant"].endswith("+scope") else "none"))
        gloo = by.get((r["batch"], "gloo"))
        comm = r["variant"].startswith(("zbccl", "gloo"))
        r["comm_pct"] = 100 * r["comm_us"] / r["step_us"] if comm else None
        r["x_none"] = r["step_us"] / base["step_us"] if base and comm else None
        r["x_gloo_step"] = gloo["step_us"] / r["step_us"] if gloo else None
        r["x_gloo_comm"] = gloo["comm_us"] / r["comm_us"] if gloo and comm and r["comm_us"] > 0 else None
        if not comm:
            r["comm_us"] = None
    return out


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_table(rows: list[dict], out: IO[str]) -> None:
    """The rows as a fixed-width table (one line per batch and variant)."""
    head = (f"{'batch':>5} {'variant':<12} {'step_us':>9} {'min_us':>9} {'spread%':>7} {'x_none':>6} {'comm_us':>8} {'comm%':>6} "
            f"{'x_gloo':>6} {'x_gloo_comm':>11} {'staged_B/step':>13} {'coll/step':>9} {'load':>5} {'#wrong':>6}")
    print(head, file=out)
    for r in rows:
        print(f"{r['batch']:>5} {r['variant']:<12} {r['step_us']:>9.1f} {r['min_us']:>9.1f} {r['spread_pct']:>7.1f} "
              f"{_fmt(r['x_none'], '6.2f'):>6} {_fmt(r['comm_us'], '8.1f'):>8} {_fmt(r['comm_pct'], '6.1f'):>6} "
              f"{_fmt(r['x_gloo_step'], '6.2f'):>6} {_fmt(r['x_gloo_comm'], '11.2f'):>11} "
              f"{r['staged_per_step']:>13.0f} {r['calls_per_step']:>9.1f} {r['load_cores']:>5.2f} "
              f"{r['wrong'] if not r['variant'].startswith(('none', 'gloo')) else '-':>6}", file=out)


def run_bench_tp(*, batches=(1, 8), hidden: int = 2048, layers: int = 4, vocab: int = 32000,
                 dtype: str = "fp32", steps: int = 16, rounds: int = 5, threads: int | None = None,
                 variants=VARIANTS, idle_wait: float = 10.0, json_path: str | None = None, progress: bool = True,
                 out: IO[str] | None = None) -> dict:
    """Run the decode-step benchmark on 2 local ranks; print the table; return (and optionally write) the results.

    The model: Llama-style, ``hidden`` wide, ``layers`` deep, 16 heads of
    ``hidden // 16`` (8 KV heads), MLP ``hidden * 11 // 4``, ``vocab`` tokens.
    """
    from ..tools.launch import launch_local, rank_threads
    from . import report

    out = out or sys.stdout
    if dtype not in _DTYPES:
        raise ValueError(f"bench-tp: unknown dtype, expected one of {sorted(_DTYPES)}, got {dtype!r}")
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not variants:
        raise ValueError(f"bench-tp: unknown variants, expected some of {list(VARIANTS)}, got {list(variants)}")
    if hidden % 32 or layers < 1 or steps < 1 or rounds < 1 or not batches:
        raise ValueError(f"bench-tp: bad shape, expected hidden % 32 == 0 and layers, steps, rounds >= 1, got "
                         f"hidden {hidden}, layers {layers}, steps {steps}, rounds {rounds}")
    config = {"hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": 16,
              "num_key_value_heads": 8, "head_dim": hidden // 16, "intermediate_size": hidden * 11 // 4,
              "vocab_size": vocab, "max_position_embeddings": 4096}
    opts = {"batches": list(batches), "dtype": dtype, "steps": steps, "rounds": rounds, "config": config,
            "variants": list(variants), "progress": progress, "idle_wait": float(idle_wait)}
    nthreads = threads or rank_threads(2)
    t0 = time.perf_counter()
    res = launch_local(rank_main, 2, timeout=900 + 60 * rounds * len(batches), threads=nthreads, opts=opts)[0]
    rows = _combine(res["samples"])
    doc = {"machine": report.machine_info(world_size=2, threads=res["threads"]), "options": opts, "rows": rows,
           "wall_s": round(time.perf_counter() - t0, 1)}
    print(f"zbccl bench-tp: HF transformers TP=2 Llama-style decode, hidden {hidden}, {layers} layers, vocab "
          f"{vocab}, {dtype}, {steps} steps x {rounds} rounds, {res['threads']} thread(s)/rank", file=out)
    print_table(rows, out)
    if json_path:
        report.write_json(doc, json_path)
        print(f"wrote {json_path}", file=out)
    return doc


def main(argv: list[str] | None = None) -> int:
    """``python -m zbccl.bench.tp`` / ``zbccl bench-tp``."""
    import argparse

    usage, description = __doc__.split("\n\n", 2)[:2]
    p = argparse.ArgumentParser(prog="zbccl bench-tp", usage=usage.removeprefix("Usage: "),
                                description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run_from_args(p.parse_args(argv))


def add_arguments(p) -> None:
    """The command's options (shared by ``zbccl bench-tp`` and ``python -m zbccl.bench.tp``)."""
    p.add_argument("--batch", default="1,8", help="comma list of batch sizes (default 1,8)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", default="fp32", choices=sorted(_DTYPES))
    p.add_argument("--steps", type=int, default=16, help="timed decode steps per run (default 16)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds after one warm-up round (default 5)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {','.join(VARIANTS)}")
    p.add_argument("--threads", type=int, default=None, help="intra-op threads per rank (default: cores/2)")
    p.add_argument("--idle-wait", type=float, default=10.0,
                   help="max seconds to wait for an idle machine before each round (default 10)")
    p.add_argument("--json", metavar="PATH", help="write the rows and machine info")


def run_from_args(args) -> int:
    split = lambda text: [x.strip() for x in text.split(",") if x.strip()]  # noqa: E731
    try:
        doc = run_bench_tp(batches=[int(b) for b in split(args.batch)], hidden=args.hidden, layers=args.layers,
                           vocab=args.vocab, dtype=args.dtype, steps=args.steps, rounds=args.rounds,
                           threads=args.threads, variants=split(args.variants), idle_wait=args.idle_wait,
                           json_path=args.json)
    except ValueError as exc:
        print(f"zbccl bench-tp: {exc}", file=sys.stderr)
        return 2
    return 1 if any(r["wrong"] for r in doc["rows"]) else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
