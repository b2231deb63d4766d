"""Hugging Face transformers tensor parallelism on a torch.distributed backend: tiny models and checks.

Shared by ``examples/hf_tp.py``, the integration test and ``zbccl bench-tp``.
transformers (5.x, with accelerate) is an optional dependency (the ``hf``
extra); it is imported inside the functions, never at module import.

How transformers 5.x runs TP (``transformers/distributed/``):
``from_pretrained(path, distributed_config=DistributedConfig(tp_plan="auto"))``
(the older spelling ``tp_plan="auto"`` still works, with a FutureWarning)
builds a ``DeviceMesh`` over the *default* process group, so the backend is
whatever ``init_process_group`` chose, and shards the parameters as DTensors
by the model's plan. At inference (no grad) a row-parallel ``nn.Linear``
(``o_proj``, ``down_proj``, the MoE experts' ``down_proj``) calls
``dist.all_reduce(out, group=tp_group)`` on its plain local output; the
vocab-parallel embedding (``Partial`` -> ``Replicate``) and the lm_head
(``colwise_gather_output``) go through DTensor redistribution, i.e.
``torch.distributed._functional_collectives`` (an all_reduce and an
all_gather_into_tensor per forward). Nothing in that path is CUDA-specific:
dense (Llama) and MoE (Qwen3-MoE, Mixtral) plans all run on CPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["MODELS", "TinySpec", "build_checkpoint", "load", "prompt_ids", "forward_logits", "greedy",
           "sharded_params", "staged_bytes", "rank_check", "compare", "LOGIT_ATOL", "LOGIT_RTOL", "NEW_TOKENS"]

#: TP vs one process, fp32: the row-parallel matmuls sum their halves in another order (seen: 2e-7).
LOGIT_ATOL = 1e-5
LOGIT_RTOL = 1e-4
NEW_TOKENS = 16


@dataclass(frozen=True)
class TinySpec:
    """A model family and the config fields of its tiny random instance."""

    family: str  # "llama" | "qwen3_moe" | "mixtral"
    fields: dict[str, Any]


_COMMON = {"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "max_position_embeddings": 128}

#: The models the example and the test run. "moe" is Qwen3-MoE with one dense layer (layer 1), so the plan's
#: expert rules (packed_colwise gate_up, rowwise down, moe_tp_experts) and its dense MLP rules both apply.
MODELS: dict[str, TinySpec] = {
    "llama": TinySpec("llama", {**_COMMON, "intermediate_size": 128}),
    "moe": TinySpec("qwen3_moe", {**_COMMON, "head_dim": 16, "intermediate_size": 128,
                                  "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
                                  "mlp_only_layers": [1]}),
    "mixtral": TinySpec("mixtral", {**_COMMON, "intermediate_size": 64, "num_local_experts": 4,
                                    "num_experts_per_tok": 2}),
}


def _classes(family: str):
    import transformers as tf

    table = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
             "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
             "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM)}
    if family not in table:
        raise ValueError(f"hf: unknown model family, expected one of {sorted(table)}, got {family!r}")
    return table[family]


def build_checkpoint(spec: TinySpec | str, path: str | os.PathLike, *, seed: int = 0,
                     dtype: torch.dtype = torch.float32, **overrides) -> str:
    """Write a randomly initialised model (``torch.manual_seed(seed)``) to ``path``; nothing is downloaded.

    ``spec`` is a :data:`MODELS` key or a :class:`TinySpec`; ``overrides``
    replace config fields (the benchmark's hidden 2048). Deterministic: the
    same arguments give the same weights in any process. Returns ``path``.
    """
    spec = MODELS[spec] if isinstance(spec, str) else spec
    config_cls, model_cls = _classes(spec.family)
    config = config_cls(**{**spec.fields, **overrides})
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = model_cls(config).to(dtype)
    finally:
        torch.random.set_rng_state(state)
    model.save_pretrained(str(path))
    return str(path)


def load(path: str | os.PathLike, *, tp: bool, dtype: torch.dtype = torch.float32):
    """The checkpoint as an eval-mode causal LM: sharded by its ``tp_plan="auto"`` over the default group, or whole.

    ``tp=True`` is collective over the default process group (which must be
    initialised); ``tp=False`` needs no process group.
    """
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    kwargs: dict[str, Any] = {"dtype": dtype}
    if tp:
        import torch.distributed as dist

        # tp_size explicitly: DistributedConfig derives it from $WORLD_SIZE, which only torchrun sets
        # (without it a spawned world silently loads the whole model on every rank)
        kwargs["distributed_config"] = DistributedConfig(tp_plan="auto", tp_size=dist.get_world_size())
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the load report and "rules match nothing" lines
    hf_logging.disable_progress_bar()
    try:
        return AutoModelForCausalLM.from_pretrained(str(path), **kwargs).eval()
    finally:
        hf_logging.set_verbosity(verbosity)


def sharded_params(model) -> int:
    """How many of ``model``'s parameters are DTensors (0: the TP plan was not applied)."""
    from torch.distributed.tensor import DTensor

    return sum(isinstance(p, DTensor) for p in model.parameters())


def prompt_ids(*, batch: int = 2, length: int = 12, vocab: int = 256, seed: int = 1) -> torch.Tensor:
    """``[batch, length]`` ``torch.int64`` token ids, the same on every rank (a seeded generator)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=g)


def staged_bytes() -> int:
    """This rank's ``memory_stats()["staged_bytes"]`` (0 when zbccl is not initialised)."""
    import zbccl

    try:
        return int(zbccl.memory_stats()["staged_bytes"])
    except zbccl.ZbcclError:
        return 0


def forward_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """``[batch, length, vocab]`` float logits of one no-grad forward."""
    with torch.no_grad():
        return model(ids).logits


def greedy(model, ids: torch.Tensor, *, new_tokens: int = NEW_TOKENS) -> torch.Tensor:
    """``[batch, length + new_tokens]`` ``torch.int64``: greedy generation with a KV cache, exactly ``new_tokens``."""
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              pad_token_id=0)


def _run_backend(backend: str, paths: dict[str, str], ids: torch.Tensor, *, rank: int, world_size: int, store,
                 scope: bool, timeout_s: float) -> dict[str, dict]:
    """One ``init_process_group(backend)`` world: every model's TP logits and greedy tokens (and, for zbccl, the
    same inside ``heap_scope`` with the staged bytes per forward and per generated token)."""
    from datetime import timedelta

    import torch.distributed as dist

    import zbccl

    dist.init_process_group(backend, store=dist.PrefixStore(f"hf_tp/{backend}", store), rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s))
    out: dict[str, dict] = {}
    try:
        for name, path in paths.items():
            model = load(path, tp=True)
            s0 = staged_bytes()
            res = {"logits": forward_logits(model, ids), "sharded": sharded_params(model)}
            res["staged_per_forward"] = staged_bytes() - s0
            res["tokens"] = greedy(model, ids)
            if backend == "zbccl" and scope:
                with zbccl.heap_scope():
                    s0 = staged_bytes()
                    res["scope_logits"] = forward_logits(model, ids).clone()
                    s1 = staged_bytes()
                    res["scope_tokens"] = greedy(model, ids).clone()
                    s2 = staged_bytes()
                res["scope_staged_per_forward"] = s1 - s0
                res["scope_staged_per_token"] = (s2 - s1) / NEW_TOKENS
                res["scope_fallback_allocs"] = zbccl.memory_stats()["fallback_allocs"]
            out[name] = res
            del model
    finally:
        dist.destroy_process_group()
    return out


def rank_check(*, rank: int, world_size: int, store, paths: dict[str, str], backends=("gloo", "zbccl"),
               scope: bool = True, timeout_s: float = 120.0) -> dict[str, Any]:
    """One rank of the TP check: the whole model in this process, then each backend's TP run.

    ``paths`` maps a model name to its checkpoint (:func:`build_checkpoint`).
    Each backend gets its own ``init_process_group`` over ``store`` (distinct
    key prefixes) and is destroyed before the next. Returns
    ``{"reference": {name: {...}}, backend: {name: {...}}}`` with ``logits``
    (``[batch, length, vocab]``), ``tokens`` (``[batch, length + 16]``) and
    the staged-byte counts; :func:`compare` judges them.
    """
    ids = prompt_ids()
    results: dict[str, Any] = {"reference": {}}
    for name, path in paths.items():
        model = load(path, tp=False)
        results["reference"][name] = {"logits": forward_logits(model, ids), "tokens": greedy(model, ids)}
        del model
    for backend in backends:
        results[backend] = _run_backend(backend, paths, ids, rank=rank, world_size=world_size, store=store,
                                        scope=scope, timeout_s=timeout_s)
    return results


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


def compare(results: dict[str, Any], *, world_size: int) -> tuple[list[str], list[str]]:
    """``(report lines, failures)`` for one rank's :func:`rank_check` results.

    Tolerances: TP logits vs the single process within ``LOGIT_ATOL`` /
    ``LOGIT_RTOL`` (fp32); zbccl vs gloo bitwise at 2 ranks (a sum of two is
    the same in either order), within the same tolerance otherwise; greedy
    tokens identical everywhere; inside ``heap_scope`` the logits bitwise equal
    to zbccl's outside it and ``staged_bytes`` 0 per forward and per token.
    """
    lines, bad = [], []
    backends = [b for b in results if b != "reference"]
    for name, ref in results["reference"].items():
        for backend in backends:
            res = results[backend][name]
            if not res["sharded"]:
                bad.append(f"{name} {backend}: no parameter is sharded, expected the tp_plan applied")
            d = _max_diff(res["logits"], ref["logits"])
            close = torch.allclose(res["logits"], ref["logits"], atol=LOGIT_ATOL, rtol=LOGIT_RTOL)
            same = torch.equal(res["tokens"], ref["tokens"])
            staged = f", staged/forward {res['staged_per_forward']} B" if backend == "zbccl" else ""
            lines.append(f"{name:8s} {backend:6s} logits max|diff| vs 1 process {d:.2e} "
                         f"({'ok' if close else 'FAIL'}), 16 greedy tokens {'identical' if same else 'DIFFER'}"
                         + staged)
            if not close:
                bad.append(f"{name} {backend}: logits differ from one process by {d:.2e}, expected within "
                           f"atol {LOGIT_ATOL} rtol {LOGIT_RTOL}")
            if not same:
                bad.append(f"{name} {backend}: greedy tokens differ from one process")
        if "gloo" in backends and "zbccl" in backends:
            z, g = results["zbccl"][name], results["gloo"][name]
            d = _max_diff(z["logits"], g["logits"])
            ok = torch.equal(z["logits"], g["logits"]) if world_size == 2 else torch.allclose(
                z["logits"], g["logits"], atol=LOGIT_ATOL, rtol=LOGIT_RTOL)
            lines.append(f"{name:8s} zbccl vs gloo logits max|diff| {d:.2e} ({'ok' if ok else 'FAIL'})")
            if not ok:
                bad.append(f"{name}: zbccl logits differ from gloo by {d:.2e}")
            if not torch.equal(z["tokens"], g["tokens"]):
                bad.append(f"{name}: zbccl greedy tokens differ from gloo")
        z = results.get("zbccl", {}).get(name)
        if z is not None and "scope_logits" in z:
            lines.append(f"{name:8s} zbccl in heap_scope: staged/forward {z['scope_staged_per_forward']} B, "
                         f"staged/token {z['scope_staged_per_token']:g} B, fallback allocs "
                         f"{z['scope_fallback_allocs']}")
            if not torch.equal(z["scope_logits"], z["logits"]):
                bad.append(f"{name}: logits inside heap_scope differ from outside")
            if not torch.equal(z["scope_tokens"], z["tokens"]):
                bad.append(f"{name}: greedy tokens inside heap_scope differ from outside")
            if z["scope_staged_per_forward"] or z["scope_staged_per_token"]:
                bad.append(f"{name}: staged_bytes inside heap_scope, expected 0 per forward and per token, got "
                           f"{z['scope_staged_per_forward']} and {z['scope_staged_per_token']:g}")
    return lines, bad
