"""Usage: .venv-sglang/bin/python examples/sglang_tp.py [--api engine|server] [--zbccl] [--model llama,moe]
       [--hidden H] [--layers L] [--batch B] [--new-tokens N] [--tp 2] [--pp 1] [--ep 1] [--bench] [--json PATH]

Runs SGLang 0.5.23 on CPU with tensor parallelism on a tiny model built from a config with seeded
random weights (nothing downloaded, no tokenizer: prompts are token ids of lengths 5, 12, 19, ...),
greedy, the torch_native attention backend, bf16:

* ``--api engine``: ``sgl.Engine(...)`` in this process; ``--zbccl`` sets ``ZBCCL_ENABLE=1`` first
  (the Engine rejects unknown keyword arguments).
* ``--api server``: ``python -m sglang.launch_server`` on 127.0.0.1 at a port the OS picked, requests
  through HTTP ``/generate``; ``--zbccl`` passes ``--enable-zbccl``. The server is stopped with
  SIGTERM (SGLang ends its own process tree) and this waits until every process of it is gone.

Prints one ``RESULT {json}`` line per model and batch: the generated token ids and their logprobs,
the workers' communication report (``internal_states[0]["zbccl"]`` of ``/server_info``, from
``zbccl.integrations.sglang.probe``: zbccl groups and call counts, mapped heap segments,
``staged_bytes``; with ``ZBCCL_SGLANG_PROBE=1`` per-op times) taken before and after the
generation, and the pids of the run's processes. With ``--bench`` a warm-up generation comes first
and the timed one gives output tokens/s and ms per output token.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vllm_tp import _ARCH, prompts, write_config  # noqa: E402  (the same tiny models and prompts)

CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1", "TORCH_COMPILE_DISABLE": "1"}


def cpu_env(tp: int) -> dict[str, str]:
    """What SGLang 0.5.23 needs on this CPU: its CPU engine, one core per rank (``SGLANG_CPU_OMP_THREADS_BIND``;
    its automatic binding wants a NUMA node per rank; ``OMP_NUM_THREADS``: the cores per rank), no
    torch.compile of its helpers (11-22 s first request)."""
    ncpu = os.cpu_count() or 1
    out = dict(CPU_ENV)
    out["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(str(i % ncpu) for i in range(tp))
    # Without AMX SGLang binds no threads (sgl_kernel's init_cpu_threads_env is AMX-only), so each worker
    # would run torch's default of one thread per core: TP ranks x cores threads spinning on the cores.
    out["OMP_NUM_THREADS"] = str(max(1, ncpu // tp))
    return out


def engine_kwargs(a, path: str) -> dict:
    return dict(model_path=path, device="cpu", tp_size=a.tp, pp_size=a.pp, ep_size=a.ep, skip_tokenizer_init=True,
                attention_backend="torch_native", dtype="bfloat16", mem_fraction_static=a.mem_fraction,
                max_total_tokens=8192, disable_cuda_graph=True, random_seed=0, log_level="warning",
                max_running_requests=max(8, a.batch_max))


def server_argv(a, path: str, port: int) -> list[str]:
    argv = ["--model-path", path, "--device", "cpu", "--tp", str(a.tp), "--pp-size", str(a.pp), "--ep-size", str(a.ep),
            "--skip-tokenizer-init", "--attention-backend", "torch_native", "--dtype", "bfloat16",
            "--mem-fraction-static", str(a.mem_fraction), "--max-total-tokens", "8192", "--disable-cuda-graph",
            "--random-seed", "0", "--log-level", "warning", "--max-running-requests", str(max(8, a.batch_max)),
            "--host", "127.0.0.1", "--port", str(port)]
    return argv + (["--enable-zbccl"] if a.zbccl else [])


def sampling(a) -> dict:
    return {"temperature": 0.0, "max_new_tokens": a.new_tokens, "ignore_eos": True}


def _outputs(outs: list[dict]) -> dict:
    tokens = [list(o["output_ids"]) for o in outs]
    logprobs = [[lp[0] for lp in o["meta_info"].get("output_token_logprobs") or []] for o in outs]
    return {"tokens": tokens, "logprobs": logprobs}


def _zbccl_report(info: dict) -> list[dict]:
    states = info.get("internal_states") or [{}]
    return states[0].get("zbccl", [])


# ------------------------------------------------------------------ Engine
def run_engine(a, path: str, batch: int, result: dict) -> None:
    import sglang as sgl

    llm = sgl.Engine(**engine_kwargs(a, path))
    try:
        ids = prompts(batch, a.vocab)
        if a.bench:
            llm.generate(input_ids=ids, sampling_params=sampling(a))
        result["before"] = _zbccl_report(llm.get_server_info())
        t0 = time.perf_counter()
        outs = llm.generate(input_ids=ids, sampling_params=sampling(a), return_logprob=True)
        result["wall_s"] = time.perf_counter() - t0
        result["after"] = _zbccl_report(llm.get_server_info())
        result["tcp_memory"] = tcp_memory([w["pid"] for w in result["after"]])
        result.update(_outputs(outs))
    finally:
        llm.shutdown()


# ------------------------------------------------------------------ HTTP server
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(url: str, body: dict | None = None, timeout: float = 600) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _children(pid: int) -> list[int]:
    """``pid`` and every process below it (from /proc's parent links)."""
    parent = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    parent[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += [c for c, pp in parent.items() if pp == p]
    return out


def tcp_memory(pids: list[int]) -> dict[str, dict[str, int]]:
    """Per pid, its TCP sockets (gloo's pairs and SGLang's store connections) from ``ss -tmnp``: how many,
    the kernel memory they hold now (skmem r+t+f+w) and their buffer limits (rb+tb)."""
    out = {str(p): {"sockets": 0, "allocated": 0, "limits": 0} for p in pids}
    try:
        text = subprocess.run(["ss", "-tmnpH"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return out
    owner = None
    for line in text.splitlines():
        if "users:(" in line:
            owner = next((str(p) for p in pids if f"pid={p}," in line), None)
        if owner is not None and "skmem:(" in line:
            fields = dict((f[:1] if f[:2] not in ("rb", "tb", "bl") else f[:2], int("".join(c for c in f if c.isdigit())))
                          for f in line.split("skmem:(")[1].split(")")[0].split(","))
            rec = out[owner]
            rec["sockets"] += 1
            rec["allocated"] += fields.get("r", 0) + fields.get("t", 0) + fields.get("f", 0) + fields.get("w", 0)
            rec["limits"] += fields.get("rb", 0) + fields.get("tb", 0)
            owner = None
    return out


def _segments(pid: int) -> list[str]:
    """The zbccl heap segments process ``pid`` maps, read from here (/proc/<pid>/maps)."""
    mark = "/memfd:zbccl-"
    try:
        with open(f"/proc/{pid}/maps") as f:
            return sorted({ln[ln.index(mark) + 1:].split(" ")[0] for ln in f if mark in ln})
    except OSError:
        return []


def run_server(a, path: str, batch: int, result: dict) -> None:
    port = _free_port()
    env = dict(os.environ)
    cmd = [sys.executable, "-m", "sglang.launch_server"] + server_argv(a, path, port)
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline, delay = time.monotonic() + a.start_timeout, 0.2
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"sglang_tp: the server exited with {proc.returncode} before it was ready")
            try:
                _http(f"{base}/model_info", timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"sglang_tp: the server was not ready after {a.start_timeout} s") from None
                time.sleep(delay)  # polling for readiness, with back-off
                delay = min(2.0, delay * 1.5)
        result["server_pids"] = _children(proc.pid)
        ids = prompts(batch, a.vocab)
        if a.bench:
            _http(f"{base}/generate", {"input_ids": ids, "sampling_params": sampling(a)})
        result["before"] = _zbccl_report(_http(f"{base}/server_info"))
        t0 = time.perf_counter()
        outs = _http(f"{base}/generate", {"input_ids": ids, "sampling_params": sampling(a), "return_logprob": True})
        result["wall_s"] = time.perf_counter() - t0
        result["after"] = _zbccl_report(_http(f"{base}/server_info"))
        result["maps_seen"] = {str(w["pid"]): _segments(w["pid"]) for w in result["after"]}
        result.update(_outputs(outs))
    except BaseException:
        log.seek(0)
        sys.stderr.write(log.read().decode(errors="replace")[-6000:])
        raise
    finally:
        _stop(proc, result)


def _stop(proc: subprocess.Popen, result: dict) -> None:
    """SIGTERM to the server (SGLang's handler ends its process tree), then wait for every process of it."""
    tree = _children(proc.pid)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        result["killed"] = True
    deadline = time.monotonic() + 30
    left = [p for p in tree if os.path.exists(f"/proc/{p}")]
    while left and time.monotonic() < deadline:
        time.sleep(0.2)  # polling for exits, not synchronisation
        left = [p for p in tree if os.path.exists(f"/proc/{p}")]
    result["server_returncode"] = proc.returncode
    result["left_after_stop"] = left


# ------------------------------------------------------------------
def run_one(a, model: str, batch: int) -> dict:
    result = {"model": model, "api": a.api, "hidden": a.hidden, "layers": a.layers, "batch": batch, "tp": a.tp, "pp": a.pp,
              "ep": a.ep, "zbccl": bool(a.zbccl), "new_tokens": a.new_tokens}
    with tempfile.TemporaryDirectory(prefix="zbccl-sglang-") as tmp:
        path = tmp
        if a.model_dir:  # a checkpoint kept between runs (benchmarks): written once per configuration
            path = os.path.join(a.model_dir, f"{model}-h{a.hidden}-l{a.layers}-v{a.vocab}")
            if not os.path.exists(os.path.join(path, "model.safetensors")):
                os.makedirs(path, exist_ok=True)
                write_config(path, model=model, hidden=a.hidden, layers=a.layers, vocab=a.vocab, weights="random")
        else:
            write_config(path, model=model, hidden=a.hidden, layers=a.layers, vocab=a.vocab, weights="random")
        (run_engine if a.api == "engine" else run_server)(a, path, batch, result)
    n_out = sum(len(t) for t in result["tokens"])
    result.update(out_tokens=n_out, tokens_per_s=n_out / result["wall_s"],
                  ms_per_token=1e3 * result["wall_s"] / a.new_tokens)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--api", choices=["engine", "server"], default="engine")
    p.add_argument("--zbccl", action="store_true", help="engine: ZBCCL_ENABLE=1; server: --enable-zbccl")
    p.add_argument("--model", default="llama", help="comma list of: " + ",".join(sorted(_ARCH)))
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--batch", default="4", help="comma list of batch sizes (one engine or server each)")
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--bench", action="store_true")
    p.add_argument("--mem-fraction", type=float, default=0.05,
                   help="SGLang's --mem-fraction-static (weights + KV cache; larger models need more)")
    p.add_argument("--model-dir", default=None, help="keep the written checkpoints here between runs")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--json", default=None, help="append one JSON line per run")
    a = p.parse_args()
    a.batch_max = max(int(b) for b in a.batch.split(","))
    for k, v in cpu_env(a.tp * a.pp).items():
        os.environ.setdefault(k, v)
    if a.zbccl and a.api == "engine":
        os.environ["ZBCCL_ENABLE"] = "1"
    for model in a.model.split(","):
        if model not in _ARCH:
            raise SystemExit(f"sglang_tp: unknown model, expected one of {sorted(_ARCH)}, got {model!r}")
        for batch in (int(b) for b in a.batch.split(",")):
            text = json.dumps(run_one(a, model, batch))
            if a.json:
                with open(a.json, "a") as f:
                    f.write(text + "\n")
            print("RESULT " + text, flush=True)


if __name__ == "__main__":
    main()
