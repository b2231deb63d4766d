"""vLLM (CPU) end to end: the zbccl plugin gives the same tokens as vLLM's own communicator.

Runs ``examples/vllm_tp.py`` under ``.venv-vllm/bin/python`` (``make vllm-e2e``; the test is
skipped without it) twice: once as vLLM ships (``ZBCCL_VLLM`` unset) and once with
``ZBCCL_VLLM=1``. Each run serves a tiny Llama (dense), a tiny Mixtral (MoE, 4 experts, top-2), a
tiny Qwen2 (attention biases, the LM head tied to the embedding) and a tiny Qwen3-MoE (another MoE
block, q/k norms), seeded random weights written from their configs (nothing downloaded, no tokenizer: prompts are
token ids of lengths 5, 12, 19 and 26), TP=2, the "mp" executor, eager, bf16, 8 greedy tokens.

Checks: identical token ids and identical chosen-token logprobs (two-rank sums are the same in
either order, so bitwise); every TP group ran on zbccl with the variable and on vLLM's own
``CpuCommunicator`` without it; ``staged_bytes`` did not grow during generation (the forward runs
in ``heap_scope``); the zbccl run added nothing to /dev/shm and vLLM's shm segments were never
made; every process of the run exited (and the autouse leak check: none still maps a segment).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tests.integration.engines import ROOT, engine_python, tagged_pids

pytestmark = pytest.mark.vllm

RUN_TAG = "ZBT_VLLM_RUN"
MODELS = ("llama", "moe", "qwen2", "qwen3moe")


def _venv_python() -> Path | None:
    """``.venv-vllm/bin/python`` of this checkout or of its main worktree (:func:`.engines.engine_python`)."""
    return engine_python(".venv-vllm")


def _plugin_path(py: Path, tmp: Path) -> str:
    """A PYTHONPATH entry declaring the plugin's entry point when the venv's zbccl does not (dev checkouts)."""
    from zbccl.integrations.vllm import plugin_pythonpath

    return os.pathsep.join(plugin_pythonpath(str(py), [str(ROOT / "src")], str(tmp / "site"))[1:])


def _tagged(tag: str) -> list[int]:
    return tagged_pids(RUN_TAG, tag)


def _serve(py: Path, extra_path: str, *, zbccl: bool) -> dict[str, dict]:
    tag = uuid.uuid4().hex
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT / "src"), extra_path) if p))
    env[RUN_TAG] = tag
    env.pop("ZBCCL_VLLM", None)
    if zbccl:
        env["ZBCCL_VLLM"] = "1"
    cmd = [str(py), str(ROOT / "examples" / "vllm_tp.py"), "--model", ",".join(MODELS), "--batch", "4",
           "--new-tokens", "8"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"vLLM run (ZBCCL_VLLM={int(zbccl)}) failed:\n{tail}"
    deadline = time.monotonic() + 15
    while _tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.2)  # polling for exits, not synchronisation
    assert not _tagged(tag), f"processes of the vLLM run still alive: {_tagged(tag)}"
    results = [json.loads(ln[len("RESULT "):]) for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    return {r["model"]: r for r in results}


def test_vllm_tp2_tokens_identical_with_zbccl(tmp_path):
    py = _venv_python()
    if py is None:
        pytest.skip("needs .venv-vllm (make vllm-e2e)")
    extra = _plugin_path(py, tmp_path)
    own = _serve(py, extra, zbccl=False)
    ours = _serve(py, extra, zbccl=True)
    assert set(own) == set(ours) == set(MODELS)
    for model in MODELS:
        a, b = own[model], ours[model]
        assert [len(t) for t in a["tokens"]] == [8] * 4
        assert b["tokens"] == a["tokens"], f"{model}: tokens differ\nvLLM:  {a['tokens']}\nzbccl: {b['tokens']}"
        assert b["logprobs"] == a["logprobs"], f"{model}: logprobs differ"
        for w in a["workers"]:
            assert w["groups"] == {"tp:0": "CpuCommunicator"}, w["groups"]
        for w in b["workers"]:
            assert w["groups"] == {"tp:0": "ZbcclCpuCommunicator[zbccl]"}, w["groups"]
            assert w["staged_bytes_timed"] == 0, f"{model}: staged {w['staged_bytes_timed']} B while generating"
            calls = sum(c for c, _ in w["times"].values())
            assert w["native"]["tp:0"][0] == calls, (w["native"], w["times"])  # one native op per collective
            assert w["dev_shm_cpushm_bytes"] == 0 or not any("cpushm" in n for n in b["dev_shm_added"])
        assert not [n for n in b["dev_shm_added"] if "zbccl" in n or "cpushm" in n], b["dev_shm_added"]
