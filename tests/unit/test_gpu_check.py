"""The GPU check's host-side parts that run without a GPU: the no-CUDA skip, the summary, the table."""

from __future__ import annotations

import pytest
import torch

from zbccl.bench import gpu
from zbccl.bench.gpu_cases import MOVE_DTYPES, REDUCE_DTYPES, payload


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_it_says_so_and_exits_3(capsys):
    assert gpu.main(["--quick"]) == gpu.NO_CUDA
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("CHECK cuda SKIP no CUDA: torch.cuda.is_available() is False")


def test_the_summary_names_each_failing_case_and_its_rank():
    ranks = [[("all_reduce/sum/float32/n=1", True, ""), ("all_reduce/sum/float32/n=3", True, ""),
              ("graph/all_gather/bfloat16/n=1001", True, "")],
             [("all_reduce/sum/float32/n=1", True, ""), ("all_reduce/sum/float32/n=3", False, "2 wrong elements\nx"),
              ("graph/all_gather/bfloat16/n=1001", True, "")]]
    got = gpu.summarise_cases(ranks)
    assert got["all_reduce"] == (False, "1/2 cases bit-exact; [rank 1] all_reduce/sum/float32/n=3: 2 wrong elements")
    assert got["graph/all_gather"] == (True, "1/1 cases bit-exact")


def test_the_table_takes_the_slowest_rank_and_the_nccl_tests_factors():
    def rank(zb_us, symm_us, wrong=0):
        return {"rows": [{"op": "all_reduce", "bytes": 64 << 20, "memcpy_us": 100.0,
                          "us": {"zbccl": zb_us, "symm_1shot": symm_us, "zb_graph": 10.0, "symm_graph": 15.0},
                          "host_us": {"zbccl": zb_us / 100, "symm_1shot": symm_us / 100},
                          "wrong": {"zbccl": wrong}}], "errors": []}

    lines = gpu.format_table(2, [rank(1000.0, 1500.0), rank(2000.0, 1000.0, wrong=3)])
    assert lines[0].startswith("| W | op | size | zbccl us | busbw GB/s")
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    # slowest rank: 2000 us; busbw = 64 MiB * 2(W-1)/W / 2000 us; memcpy 64 MiB / 100 us
    busbw = (64 << 20) * 1.0 / 2000 / 1e3
    memcpy = (64 << 20) / 100 / 1e3
    assert cells[:5] == ["2", "all_reduce", "64 MiB", "2000.0", f"{busbw:.1f}"]
    assert cells[7] == "1500.0" and cells[9:12] == ["-", "10.0", "15.0"]
    assert cells[12] == f"{memcpy:.1f}" and cells[13] == f"{busbw / memcpy:.2f}"
    assert cells[14:] == ["0.75", "1.50", "20.0 / - / 15.0", "-", "-", "-", "3"]  # host us: the slowest rank's


def test_payloads_encode_their_source_and_sum_exactly_in_every_dtype():
    for dt in REDUCE_DTYPES:
        parts = [payload(q, (97,), dt) for q in range(4)]
        assert not torch.equal(parts[0], parts[1])  # the value says which rank it came from
        exact = sum(p.to(torch.float64) for p in parts)
        assert torch.equal(exact.to(dt).to(torch.float64), exact), dt
    assert set(REDUCE_DTYPES) < set(MOVE_DTYPES)


def test_all_gather_rows_count_the_output_as_nccl_tests_do():
    rows = {"rows": [{"op": "all_gather", "bytes": 1 << 20, "memcpy_us": 10.0, "us": {"zbccl": 100.0},
                      "wrong": {"zbccl": 0}}], "errors": []}
    cells = [c.strip() for c in gpu.format_table(4, [rows])[2].strip("|").split("|")]
    assert cells[4] == f"{4 * (1 << 20) * 0.75 / 100 / 1e3:.1f}"  # S = W * size, factor (W-1)/W
    assert cells[5:12] == ["-"] * 7 and cells[14:16] == ["-", "-"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_zbccl_bench_gpu_is_the_same_check(capsys):
    from zbccl.cli import main

    assert main(["bench-gpu", "--quick"]) == gpu.NO_CUDA
    assert capsys.readouterr().out.startswith("CHECK cuda SKIP no CUDA")
