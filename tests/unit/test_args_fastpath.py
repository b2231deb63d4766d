"""The all_gather fast check gives the general checks' verdict wherever it answers."""

from __future__ import annotations

import pytest
import torch

from zbccl.ops.args import check_exchange, even_gather_code, tensor_error


def _general(output, input, world: int, rank: int):
    """``(dtype code, error)`` as all_gather_into_tensor's general path computes it."""
    error = tensor_error(output, "output", op="all_gather", written=True) or tensor_error(
        input, "input", op="all_gather")
    if error:
        return 0, error
    return check_exchange("all_gather", output, input, [input.numel()] * world, None, world, rank)


def _cases():
    base = torch.zeros(64, dtype=torch.float32)
    n = 16
    yield "separate", torch.zeros(4 * n), torch.zeros(n), 4, 1
    yield "in place, own slice", base, base[2 * n:3 * n], 4, 2
    yield "in place, wrong slice", base, base[n:2 * n], 4, 2
    buf = torch.zeros(4 * n + 1)
    yield "shifted by one", buf[: 4 * n], buf[1:n + 1], 4, 0  # overlaps, yet not its own slice
    yield "dtype differs", torch.zeros(4 * n), torch.zeros(n, dtype=torch.float64), 4, 0
    yield "wrong output size", torch.zeros(4 * n + 1), torch.zeros(n), 4, 0
    yield "non-contiguous input", torch.zeros(4 * n), torch.zeros(2 * n)[::2], 4, 0
    yield "expanded output", torch.zeros(1).expand(4 * n), torch.zeros(n), 4, 0
    yield "empty", torch.zeros(0), torch.zeros(0), 4, 0
    yield "unsupported dtype", torch.zeros(4 * n, dtype=torch.complex64), torch.zeros(n, dtype=torch.complex64), 4, 0
    yield "meta", torch.zeros(4 * n, device="meta"), torch.zeros(n, device="meta"), 4, 0
    yield "a list", [0.0] * (4 * n), torch.zeros(n), 4, 0
    yield "parameter", torch.nn.Parameter(torch.zeros(4 * n)), torch.zeros(n), 4, 0


@pytest.mark.parametrize("name,output,input,world,rank", list(_cases()), ids=[c[0] for c in _cases()])
def test_fast_check_agrees_with_the_general_checks(name, output, input, world, rank):
    fast = even_gather_code(output, input, world, rank)
    dt, error = _general(output, input, world, rank)
    if fast is not None:
        assert error is None and fast == dt, (name, error)
    expected_fast = name in ("separate", "in place, own slice")
    assert (fast is not None) == expected_fast, name
