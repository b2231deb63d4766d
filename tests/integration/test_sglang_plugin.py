"""SGLang (CPU) end to end: ``--enable-zbccl`` gives the same tokens as SGLang's own path.

Runs ``examples/sglang_tp.py`` under ``.venv-sglang/bin/python`` (``make sglang-e2e``; the test is
skipped without it, the reason printed by ``-ra``) for each API, once as SGLang ships and once with
zbccl: ``sgl.Engine`` (``ZBCCL_ENABLE=1``) and ``python -m sglang.launch_server`` + HTTP
``/generate`` on 127.0.0.1 at an OS-picked port (``--enable-zbccl``). Each run serves a tiny Llama
(dense) and a tiny Mixtral (MoE, 4 experts, top-2, ``ep_size`` 1: TP MoE) built from their configs
with seeded random weights (nothing downloaded, no tokenizer: a batch of 4 prompts of 5, 12, 19
and 26 token ids), TP=2, torch_native attention, bf16, 8 greedy tokens.

A third pair serves the Llama at TP 1, PP 2 (the stages' tensor dicts and objects on zbccl), and
``test_engine_ep2_moe_runs_on_the_zbccl_dispatcher`` the Mixtral at TP 2, ep_size 2.

Checks: identical token ids and identical chosen-token logprobs (two-rank sums are the same in
either order, so bitwise); with zbccl, both TP workers (two processes, ranks 0 and 1) report zbccl
running, the heap segments mapped in their own address space (and, for the server, seen in
/proc/<pid>/maps from here while it runs), all_reduce and all_gather calls counted on ``tp:0``
during the generation and no byte staged (the forward runs in ``heap_scope``); without it, the
plugin reports nothing (SGLang untouched); the server exits on SIGTERM with no process of it
left; no process of the run is left (run tag), and the autouse leak check: none still maps a
zbccl segment.
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

pytestmark = pytest.mark.sglang

RUN_TAG = "ZBT_SGLANG_RUN"
MODELS = ("llama", "moe")


def venv_python() -> Path | None:
    """``.venv-sglang/bin/python`` of this checkout or of its main worktree (:func:`.engines.engine_python`)."""
    return engine_python(".venv-sglang")


def _tagged(tag: str) -> list[int]:
    return tagged_pids(RUN_TAG, tag)


def run_example(py: Path, args: list[str], *, timeout: float = 900) -> list[dict]:
    """``examples/sglang_tp.py args`` under ``py``; its RESULT lines, after every process of it exited."""
    tag = uuid.uuid4().hex
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    env[RUN_TAG] = tag
    env.pop("ZBCCL_ENABLE", None)
    proc = subprocess.run([str(py), str(ROOT / "examples" / "sglang_tp.py")] + args, env=env, capture_output=True,
                          text=True, timeout=timeout)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"SGLang run {args} failed:\n{tail}"
    deadline = time.monotonic() + 20
    while _tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.2)  # polling for exits, not synchronisation
    assert not _tagged(tag), f"processes of the SGLang run still alive: {_tagged(tag)}"
    return [json.loads(ln[len("RESULT "):]) for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]


def _calls(report: list[dict], op: str) -> list[int]:
    return [w["groups"]["tp:0"]["calls"][op] for w in report]


def check_zbccl_run(r: dict) -> None:
    """Both TP workers ran this generation on zbccl, zero-buffer."""
    before, after = r["before"], r["after"]
    assert [w["rank"] for w in after] == [0, 1] and len({w["pid"] for w in after}) == 2, after
    for w0, w1 in zip(before, after):
        assert w1["zbccl"] and w1["fallback"] is None, w1
        assert list(w1["groups"]) == ["tp:0"] and w1["groups"]["tp:0"]["ranks"] == [0, 1], w1["groups"]
        assert len(w1["mapped"]) == 2 and all(s.startswith("memfd:zbccl-") for s in w1["mapped"]), w1["mapped"]
        staged = w1["memory"]["staged_bytes"] - w0["memory"]["staged_bytes"]
        assert staged == 0, f"{r['model']}: rank {w1['rank']} staged {staged} B while generating"
    for op in ("all_reduce", "all_gather"):  # row-parallel linears, vocab-parallel logits
        grew = [b - a for a, b in zip(_calls(before, op), _calls(after, op))]
        assert grew[0] == grew[1] > 0, (op, grew)


def compare(own: list[dict], ours: list[dict]) -> None:
    by_model = {r["model"]: r for r in own}
    assert [r["model"] for r in ours] == list(MODELS) == list(by_model)
    for b in ours:
        a = by_model[b["model"]]
        assert [len(t) for t in a["tokens"]] == [8] * 4
        assert b["tokens"] == a["tokens"], f"{b['model']}: tokens differ\nSGLang: {a['tokens']}\nzbccl:  {b['tokens']}"
        assert b["logprobs"] == a["logprobs"], f"{b['model']}: logprobs differ"
        assert a["after"] == [], "without the switch the plugin must not touch SGLang"
        check_zbccl_run(b)


def _needs_venv() -> Path:
    py = venv_python()
    if py is None:
        pytest.skip("needs .venv-sglang (sglang 0.5.23 on CPU torch): run `make sglang-e2e`")
    probe = ("from importlib.metadata import entry_points as e; "
             "print(any(p.value == 'zbccl.integrations.sglang:register' for p in e(group='sglang.srt.plugins')))")
    seen = subprocess.run([str(py), "-c", probe], env=dict(os.environ, PYTHONPATH=str(ROOT / "src")),
                          capture_output=True, text=True, timeout=120).stdout.strip()
    assert seen == "True", (f"{py}: SGLang would not load the zbccl plugin (no sglang.srt.plugins entry point "
                            f"for zbccl.integrations.sglang:register): run `make sglang-e2e` to install this zbccl")
    return py


def test_engine_tp2_tokens_identical_with_zbccl():
    py = _needs_venv()
    common = ["--api", "engine", "--model", ",".join(MODELS), "--batch", "4", "--new-tokens", "8"]
    compare(run_example(py, common), run_example(py, common + ["--zbccl"]))


def test_server_tp2_tokens_identical_with_enable_zbccl():
    py = _needs_venv()
    common = ["--api", "server", "--model", ",".join(MODELS), "--batch", "4", "--new-tokens", "8"]
    own, ours = run_example(py, common), run_example(py, common + ["--zbccl"])
    compare(own, ours)
    for r in own + ours:
        assert r["left_after_stop"] == [] and not r.get("killed"), r.get("left_after_stop")
    for r in ours:  # seen from outside while the server ran: the workers were among its processes
        assert {w["pid"] for w in r["after"]} <= set(r["server_pids"]), (r["after"], r["server_pids"])
        assert all(len(segs) == 2 for segs in r["maps_seen"].values()) and len(r["maps_seen"]) == 2, r["maps_seen"]


def test_engine_ep2_moe_runs_on_the_zbccl_dispatcher():
    """Expert parallelism at TP=2, ep_size 2: SGLang's CPU path fails here (``RuntimeError: index -1 is out
    of bounds for dimension 1 with size 4`` in fused_moe_native.py, docs/sglang.md); with zbccl the MoE
    layers dispatch and combine through zbccl.ep and give the TP-MoE run's tokens."""
    py = _needs_venv()
    common = ["--api", "engine", "--model", "moe", "--batch", "4", "--new-tokens", "8", "--zbccl"]
    tp, ep = run_example(py, common)[0], run_example(py, common + ["--ep", "2"])[0]
    assert ep["tokens"] == tp["tokens"], f"EP tokens differ from TP MoE:\nTP: {tp['tokens']}\nEP: {ep['tokens']}"
    check_zbccl_run(ep)
    for w0, w1 in zip(ep["before"], ep["after"]):
        assert w1["ep"]["dispatch"] - w0["ep"]["dispatch"] == w1["ep"]["combine"] - w0["ep"]["combine"] > 0, w1["ep"]
    assert all(w["ep"]["dispatch"] == 0 for w in tp["after"])  # ep_size 1: SGLang's own dispatcher, TP all_reduce


def test_engine_pp2_tokens_identical_with_zbccl():
    """Pipeline parallelism (TP 1, PP 2): the stages' send/recv of objects and tensor dicts run on zbccl's
    heap-to-heap mailboxes, and the tokens and logprobs equal SGLang's own (gloo) run."""
    py = _needs_venv()
    common = ["--api", "engine", "--tp", "1", "--pp", "2", "--model", "llama", "--batch", "4", "--new-tokens", "8"]
    own, ours = run_example(py, common)[0], run_example(py, common + ["--zbccl"])[0]
    assert ours["tokens"] == own["tokens"] and ours["logprobs"] == own["logprobs"], (own["tokens"], ours["tokens"])
    assert own["after"] == []
    (w0,), (w1,) = ours["before"], ours["after"]  # the first stage's report (its TP group is itself)
    assert w1["zbccl"] and list(w1["groups"]) == ["pp:0"] and len(w1["mapped"]) == 2, w1
    calls0, calls1 = w0["groups"]["pp:0"]["calls"], w1["groups"]["pp:0"]["calls"]
    for op in ("send_tensor_dict", "recv_tensor_dict", "send_object", "recv_object"):
        assert calls1[op] > calls0[op], (op, calls0, calls1)


_CHILD = r"""
import os, warnings
os.environ["ZBCCL_ENABLE"] = "1"
from sglang.srt.plugins.hook_registry import HookRegistry
import zbccl.integrations.sglang as plugin
real = plugin.installed_version
plugin.installed_version = lambda: "0.5.22"
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    plugin.register(); plugin.register()
refused = [str(x.message) for x in w if issubclass(x.category, RuntimeWarning)]
assert len(refused) == 1 and "expected 0.5.23, got 0.5.22" in refused[0], refused
assert not any("GroupCoordinator" in t for t in HookRegistry._hooks), list(HookRegistry._hooks)
HookRegistry.reset(); plugin._state.update(registered=False, warned=False)
plugin.installed_version = real
assert real() == "0.5.23", real()
plugin.register()
HookRegistry.apply_hooks()  # the real targets resolve in the pinned SGLang
from sglang.srt.distributed.parallel_state import GroupCoordinator
from sglang.srt.server_args import ServerArgs
import argparse
assert GroupCoordinator.all_reduce.__wrapped__.__name__ == "all_reduce"
p = argparse.ArgumentParser(); ServerArgs.add_cli_args(p)
assert p.parse_args(["--model-path", "m", "--enable-zbccl"]).enable_zbccl is True
print("OK")
"""


def test_version_pin_and_hooks_under_sglang():
    py = _needs_venv()
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin", "SGLANG_USE_CPU_ENGINE": "1"}
    proc = subprocess.run([str(py), "-c", _CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), (proc.stdout + proc.stderr)[-4000:]
