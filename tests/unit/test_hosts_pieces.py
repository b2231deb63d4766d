"""Pure pieces of the collectives across hosts (``ops/hosts``): the one-pass reductions, the strict parsing of
the setup records, the tuner's inter-host choices."""

from __future__ import annotations

import json

import pytest
import torch

from zbccl.errors import ZbcclRemoteError
from zbccl.ops.dtypes import AVG, MAX, MIN, PROD, SUM
from zbccl.ops.hosts.flat import copy, reduce_into
from zbccl.ops.hosts.state import HostOps
from zbccl.ops.reference import reduce_ref
from zbccl.ops.tuner import (
    EP_HOSTS_EAGER,
    HOSTS_CHUNK,
    ep_hosts_eager,
    hosts_chunk,
    hosts_hierarchical,
    hosts_settings,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8,
                                   torch.bfloat16, torch.float16, torch.bool])
@pytest.mark.parametrize("red", [SUM, PROD, MAX, MIN, AVG])
@pytest.mark.parametrize("alias", [None, 0, 1, 2])
@pytest.mark.parametrize("n", [257, 40_003])  # (the native kernel's vector loop and its tail)
def test_reduce_into_is_bit_equal_to_the_reference(dtype, red, alias, n):
    if red == AVG and not dtype.is_floating_point:
        return
    g = torch.Generator().manual_seed(7)
    parts = [(torch.randn(n, generator=g) * 50).to(dtype) for _ in range(3)]
    if dtype.is_floating_point:
        parts[1][3] = float("nan")  # NaN propagates as in the reference
    want = reduce_ref([p.clone() for p in parts], red)
    dst = torch.empty_like(parts[0]) if alias is None else parts[alias]  # in place: this rank's own part
    reduce_into(dst, parts, red)
    assert torch.equal(dst.view(torch.uint8), want.view(torch.uint8)) or (
        dtype.is_floating_point and torch.equal(dst.isnan(), want.isnan())
        and torch.equal(dst[~dst.isnan()], want[~want.isnan()]))


@pytest.mark.parametrize("n", [2, 4, 6])
def test_native_fp32_sums_add_in_member_order(n):
    """fp32 sums go through the native kernel: (((p0 + p1) + p2) + ...) as the reference, for any member count,
    at magnitudes where another order would round differently."""
    g = torch.Generator().manual_seed(n)
    for count in (1, 15, 16, 17, 1000, 4099):
        parts = [torch.randn(count, generator=g) * 10.0 ** (3 * (k % 3) - 3) for k in range(n)]
        dst = torch.empty(count)
        reduce_into(dst, parts, SUM)
        assert torch.equal(dst.view(torch.int32), reduce_ref(parts, SUM).view(torch.int32)), count


def test_copy_skips_the_same_memory_and_copies_otherwise():
    a = torch.arange(10, dtype=torch.uint8)
    copy(a, a)
    b = torch.zeros(10, dtype=torch.uint8)
    copy(b, a)
    assert torch.equal(a, b)
    src = torch.arange(24, dtype=torch.float32).view(4, 6)
    for dst, s in ((torch.zeros(4, 6), src), (torch.zeros(6, 4).t(), src), (torch.zeros(6, 4), src.t()),
                   (torch.zeros(0), torch.zeros(0))):
        copy(dst, s)  # contiguous: one native copy; strided on either side: torch's
        assert torch.equal(dst, s)


_TUNE = hosts_settings()


@pytest.mark.parametrize("raw", [b"", b"not json", b"[]", json.dumps({"chunk": 4096}).encode(),
                                 json.dumps({"chunk": 100, "world": [0, 1], "column": [-1, 0], "tune": _TUNE}).encode(),
                                 json.dumps({"chunk": 4096, "world": [0, "1"], "column": [-1, 0],
                                             "tune": _TUNE}).encode(),
                                 json.dumps({"chunk": 4096, "world": [0, 1], "column": [-1, 0], "tune": _TUNE,
                                             "x": 1}).encode(),
                                 json.dumps({"chunk": 4096, "world": [0, 1], "column": [-1, 0]}).encode(),
                                 json.dumps({"chunk": 4096, "world": [0, 1], "column": [-1, 0],
                                             "tune": {**_TUNE, "relay": 1}}).encode(),
                                 json.dumps({"chunk": 4096, "world": [0, 1], "column": [-1, 0],
                                             "tune": {"relay": True}}).encode(),
                                 json.dumps({"error": 3}).encode()])
def test_setup_records_are_parsed_strictly(raw):
    with pytest.raises(ZbcclRemoteError, match="rank 2's inter-host setup record is malformed"):
        HostOps._parse(None, 2, raw)


def test_setup_record_accepted():
    rec = {"chunk": 8192, "world": [4096, 100000], "column": [-1, 0], "tune": _TUNE}
    assert HostOps._parse(None, 0, json.dumps(rec).encode()) == rec
    assert HostOps._parse(None, 0, b'{"error": "no room"}') == {"error": "no room"}


def test_tuner_inter_host_choices():
    assert hosts_chunk(1 << 30, 8) == HOSTS_CHUNK
    assert hosts_chunk(1 << 20, 12) == 20480  # a quarter of the heap over 12 slots, in 4 KiB units
    assert hosts_chunk(1 << 16, 100) == 4096  # never below a page
    assert hosts_hierarchical("all_reduce", 1 << 20, 2, 2, True)
    assert not hosts_hierarchical("all_reduce", 1 << 20, 2, 2, False)  # irregular: flat
    assert not hosts_hierarchical("all_reduce", 4096, 2, 2, True)  # small: one flat step
    assert not hosts_hierarchical("reduce_scatter", 1 << 20, 2, 2, True)
    assert not hosts_hierarchical("all_gather", 1 << 20, 2, 2, True)  # three rounds: flat wins below 2 MiB
    assert hosts_hierarchical("all_gather", 4 << 20, 2, 2, True)
    assert hosts_chunk(1 << 30, 8, 1 << 20) == 1 << 20  # the tuned chunk caps the proposal
    assert hosts_hierarchical("all_gather", 4096, 2, 2, True, {"all_gather": 0})  # tuned thresholds
    assert not hosts_hierarchical("all_reduce", 1 << 30, 2, 2, True, {"all_reduce": None})


def test_tuner_ep_eager_limit():
    assert ep_hosts_eager(1 << 30, 2) == EP_HOSTS_EAGER
    assert ep_hosts_eager(64 << 20, 4) == 1 << 20  # an eighth of the heap over 2 * 4 slots
    assert ep_hosts_eager(1 << 30, 4, budget=8 << 20) == 1 << 20  # within num_rdma_bytes when given
    assert ep_hosts_eager(1 << 30, 4, budget=1 << 40) == EP_HOSTS_EAGER
    assert ep_hosts_eager(1 << 20, 64) == 4096  # never below a page
