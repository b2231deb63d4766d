"""The launchers' direct path (``native/triton/launch.py`` ``Kernel``) without a GPU.

The first launch of a specialisation goes through triton's JIT, the next ones straight to the compiled
binary's launcher. Here the JIT and the binary are stand-ins that record what they are given, over the
real kernels' parameter lists: the test checks which path each launch takes, what the binary's launcher
receives, and that anything that changes the binary (a constexpr, a scalar's width, a pointer's
alignment, num_warps, the device) compiles again.
"""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (pip install zbccl[cuda])")


class Ptr:
    """A tensor stand-in: only its address matters to the launchers."""

    def __init__(self, addr: int) -> None:
        self.addr = addr

    def data_ptr(self) -> int:
        return self.addr


class Compiled:
    def __init__(self, log: list) -> None:
        self.log, self.function, self.packed_metadata = log, "fn", "meta"

    def run(self, *args) -> None:
        self.log.append(("direct", args))


class Jit:
    """triton's JITFunction as the launchers use it: ``params`` and ``jit[grid](*args, num_warps=)``."""

    def __init__(self, real, *, launchable: bool = True) -> None:
        self.params, self.log, self.launchable, self.compiles = real.params, [], launchable, 0

    def __getitem__(self, grid):
        def launch(*args, num_warps):
            assert len(args) == len(self.params), "every parameter, positionally"
            self.log.append(("jit", grid, args, num_warps))
            self.compiles += 1
            return Compiled(self.log) if self.launchable else object()
        return launch


@pytest.fixture
def launch(monkeypatch):
    from zbccl.native.triton import launch as L

    if L.INTERPRET:
        pytest.skip("TRITON_INTERPRET is set in this process")
    state = {"dev": 0, "stream": 77}
    monkeypatch.setattr(L, "_device_stream", lambda: (state["dev"], state["stream"]))
    monkeypatch.setattr(L, "_hooked", lambda: False)
    L.state = state
    return L


_AR = dict(slot_off=64, me=1, world=2, in_off=4096, out_addr=0x7F0000001000, out_off=4096, numel=1000, dtype=1,
           red=0, two_shot=False, inplace=True, check=5, timeout_ns=60 * 10 ** 9, grid=4, block=4096, num_warps=8)


def _all_reduce(L, data, pads, **kw):
    args = dict(_AR)
    args.update(kw)
    L.all_reduce(data, pads, **args)


def test_the_second_launch_goes_straight_to_the_binary_with_pointers_as_ints(launch, monkeypatch):
    from zbccl.native.triton import kernels as k

    jit = Jit(k.all_reduce_kernel)
    monkeypatch.setattr(launch, "_all_reduce", launch.Kernel(jit))
    data, pads = Ptr(0x7F0000000000), Ptr(0x7F0000100000)
    _all_reduce(launch, data, pads)
    _all_reduce(launch, data, pads, in_off=8192, numel=2000)
    assert [e[0] for e in jit.log] == ["jit", "direct"]
    _, grid, jargs, warps = jit.log[0]
    assert grid == (4,) and warps == 8 and jargs[0] is data and jargs[1] is pads and jargs[2] is pads
    _, dargs = jit.log[1]
    assert dargs[:9] == (4, 1, 1, 77, "fn", "meta", None, None, None)
    full = dargs[9:]
    names = [p.name for p in k.all_reduce_kernel.params]
    assert len(full) == len(names)
    got = dict(zip(names, full))
    assert got["data"] == data.addr and got["pads"] == pads.addr and got["splits"] == pads.addr
    assert (got["in_off"], got["N"], got["me"], got["W"], got["TWO_SHOT"]) == (8192, 2000, 1, 2, False)
    assert got["ESZ"] == 2 and got["KW"] == 16 and got["INTERP"] is False


def test_a_direct_launch_returns_what_fire_launches_again(launch, monkeypatch):
    """``fire`` repeats a direct launch on the current stream; it launches nothing on another device or with a
    hook set, and a JIT launch returns nothing to repeat."""
    from zbccl.native.triton import kernels as k

    jit = Jit(k.all_reduce_kernel)
    monkeypatch.setattr(launch, "_all_reduce", launch.Kernel(jit))
    data, pads = Ptr(0x7F0000000000), Ptr(0x7F0000100000)
    assert launch.all_reduce(data, pads, **_AR) is None  # the JIT's (compiling) launch
    launched = launch.all_reduce(data, pads, **_AR)
    assert launched is not None and launched[0] == 0 and launched[2] == 4
    launch.state["stream"] = 78
    assert launch.fire(launched)
    first, again = jit.log[1][1], jit.log[2][1]
    assert again[3] == 78 and first[:3] + first[4:] == again[:3] + again[4:]  # the same, on the current stream
    launch.state["dev"] = 1
    assert not launch.fire(launched)
    launch.state["dev"] = 0
    monkeypatch.setattr(launch, "_hooked", lambda: True)
    assert not launch.fire(launched)
    assert len(jit.log) == 3


@pytest.mark.parametrize("change", [
    {"two_shot": True},                     # a constexpr
    {"numel": 1 << 31},                     # a scalar past int32: triton types it i64
    {"in_off": -(1 << 31) - 1},             # below int32 too
    {"num_warps": 4},
    {"dtype": 0},                           # the dtype (and its element size) are constexprs
])
def test_what_changes_the_binary_compiles_again(launch, monkeypatch, change):
    from zbccl.native.triton import kernels as k

    jit = Jit(k.all_reduce_kernel)
    monkeypatch.setattr(launch, "_all_reduce", launch.Kernel(jit))
    data, pads = Ptr(0x7F0000000000), Ptr(0x7F0000100000)
    _all_reduce(launch, data, pads)
    _all_reduce(launch, data, pads, **change)
    _all_reduce(launch, data, pads, **change)
    assert [e[0] for e in jit.log] == ["jit", "jit", "direct"]


def test_alignment_and_device_are_part_of_the_key(launch, monkeypatch):
    from zbccl.native.triton import kernels as k

    jit = Jit(k.all_gather_kernel)
    monkeypatch.setattr(launch, "_all_gather", launch.Kernel(jit))
    kw = dict(slot_off=0, me=0, world=2, in_off=0, out_addr=1 << 40, dtype=1, itemsize=2, outer=1, inner=1, cnt=8,
              total=16, skip_self=False, check=0, timeout_ns=1 << 35, grid=1, block=4096, num_warps=8)
    data, pads = Ptr(0x7F0000000000), Ptr(0x7F0000100000)
    launch.all_gather(data, pads, Ptr(0x7F0000200020), **kw)
    launch.all_gather(data, pads, Ptr(0x7F0000200008), **kw)  # splits only 8-byte aligned: another binary
    launch.all_gather(data, pads, Ptr(0x7F0000200010), **kw)  # 16-byte aligned: the first one's
    launch.state["dev"] = 1
    launch.all_gather(data, pads, Ptr(0x7F0000200010), **kw)
    assert [e[0] for e in jit.log] == ["jit", "jit", "direct", "jit"]
    assert jit.log[2][1][9 + 2] == 0x7F0000200010  # the splits table, as an int


def test_width_follows_triton():
    from triton.runtime.jit import mangle_type

    from zbccl.native.triton.launch import _width

    codes = {"i32": 0, "i64": 1, "u64": 2, "u1": 3}
    for v in (0, 1, -1, (1 << 31) - 1, 1 << 31, -(1 << 31), -(1 << 31) - 1, (1 << 63) - 1, 1 << 63, True, False):
        assert _width(v) == codes[mangle_type(v)], v


def test_hooks_and_unlaunchable_binaries_take_the_jit_every_time(launch, monkeypatch):
    from zbccl.native.triton import kernels as k

    jit = Jit(k.barrier_kernel, launchable=False)
    monkeypatch.setattr(launch, "_barrier", launch.Kernel(jit))
    pads = Ptr(0x7F0000100000)
    for _ in range(3):
        launch.barrier(None, pads, slot_off=0, me=0, world=2, timeout_ns=1 << 33)
    assert [e[0] for e in jit.log] == ["jit"] * 3

    jit2 = Jit(k.barrier_kernel)
    monkeypatch.setattr(launch, "_barrier", launch.Kernel(jit2))
    monkeypatch.setattr(launch, "_hooked", lambda: True)
    for _ in range(2):
        launch.barrier(None, pads, slot_off=0, me=0, world=2, timeout_ns=1 << 33)
    assert [e[0] for e in jit2.log] == ["jit"] * 2


def test_hooks_are_set_only_when_a_profiler_adds_one():
    """triton 3.6 keeps its launch hooks as empty ``HookChain`` objects: present, but no hook until one is
    added (a GPU run found every launch on the JIT path when presence counted as set)."""
    from triton import knobs

    from zbccl.native.triton import launch as L

    assert not L._hooked()

    def hook(metadata):
        return None

    chain = knobs.runtime.launch_enter_hook
    if not hasattr(chain, "add"):  # an older triton: a plain attribute
        knobs.runtime.launch_enter_hook = hook
        try:
            assert L._hooked()
        finally:
            knobs.runtime.launch_enter_hook = chain
        return
    chain.add(hook)
    try:
        assert L._hooked()
    finally:
        chain.remove(hook)
    assert not L._hooked()


def test_the_c_entry_passes_what_triton_36s_launcher_call_passes():
    """``_entry``: with triton 3.6 a launch calls the binary's C ``launch`` itself, with exactly the arguments
    triton's own ``CudaLauncher.__call__`` passes it (checked against that class here, scratch-free), and falls
    back to ``ck.run`` when the kernel asks for scratch or the launcher is another class or triton version."""
    import triton

    from zbccl.native.triton import launch as L

    if not triton.__version__.startswith(L._ENTRY_TRITON):
        pytest.skip(f"triton {triton.__version__}: _entry falls back to ck.run")
    from triton.backends.nvidia.driver import CudaLauncher

    calls = []
    run = object.__new__(CudaLauncher)  # triton's class, without compiling its C module
    run.num_ctas, run.launch = 1, lambda *args: calls.append(args)
    run.global_scratch_size = run.profile_scratch_size = 0
    run.global_scratch_align = run.profile_scratch_align = 1
    run.launch_cooperative_grid, run.launch_pdl = False, True
    ck = type("CK", (), {})()
    ck.run, ck.function, ck.packed_metadata = run, 1234, ("meta",)
    args = (0x7F0000000000, 7, 8)
    run(3, 1, 1, 55, ck.function, ck.packed_metadata, None, None, None, *args)  # what triton's JIT path does
    fn, head = L._entry(ck)
    assert fn is run.launch
    fn(3, 1, 1, 55, *head, *args)
    assert calls[0] == calls[1] == (3, 1, 1, 55, 1234, False, True, None, None, ("meta",), None, None, None, *args)
    run.global_scratch_size = 64  # a kernel with scratch: triton's __call__ allocates it
    assert L._entry(ck) == (run, (1234, ("meta",), None, None, None))
    run.global_scratch_size = 0
    ck.run = Compiled([])  # another launcher class
    assert L._entry(ck)[0] is ck.run
