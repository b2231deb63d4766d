"""The native core: atomics, signal/wait (threads; two processes in tests/multiproc), raw copies.

Nothing here is timed: waits are checked for their results and for returning
the right index when their budget runs out.
"""

from __future__ import annotations

import ctypes
import mmap
import threading

import pytest
import torch

from zbccl import native

FLAG = 64  # bytes per flag (one cache line): int64 value, int32 waiters


@pytest.fixture(scope="module")
def core():
    return native.core()


class Flags:
    """``n`` flags in an anonymous shared mapping, plus a uint64 address array for wait_ge."""

    def __init__(self, n: int, mm: mmap.mmap | None = None) -> None:
        self.mm = mm if mm is not None else mmap.mmap(-1, max(4096, n * FLAG))
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))
        self.addrs = (ctypes.c_uint64 * n)(*(self.base + i * FLAG for i in range(n)))
        self.n = n

    def __getitem__(self, i: int) -> int:
        return self.base + i * FLAG

    @property
    def array(self) -> int:
        return ctypes.addressof(self.addrs)

    def waiters(self, i: int) -> int:
        return ctypes.c_int32.from_address(self[i] + 8).value


def test_module_identity(core) -> None:
    assert core.__name__ == "zbccl._native_core" and native.core() is core
    assert core.FLAG_BYTES == FLAG and core.WAITERS_OFFSET == 8


def test_atomics(core) -> None:
    f = Flags(2)
    assert core.load_acquire(f[0]) == 0
    core.store_release(f[0], -5)
    assert core.load_acquire(f[0]) == -5
    assert core.fetch_add(f[0], 7) == -5 and core.load_acquire(f[0]) == 2
    assert core.fetch_add_signal(f[0], 1) == 2
    core.signal(f[1], (1 << 62) + 3)
    assert core.load_acquire(f[1]) == (1 << 62) + 3
    assert ctypes.c_int64.from_address(f[1]).value == (1 << 62) + 3  # plain int64 layout


def test_wait_ge_results_and_timeout_index(core) -> None:
    f = Flags(4)
    for i in range(4):
        core.store_release(f[i], 5)
    assert core.wait_ge(f.array, 4, 5, 100, 0) == -1
    core.store_release(f[2], 4)
    assert core.wait_ge(f.array, 4, 5, 0, 0) == 2  # budget 0: poll once
    assert core.wait_ge(f.array, 4, 5, 0, 2_000_000) == 2  # yield + futex phases, then timeout
    assert core.wait_ge(f.array, 4, 5, 1000, 1_000_000) == 2
    core.store_release(f[0], -1)  # signed compare: -1 < 5
    assert core.wait_ge(f.array, 4, 5, 0, 0) == 0
    assert core.wait_ge(f.array, 0, 5, 0, 0) == -1  # no flags: satisfied
    assert f.waiters(2) == 0  # every futex phase undid its registration


def test_wait_eq(core) -> None:
    f = Flags(1)
    core.store_release(f[0], 3)
    assert core.wait_eq(f[0], 3, 0, 0) is True
    assert core.wait_eq(f[0], 4, 0, 1_000_000) is False
    assert core.wait_eq(f[0], 2, 10, 0) is False


def test_wait_wakes_on_signal_from_thread(core) -> None:
    f = Flags(2)
    results: list[int] = []

    def waiter() -> None:
        results.append(core.wait_ge(f.array, 2, 1, 0, 30_000_000_000))

    t = threading.Thread(target=waiter)
    t.start()
    while f.waiters(0) == 0 and t.is_alive():  # the waiter reached the futex phase
        core.wait_eq(f[1], 12345, 0, 100_000)  # a GIL-free pause
    core.signal(f[0], 1)
    core.signal(f[1], 1)
    t.join(30)
    assert not t.is_alive() and results == [-1]


def test_now_ns_monotonic(core) -> None:
    a = core.now_ns()
    b = core.now_ns()
    assert 0 < a <= b


@pytest.mark.parametrize("nbytes", [0, 1, 100, 300 * 1024])
def test_memcpy_memset(core, nbytes: int) -> None:
    src = (ctypes.c_uint8 * max(1, nbytes)).from_buffer_copy(bytes((i * 7) & 0xFF for i in range(max(1, nbytes))))
    dst = (ctypes.c_uint8 * (nbytes + 1))()
    core.memcpy(ctypes.addressof(dst), ctypes.addressof(src), nbytes)
    assert bytes(dst)[:nbytes] == bytes(src)[:nbytes] and dst[nbytes] == 0
    core.memset(ctypes.addressof(dst), 0x1AB, nbytes)  # only the low byte counts
    assert bytes(dst)[:nbytes] == b"\xab" * nbytes and dst[nbytes] == 0


def test_bad_arguments_raise_not_crash(core) -> None:
    f = Flags(1)
    with pytest.raises(TypeError, match="wrong number of arguments"):
        core.load_acquire()
    with pytest.raises(TypeError, match="wrong number of arguments"):
        core.wait_ge(f.array, 1, 0, 0)
    with pytest.raises(TypeError, match="expected an int"):
        core.load_acquire("x")
    with pytest.raises(TypeError):
        core.signal(f[0], 1.5)
    with pytest.raises(ValueError, match="bad address"):
        core.load_acquire(0)
    with pytest.raises(ValueError, match="bad address"):
        core.store_release(f[0] + 4, 1)  # misaligned
    with pytest.raises(OverflowError):
        core.load_acquire(-8)
    with pytest.raises(ValueError, match="bad flag count"):
        core.wait_ge(f.array, -1, 0, 0, 0)
    bad = (ctypes.c_uint64 * 1)(0)
    with pytest.raises(ValueError, match="bad flag address at index 0"):
        core.wait_ge(ctypes.addressof(bad), 1, 0, 0, 0)
    with pytest.raises(ValueError, match="bad size"):
        core.memset(f[0], 0, -1)


@pytest.mark.parametrize("dtype", [torch.int16, torch.int8, torch.uint8, torch.int32])
def test_integer_products_wrap_like_torch(core, dtype):
    """Issue 11 item 5: products that overflow wrap as torch's do (int16 once overflowed signed int:
    65535 * 65535 after the promotion of uint16_t to int)."""
    from zbccl.ops.dtypes import DTYPE_CODES, PROD

    info = torch.iinfo(dtype)
    n = 4099  # not a multiple of any vector width: the tail is checked too
    gen = torch.Generator().manual_seed(5)
    inputs = [torch.randint(info.min, info.max + 1, (n,), dtype=torch.int64, generator=gen).to(dtype)
              for _ in range(3)]
    inputs[0][:4] = torch.tensor([info.max, info.min, -1 if info.min else 255, info.max], dtype=dtype)
    inputs[1][:4] = torch.tensor([info.max, info.min, info.min, info.max], dtype=dtype)
    dst = torch.empty(n, dtype=dtype)
    table = (ctypes.c_uint64 * 3)(*(t.data_ptr() for t in inputs))
    core.reduce_n(dst.data_ptr(), ctypes.addressof(table), 3, n, DTYPE_CODES[dtype], PROD, 1.0, 1)
    expect = inputs[0] * inputs[1] * inputs[2]
    assert torch.equal(dst, expect)
