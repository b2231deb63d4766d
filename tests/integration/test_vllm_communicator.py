"""``ZbcclCpuCommunicator``'s ops against plain-torch references, two ranks, no engine.

Two processes under ``.venv-vllm/bin/python`` (skipped without it) make a gloo world (a file store
under pytest's tmp dir) and build the communicator the way vLLM's ``GroupCoordinator`` does, for a
``pp`` group. Payloads are f(rank, index), so a misplaced row is caught. Covers what a vLLM CPU
engine run does not reach in the e2e test: all_gatherv, reduce_scatter(v), gather, broadcast,
send/recv and send/recv_tensor_dict (pipeline parallelism).
"""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.integration.test_vllm_plugin import ROOT, _venv_python

pytestmark = pytest.mark.vllm

_CHILD = r"""
import sys, torch, torch.distributed as dist
rank, path = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
from zbccl.integrations.vllm.communicator import ZbcclCpuCommunicator
g = dist.new_group([0, 1], backend="gloo")
c = ZbcclCpuCommunicator(g, torch.device("cpu"), g, "pp:0")
assert c.zb is not None, "zbccl did not start"
def f(r, shape, dtype=torch.float32):
    n = 1
    for s in shape: n *= s
    return (torch.arange(n, dtype=torch.float32) * 10 + r).reshape(shape).to(dtype)
other = 1 - rank
x = f(rank, (3, 4)); assert torch.equal(c.all_reduce(x.clone()), f(0, (3, 4)) + f(1, (3, 4)))
x = f(rank, (2, 3), torch.bfloat16)
assert torch.equal(c.all_gather(x, -1), torch.cat([f(0, (2, 3), torch.bfloat16), f(1, (2, 3), torch.bfloat16)], -1))
sizes = [2, 3]
x = f(rank, (sizes[rank], 5))
assert torch.equal(c.all_gatherv(x, 0, sizes), torch.cat([f(0, (2, 5)), f(1, (3, 5))]))
outs = c.all_gatherv([x, x * 2], 0, sizes)
assert torch.equal(outs[1], torch.cat([f(0, (2, 5)), f(1, (3, 5))]) * 2)
x = f(rank, (2, sizes[rank], 3), torch.bfloat16)  # along an inner dimension: rows into their columns
assert torch.equal(c.all_gatherv(x, 1, sizes), torch.cat([f(0, (2, 2, 3), torch.bfloat16), f(1, (2, 3, 3), torch.bfloat16)], 1))
assert torch.equal(c.all_gatherv(x, -2, sizes), torch.cat([f(0, (2, 2, 3), torch.bfloat16), f(1, (2, 3, 3), torch.bfloat16)], 1))
x = f(rank, (4, 6)); full = f(0, (4, 6)) + f(1, (4, 6))
assert torch.equal(c.reduce_scatter(x, 0), full.chunk(2, 0)[rank])
assert torch.equal(c.reduce_scatter(x, -1), full.chunk(2, -1)[rank])
assert torch.equal(c.reduce_scatterv(x, 0, [1, 3]), full.split([1, 3])[rank])
assert torch.equal(c.reduce_scatterv(x, -1, [2, 4]), full.split([2, 4], -1)[rank])
got = c.gather(f(rank, (2, 2)), dst=1, dim=0)
assert (got is None) if rank == 0 else torch.equal(got, torch.cat([f(0, (2, 2)), f(1, (2, 2))]))
b = f(rank, (7,)); c.broadcast(b, src=1); assert torch.equal(b, f(1, (7,)))
if rank == 0:
    c.send(f(0, (3, 3)), 1)
    c.send_tensor_dict({"h": f(0, (2, 8), torch.bfloat16), "e": torch.empty(0, 4), "step": 5}, 1)
    d = c.recv_tensor_dict(1)
    assert torch.equal(d["r"], f(1, (4,), torch.int64)) and d["tag"] == "x", d
else:
    assert torch.equal(c.recv(torch.Size([3, 3]), torch.float32, 0), f(0, (3, 3)))
    d = c.recv_tensor_dict(0)
    assert torch.equal(d["h"], f(0, (2, 8), torch.bfloat16)) and d["e"].shape == (0, 4) and d["step"] == 5, d
    c.send_tensor_dict({"r": f(1, (4,), torch.int64), "tag": "x"}, 0)
dist.barrier()  # a staged send completes at once; its data stays in the sender's heap until taken
c.destroy()
import zbccl; assert zbccl.memory_stats()["staged_bytes"] > 0  # private operands were staged
zbccl.finalize(); dist.destroy_process_group()
print("OK", rank)
"""


def _run_two(child: str, store, extra_env: dict[int, dict[str, str]] | None = None) -> list[str]:
    """Run ``child`` as ranks 0 and 1 under ``.venv-vllm`` (skip without it); each must print ``OK <rank>``."""
    py = _venv_python()
    if py is None:
        pytest.skip("needs .venv-vllm (make vllm-e2e)")
    procs = []
    for r in range(2):
        env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), **(extra_env or {}).get(r, {}))
        env.pop("ZBCCL_VLLM", None)
        procs.append(subprocess.Popen([str(py), "-c", child, str(r), str(store)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"OK {r}" in out, f"rank {r} (rc {p.returncode}):\n{out[-4000:]}"
    return outs


def test_communicator_ops_match_references(tmp_path):
    _run_two(_CHILD, tmp_path / "store")


_FALLBACK_CHILD = r"""
import sys, warnings, torch, torch.distributed as dist
rank, path = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
from zbccl.integrations.vllm.communicator import ZbcclCpuCommunicator
g = dist.new_group([0, 1], backend="gloo")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    c = ZbcclCpuCommunicator(g, torch.device("cpu"), g, "tp:0")
    c2 = ZbcclCpuCommunicator(g, torch.device("cpu"), g, "pp:0")
ours = [str(w.message) for w in caught if "zbccl" in str(w.message)]
assert c.zb is None and c2.zb is None, "zbccl started although a rank could not"
assert len(ours) == 1 and "falls back to vLLM's own CPU communicator" in ours[0], ours
x = (torch.arange(12, dtype=torch.float32) * 10 + rank).reshape(3, 4)
ref = (torch.arange(12, dtype=torch.float32) * 20 + 1).reshape(3, 4)
assert torch.equal(c.all_reduce(x.clone()), ref)
import zbccl.runtime.registry as reg
assert reg.get_default() is None  # nothing of zbccl is left running
dist.barrier(); dist.destroy_process_group()
print("OK", rank, ours[0])
"""


def test_a_rank_that_cannot_start_zbccl_sends_every_rank_back_to_vllm(tmp_path):
    """One rank's heap cannot be created: both ranks run vLLM's own communicator, one warning each."""
    # more shared memory than any host has: init fails on every rank
    _run_two(_FALLBACK_CHILD, tmp_path / "store", {1: {"ZBCCL_HEAP_SIZE": "64T"}})
