"""A dry run of the GPU check's cases on the CPU ops (world 2), where no GPU is.

``bench/gpu_cases.py`` is what ``scripts/gpu_check.sh`` runs on each rank of a GPU world; its payloads,
plain-torch references and comparisons are the check's oracle. Run here over zbccl's CPU ops (known
correct, checked by tests/multiproc/test_ops.py), every eager case must pass: a wrong reference or a
case that misuses an op shows up here, not in the GPU machine's few minutes.
"""

from __future__ import annotations

from tests.spawn import run_world


def _rank(ctx):
    from zbccl.bench.gpu_cases import Rank, correctness
    from zbccl.bench.gpu_steps import decode_step

    rk = Rank(ctx.rank, ctx.world_size, ctx.store(), heap_bytes=16 << 20, timeout=30.0, device="cpu")
    try:
        res = correctness(rk, quick=True)
        # the eager half of the decode step (its capture needs CUDA: it fails there with that reason)
        res += [(n, ok, d) for n, ok, d in decode_step(rk, replays=2)]
        return res
    finally:
        rk.close()


def test_the_gpu_cases_pass_on_the_cpu_ops():
    from zbccl.bench.gpu import summarise_cases

    results = run_world(_rank, 2, timeout=240)
    cases = [c for c in results[0] if not c[0].startswith("graph/")]
    assert len(cases) > 150
    bad = [(r, c) for r, res in enumerate(results) for c in res if not c[1] and not c[0].startswith("graph/")]
    assert not bad, bad[:5]
    decode = [c for c in results[0] if c[0].startswith("graph/decode_step")]
    assert decode and "CUDA" in decode[0][2], decode  # the eager half and its reference passed: only the capture
    summary = summarise_cases(results)
    assert all(ok for key, (ok, _) in summary.items() if not key.startswith("graph/")), summary


def test_the_gpu_check_driver_runs_end_to_end_on_the_cpu_ops(capsys):
    """``python -m zbccl.bench.gpu --cpu-dry-run``: its worlds, guards, summary and exit status, here."""
    from zbccl.bench import gpu

    rc = gpu.main(["--cpu-dry-run", "--worlds", "2", "--replays", "2", "--heap", "32M", "--quick"])
    lines = capsys.readouterr().out.splitlines()
    checks = {ln.split()[1]: ln for ln in lines if ln.startswith("CHECK ")}
    graphs = {k: checks.pop(k) for k in list(checks) if k.startswith("w2/graph/")}
    # each graph case's eager half and reference passed; its capture needs CUDA (the reported failure)
    assert len(graphs) == 9 and all(" FAIL 0/1 " in ln and "CUDAGraph" in ln and "eager:" not in ln
                                    for ln in graphs.values()), graphs
    assert checks and all(ln.split()[2] == "PASS" for ln in checks.values()), lines
    assert {"env", "native", "w2/cases", "w2/all_reduce", "w2/all_to_all_v", "w2/scope", "w2/pg"} <= set(checks)
    assert rc == 1 and lines[-1].startswith(f"SUMMARY {len(checks)}/{len(checks) + 9} checks passed; failed: ")


def _late_rank(ctx):
    import time

    from zbccl.bench.gpu_steps import cases_rank

    # rank 1's clock says the budget is spent; rank 0's does not: they must still stop at the same case
    deadline = time.time() - 1 if ctx.rank == 1 else time.time() + 3600
    return cases_rank(rank=ctx.rank, world_size=ctx.world_size, store=ctx.store(), quick=True, replays=2,
                      heap_bytes=16 << 20, device="cpu", deadline=deadline)


def test_a_world_out_of_time_stops_every_rank_at_the_same_case():
    results = run_world(_late_rank, 2, timeout=120)
    assert [n for n, _, _ in results[0]] == [n for n, _, _ in results[1]]
    for res in results:
        assert res[0][1] and all(not ok and d == "skipped: the world's time budget is spent" for _, ok, d in res[1:])


def test_the_gpu_cases_rehearse_on_the_device_path_under_the_interpreter(capsys, monkeypatch):
    """``python -m zbccl.bench.gpu --interpret``: the GPU check's cases through the device route (``route.py``
    -> ``DeviceOps`` -> the Triton kernels under TRITON_INTERPRET=1 over the shm heap), graph cases eagerly."""
    import importlib.util

    import pytest

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (pip install zbccl[cuda])")
    from zbccl.bench import gpu

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # main sets it for its ranks; restored after the test
    rc = gpu.main(["--interpret", "--worlds", "2", "--replays", "2", "--heap", "32M", "--quick", "--budget", "400"])
    lines = capsys.readouterr().out.splitlines()
    checks = {ln.split()[1]: ln for ln in lines if ln.startswith("CHECK ")}
    assert rc == 0, [ln for ln in lines if " FAIL " in ln or ln.startswith("FIRST-ERROR")]
    assert {"w2/cases", "w2/reduce_scatter", "w2/graph/decode_step", "w2/interpret"} <= set(checks), lines
    assert [ln for ln in lines if ln.startswith("FIRST-ERROR")] == [
        f"FIRST-ERROR [rank {r}] none (212 cases)" for r in range(2)], lines


def _ep_rank(ctx):
    from zbccl.bench.gpu_cases import Rank
    from zbccl.bench.gpu_ep import ep_cases

    rk = Rank(ctx.rank, ctx.world_size, ctx.store(), heap_bytes=16 << 20, timeout=30.0, device="cpu")
    try:
        return ep_cases(rk)
    finally:
        rk.close()


def test_the_gpu_ep_cases_pass_on_the_cpu_path():
    """The GPU check's EP cases (``bench/gpu_ep.py``) on CPU tensors, which take the CPU EP path: the cases'
    own inputs, calls and comparisons are right before a GPU runs them on the device path."""
    results = run_world(_ep_rank, 2, timeout=240)
    assert len(results[0]) == 11
    bad = [(r, c) for r, res in enumerate(results) for c in res if not c[1]]
    assert not bad, bad[:3]
