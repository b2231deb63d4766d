"""EP on a device heap (``zbccl.ep.device``: DeepEP's normal and low-latency modes over the device all_to_all)
without a GPU: the Triton kernels run under the interpreter over the real shm heap, the routing in torch.

Every rank rebuilds every rank's inputs from seeds (payloads encode rank and token), and each result is
compared bit for bit with the plain-torch oracle (``zbccl.ep.reference``): the received rows, top-k, weights,
counts and every handle field; the combine sums; the low-latency slots, counts, source tokens and layout,
in bf16 and in fp8 (float and UE8M0 scales).
"""

from __future__ import annotations

import os
import sys
from unittest import mock

import pytest
import torch

from tests.multiproc.triton_cases import ENV, device_ops, needs_triton
from tests.spawn import run_world

pytestmark = needs_triton

H, K, TMAX = 512, 3, 12  # hidden a multiple of 512 (UE8M0 packs four 128-channel scales per int32)


def _inputs(r: int, W: int, E: int):
    """Rank r's tokens (a count that differs per rank), top-k (distinct experts, some -1) and weights."""
    from zbccl.bench.gpu_ep import ep_inputs

    return ep_inputs(r, E, hidden=H, topk=K, tokens=(5, 3), seed=1000, drop=0.2)


def _world(ctx, heap_size: str = "64M"):
    """``(comm, dev, W, me, E, d, ins)``: this rank's device ops and device EP over the shm heap, ``E = 4 W``
    experts, and every rank's inputs."""
    comm, dev = device_ops(ctx, heap_size=heap_size)
    W = comm.world_size
    E = 4 * W
    return comm, dev, W, comm.rank, E, _device_ep(comm, dev), [_inputs(r, W, E) for r in range(W)]


def _device_ep(comm, dev):
    import zbccl
    from zbccl.ep.device import DeviceEP

    tr = comm._ctx.heap.transport
    return DeviceEP(ops=lambda name: dev, empty=lambda shape, dtype: zbccl.empty(*shape, dtype=dtype),
                    in_heap=lambda t: tr.offset_of(comm.rank, t) >= 0, rank=comm.rank, R=comm.world_size,
                    ranks=tuple(range(comm.world_size)))


def _normal(ctx):
    from zbccl.ep import device as D
    from zbccl.ep import reference as ref

    comm, dev, W, me, E, d, ins = _world(ctx)
    in_ranks = [ref.dispatch_layout(i, E, W)[2] for _, i, _ in ins]
    x, idx, w = ins[me]
    ntpr, ntpe, in_rank = D.layout(idx, E, W)
    want_layout = ref.dispatch_layout(idx, E, W)
    assert torch.equal(ntpr, want_layout[0]) and torch.equal(ntpe, want_layout[1]) and torch.equal(in_rank, want_layout[2])
    C = 4
    got = D.dispatch(d, x, idx, w, in_rank, ntpr, ntpe, None, expert_alignment=4, num_channels=C)
    want = ref.dispatch([a for a, _, _ in ins], in_ranks, me, E, topk_idx=[i for _, i, _ in ins],
                        topk_weights=[v for _, _, v in ins], expert_alignment=4, num_channels=C)
    recv_x, recv_idx, recv_w, lst, h = got
    assert torch.equal(recv_x, want["x"]) and torch.equal(recv_idx, want["topk_idx"])
    assert torch.equal(recv_w, want["topk_weights"]) and lst == want["num_recv_tokens_per_expert_list"]
    assert torch.equal(h[0], want["rank_prefix_matrix"]) and torch.equal(h[1], want["channel_prefix_matrix"])
    assert torch.equal(h[2], want["recv_channel_prefix_matrix"]) and torch.equal(h[3], want["src_idx"])
    assert torch.equal(h[4], in_rank) and torch.equal(h[5], want["send_head"])
    # x in the heap: the peers pull its rows where they are (a row list instead of a packed block)
    import zbccl

    xh = zbccl.empty(*x.shape, dtype=x.dtype)
    xh.copy_(x)
    made, empty = [], d.empty
    d.empty = lambda shape, dtype: made.append((tuple(shape), dtype)) or empty(shape, dtype)
    try:
        hx, hidx, *_ = D.dispatch(d, xh, idx, w, in_rank, ntpr, ntpe, None, expert_alignment=4, num_channels=C)
    finally:
        d.empty = empty
    assert torch.equal(hx, want["x"]) and torch.equal(hidx, want["topk_idx"])
    sent = int(in_rank.sum())
    assert ((sent,), torch.int64) in made and ((sent, H), x.dtype) not in made, made  # a list, no packed block
    # the cached dispatch: same routing, new rows
    again, *rest = D.dispatch(d, x * 2, None, None, None, None, None, h)
    assert torch.equal(again, (want["x"].float() * 2).to(torch.bfloat16)) and rest == [None] * 4
    # combine: every rank sends back f(its received rows); the weights come back summed too
    ys, ws = [], []
    for r in range(W):
        wr = ref.dispatch([a for a, _, _ in ins], in_ranks, r, E, topk_idx=[i for _, i, _ in ins],
                          topk_weights=[v for _, _, v in ins])
        ys.append((wr["x"].float() * 0.5 + r).to(torch.bfloat16))
        ws.append(wr["topk_weights"])
    bias = torch.full((x.size(0), H), 0.25, dtype=torch.bfloat16)
    out, outw = D.combine(d, ys[me], h, ws[me], (bias,))
    want_out, want_w = ref.combine(ys, in_ranks, me, topk_weights=ws, bias=(bias,))
    assert torch.equal(out, want_out) and torch.equal(outw, want_w)
    # num_worst_tokens: fixed-size outputs, -1 / 0 below the received rows
    worst = 64
    wx, widx, ww, wl, _ = D.dispatch(d, x, idx, w, in_rank, ntpr, ntpe, None, num_worst_tokens=worst)
    n = want["x"].size(0)
    assert wx.size(0) == worst and torch.equal(wx[:n], want["x"]) and wl == []
    assert bool((widx[n:] == -1).all()) and bool((ww[n:] == 0).all()) and torch.equal(widx[:n], want["topk_idx"])
    # fp8 rows with their scales
    from zbccl.ep.layout import fp8_quantize

    xs8 = [fp8_quantize(a) for a, _, _ in ins]
    (r8, s8), *_ = D.dispatch(d, xs8[me], idx, w, in_rank, ntpr, ntpe, None)
    want8 = ref.dispatch(xs8, in_ranks, me, E)
    assert torch.equal(r8.view(torch.uint8), want8["x"][0].view(torch.uint8)) and torch.equal(s8, want8["x"][1])
    return True


class _NoHostReads:
    """Within it, a host read of a tensor's values made by ``zbccl/ep/device.py`` itself (``tolist``, ``item``,
    ``cpu``, ``numpy``, and the aten ops that read values on the host: ``nonzero``, ``bincount``, ``equal``, ...)
    raises: what the sync-free mode must not do on a GPU, where each would sync the host (and fail under graph
    capture). The device ops underneath may (over the CPU heap their splits are host values; on CUDA they stay on
    the device), so only reads whose innermost zbccl frame is ``ep/device.py`` count."""

    #: aten ops whose result is a host value, or whose output's size depends on the device's values
    SYNCS = ("_local_scalar_dense", "is_nonzero", "equal", "nonzero", "bincount", "unique", "_unique2",
             "masked_select", "repeat_interleave")

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        import zbccl

        pkg = os.path.dirname(zbccl.__file__) + os.sep
        target = os.path.join(pkg, "ep", "device.py")

        def guilty(what: str) -> None:
            f = sys._getframe(1)
            while f is not None:
                name = f.f_code.co_filename
                if name.startswith(pkg):
                    if name == target:
                        raise AssertionError(f"ep/device.py read device values on the host ({what}) at line "
                                             f"{f.f_lineno}")
                    return
                f = f.f_back

        syncs = self.SYNCS

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.overloadpacket.__name__ in syncs:
                    guilty(str(func))
                return func(*args, **(kwargs or {}))

        def wrap(name):
            orig = getattr(torch.Tensor, name)

            def read(t, *a, **k):
                guilty(name)
                return orig(t, *a, **k)
            return read

        self._patches = [mock.patch.object(torch.Tensor, n, wrap(n)) for n in ("tolist", "cpu", "numpy", "item")]
        for p in self._patches:
            p.start()
        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        for p in self._patches:
            p.stop()
        return False


def _free(ctx):
    """The sync-free normal mode (``num_worst_tokens``, a cached dispatch, a combine without the host counts) and
    the same under (simulated) CUDA graph capture: the oracle's results, no host read of a device value by
    ep/device.py, and under capture the same heap blocks at every call. Also: ranks that pass x in the heap and
    ranks that do not, in one dispatch."""
    import zbccl
    from zbccl.ep import device as D
    from zbccl.ep import reference as ref

    comm, dev, W, me, E, d, ins = _world(ctx)
    in_ranks = [ref.dispatch_layout(i, E, W)[2] for _, i, _ in ins]
    x, idx, w = ins[me]
    want = ref.dispatch([a for a, _, _ in ins], in_ranks, me, E, topk_idx=[i for _, i, _ in ins],
                        topk_weights=[v for _, _, v in ins], num_channels=4)
    n = want["x"].size(0)
    worst = 3 + sum(int(r.sum()) for r in in_ranks)  # more than any rank receives
    ys, ws = [], []
    for r in range(W):  # each rank's combine input: f(its received rows), padded to worst rows with junk
        wr = ref.dispatch([a for a, _, _ in ins], in_ranks, r, E, topk_idx=[i for _, i, _ in ins],
                          topk_weights=[v for _, _, v in ins])
        ys.append((wr["x"].float() * 0.5 + r).to(torch.bfloat16))
        ws.append(wr["topk_weights"])
    bias = torch.full((x.size(0), H), 0.25, dtype=torch.bfloat16)
    want_out, want_w = ref.combine(ys, in_ranks, me, topk_weights=ws, bias=(bias,))
    junk_y = torch.cat([ys[me], torch.full((worst - n, H), 1e4, dtype=torch.bfloat16)])
    junk_w = torch.cat([ws[me], torch.full((worst - n, K), 1e4)])

    def step():
        ntpr, ntpe, in_rank = D.layout(idx, E, W)
        rx, ridx, rw, lst, h = D.dispatch(d, x, idx, w, in_rank, ntpr, ntpe, None, num_worst_tokens=worst,
                                          num_channels=4)
        again, *rest = D.dispatch(d, x * 2, None, None, None, None, None, h)
        out, outw = D.combine(d, junk_y, h, junk_w, (bias,), free=True)
        return rx, ridx, rw, lst, h, again, rest, out, outw

    def check(got) -> None:
        rx, ridx, rw, lst, h, again, rest, out, outw = got
        assert rx.shape == (worst, H) and torch.equal(rx[:n], want["x"]) and lst == []
        assert torch.equal(ridx[:n], want["topk_idx"]) and bool((ridx[n:] == -1).all())
        assert torch.equal(rw[:n], want["topk_weights"]) and bool((rw[n:] == 0).all())
        assert torch.equal(h[0], want["rank_prefix_matrix"]) and torch.equal(h[1], want["channel_prefix_matrix"])
        assert torch.equal(h[2], want["recv_channel_prefix_matrix"]) and torch.equal(h[5], want["send_head"])
        assert torch.equal(h[3][:n], want["src_idx"]) and bool((h[3][n:] == -1).all())
        assert again.shape == (worst, H) and rest == [None] * 4
        assert torch.equal(again[:n], (want["x"].float() * 2).to(torch.bfloat16))
        assert torch.equal(out, want_out) and torch.equal(outw, want_w)

    with _NoHostReads():
        got = step()
    check(got)
    # as under capture: the heap tensors are kept blocks, the same ones at the next call (a replay reuses them)
    with mock.patch.object(D, "_capturing", lambda t: True), _NoHostReads():
        check(step())
        kept = {k: t.data_ptr() for k, t in d.blocks.items()}
        made, empty = [], d.empty
        d.empty = lambda shape, dtype: made.append((tuple(shape), dtype)) or empty(shape, dtype)
        try:
            check(step())
        finally:
            d.empty = empty
    assert kept and {k: t.data_ptr() for k, t in d.blocks.items()} == kept, (kept, d.blocks.keys())
    assert made == [], made  # no heap tensor but the kept blocks (a fresh one would be freed after the capture)
    # capture without num_worst_tokens: the outputs' sizes would not be fixed, so it is refused on every rank
    ntpr, ntpe, in_rank = D.layout(idx, E, W)
    with mock.patch.object(D, "_capturing", lambda t: True):
        try:
            D.dispatch(d, x, idx, w, in_rank, ntpr, ntpe, None)
        except zbccl.ZbcclInvalidUsageError as exc:
            assert "num_worst_tokens" in str(exc), exc
        else:
            raise AssertionError("a captured dispatch without num_worst_tokens ran")
    # x in the heap on rank 0 only: every rank still pulls the same way (rank 0's rows where they are)
    mine = x
    if me == 0:
        mine = zbccl.empty(*x.shape, dtype=x.dtype)
        mine.copy_(x)
    rx, *_ = D.dispatch(d, mine, idx, w, in_rank, ntpr, ntpe, None)
    assert torch.equal(rx, want["x"])
    # more rows than num_worst_tokens: the error names it (every rank here receives more than one row, so every
    # rank raises; over the CPU heap the splits are host values, checked before the launch; on CUDA the kernel
    # stops the pull at the output's end and says so at the next check)
    try:
        D.dispatch(d, x, idx, w, in_rank, ntpr, ntpe, None, num_worst_tokens=1)
    except zbccl.ZbcclInvalidUsageError as exc:
        assert "num_worst_tokens" in str(exc) and "at most 1 rows" in str(exc), exc
    else:
        raise AssertionError("rows past num_worst_tokens went unreported")
    # a wrong call in the sync-free mode: that rank raises its error, the others name it (here at once: the
    # interpreter checks after each kernel; on CUDA at their next check)
    bad_w = w[:, :1] if me == 1 else w
    try:
        D.dispatch(d, x, idx, bad_w, in_rank, ntpr, ntpe, None, num_worst_tokens=worst)
    except zbccl.ZbcclInvalidUsageError as exc:
        assert me == 1 and "topk_weights" in str(exc), exc
    except zbccl.ZbcclRemoteError as exc:
        assert me != 1 and 1 in exc.ranks, exc
    else:
        raise AssertionError("a wrong call went unreported")
    return True


def _bad_call(ctx):
    """A rank whose call is wrong raises its own error; the others raise ZbcclRemoteError naming it."""
    from zbccl import ZbcclInvalidUsageError, ZbcclRemoteError
    from zbccl.ep import device as D

    comm, dev, W, me, E, d, ins = _world(ctx, "32M")
    x, idx, w = ins[me]
    ntpr, ntpe, in_rank = D.layout(idx, E, W)
    if me == 1:
        idx = idx.clone()
        idx[0, 0] = E + 3  # out of range
    try:
        D.dispatch(d, x, idx, w, in_rank, ntpr, ntpe, None)
    except ZbcclInvalidUsageError as exc:
        assert me == 1 and "topk_idx out of range" in str(exc), exc
        first = "own"
    except ZbcclRemoteError as exc:
        assert me != 1 and exc.ranks == (1,), exc
        first = "remote"
    else:
        return "none"
    # a rank wrong before its header's length is known (no expert counts): it raises its own error, the others
    # name it (its header's length differs from theirs)
    try:
        D.dispatch(d, x, _inputs(me, W, E)[1], w, in_rank, ntpr, None if me == 2 else ntpe, None)
    except ZbcclInvalidUsageError as exc:
        if me == 2:
            assert "num_tokens_per_expert is required" in str(exc), exc
        else:
            assert exc.ranks == (2,) and "differ" in str(exc), exc
        return first
    return "no second error"


def _low_latency(ctx):
    from zbccl.ep import device as D
    from zbccl.ep import reference as ref

    comm, dev, W, me, E, d, ins = _world(ctx)
    L = E // W
    x, idx, w = ins[me]
    for fp8, rnd, ue in ((False, False, False), (True, False, False), (True, True, True)):
        recv_x, count, src_info, layout_range = D.ll_dispatch(d, x, idx, TMAX, E, use_fp8=fp8, round_scale=rnd,
                                                              use_ue8m0=ue)
        want = ref.low_latency_dispatch([a for a, _, _ in ins], [i for _, i, _ in ins], me, TMAX, E, use_fp8=fp8,
                                        round_scale=rnd, use_ue8m0=ue)
        assert torch.equal(count, want["count"]) and torch.equal(layout_range, want["layout_range"])
        rx, sx = recv_x if fp8 else (recv_x, None)
        for le in range(L):
            n = int(count[le])
            assert torch.equal(src_info[le, :n], want["src_info"][le, :n]), (fp8, le)
            if fp8:
                assert torch.equal(rx[le, :n].view(torch.uint8), want["x"][le, :n].view(torch.uint8)), (le, "x8")
                assert torch.equal(sx[le, :n], want["scales"][le, :n]), (le, "scales")
                assert sx.stride(1) == 1 and (sx.size(2) == 1 or sx.stride(2) == sx.size(1)), "scales column-major"
            else:
                assert torch.equal(rx[le, :n], want["x"][le, :n]), le
    # the mode's heap blocks are the Buffer's: a second call takes no new one (what a captured graph needs)
    kept = {k: v.data_ptr() for k, v in d.blocks.items()}
    D.ll_dispatch(d, x, idx, TMAX, E, use_fp8=False, round_scale=False, use_ue8m0=False)
    assert {k: v.data_ptr() for k, v in d.blocks.items()} == kept and kept
    # combine: each owner's outputs are f(its received rows)
    outs = []
    for o in range(W):
        wo = ref.low_latency_dispatch([a for a, _, _ in ins], [i for _, i, _ in ins], o, TMAX, E)
        outs.append((wo["x"].float() * 0.75 - o).to(torch.bfloat16))
    recv_x, count, src_info, layout_range = D.ll_dispatch(d, x, idx, TMAX, E, use_fp8=False, round_scale=False,
                                                          use_ue8m0=False)
    handle = (src_info, layout_range, TMAX, H, E)
    got = D.ll_combine(d, outs[me], idx, w, handle)
    want = ref.low_latency_combine(outs, [i for _, i, _ in ins], me, w)
    assert torch.equal(got, want)
    into = torch.empty(x.size(0), H, dtype=torch.bfloat16)
    assert D.ll_combine(d, outs[me], idx, w, handle, out=into) is into and torch.equal(into, want)
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_normal_dispatch_and_combine_match_the_oracle(world):
    assert run_world(_normal, world, env=ENV, timeout=240) == [True] * world


@pytest.mark.parametrize("world", [2, 3])
def test_the_sync_free_normal_mode_matches_the_oracle_without_reading_the_device(world):
    assert run_world(_free, world, env=ENV, timeout=240) == [True] * world


def test_a_wrong_call_is_reported_on_every_rank():
    assert run_world(_bad_call, 3, env=ENV, timeout=180) == ["remote", "own", "remote"]


@pytest.mark.parametrize("world", [2, 3])
def test_low_latency_dispatch_and_combine_match_the_oracle(world):
    assert run_world(_low_latency, world, env=ENV, timeout=240) == [True] * world


def _buffer(ctx):
    """The Buffer's CUDA branches (``ep/buffer.py``) with the device side over the CPU heap: what DeepEP code
    calls reaches ``ep/device.py`` with the right arguments, and its results come back in DeepEP's shapes."""
    from unittest import mock

    import zbccl.ep as deep_ep
    from zbccl.ep import buffer as B
    from zbccl.ep import event as ev
    from zbccl.ep import reference as ref

    comm, dev = device_ops(ctx, heap_size="64M")
    W, me = comm.world_size, comm.rank
    E = 4 * W
    buf = deep_ep.Buffer(comm, num_nvl_bytes=1 << 20, explicitly_destroy=True)
    sub = buf.comm
    from zbccl.ops.device import DeviceOps

    sub_ops = DeviceOps(sub.rank, sub.ranks, sub._ctx.heap.transport, slot=sub.slot, timeout_s=30, barrier=sub.barrier)
    d = _device_ep(comm, sub_ops)
    ins = [_inputs(r, W, E) for r in range(W)]
    x, idx, w = ins[me]
    with mock.patch.object(B.Buffer, "_on_device", lambda self, *t: True), \
            mock.patch.object(B.Buffer, "_device", lambda self, op, prev: d), \
            mock.patch.object(ev, "DeviceEventHandle", ev.EventHandle):
        ntpr, ntpr_host, ntpe, in_rank, e0 = buf.get_dispatch_layout(idx, E)
        assert ntpr_host is None and e0.event is None and torch.equal(in_rank, ref.dispatch_layout(idx, E, W)[2])
        recv_x, recv_idx, recv_w, lst, h, e1 = buf.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=in_rank,
                                                           num_tokens_per_expert=ntpe, topk_idx=idx, topk_weights=w,
                                                           async_finish=True)
        in_ranks = [ref.dispatch_layout(i, E, W)[2] for _, i, _ in ins]
        want = ref.dispatch([a for a, _, _ in ins], in_ranks, me, E, topk_idx=[i for _, i, _ in ins],
                            topk_weights=[v for _, _, v in ins], num_channels=deep_ep.Buffer.num_sms // 2)
        assert torch.equal(recv_x, want["x"]) and lst == want["num_recv_tokens_per_expert_list"]
        assert torch.equal(h[1], want["channel_prefix_matrix"]) and e1.event is not None
        e1.current_stream_wait()
        # get_dispatch_layout's own tensors, unchanged: dispatch skips the checks that read them on the host (on a
        # GPU each is a device sync); after an in-place write to topk_idx it checks again
        from zbccl.ep import device as D

        calls, real = [], D.layout
        with mock.patch.object(D, "layout", lambda *a: calls.append(1) or real(*a)):
            buf.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe,
                         topk_idx=idx, topk_weights=w)
            assert calls == []
            idx.add_(0)
            buf.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe,
                         topk_idx=idx, topk_weights=w)
            assert calls == [1]
        out, out_w, _ = buf.combine(recv_x, h, recv_w)
        ys = [ref.dispatch([a for a, _, _ in ins], in_ranks, r, E)["x"] for r in range(W)]
        ws = [ref.dispatch([a for a, _, _ in ins], in_ranks, r, E, topk_idx=[i for _, i, _ in ins],
                           topk_weights=[v for _, _, v in ins])["topk_weights"] for r in range(W)]
        want_out, want_w = ref.combine(ys, in_ranks, me, topk_weights=ws)
        assert torch.equal(out, want_out) and torch.equal(out_w, want_w)
        recv, count, handle, _, hook = buf.low_latency_dispatch(x, idx, TMAX, E, use_fp8=False, return_recv_hook=True)
        hook()
        assert handle[2:] == (TMAX, H, E) and count.dtype == torch.int32
        combined, _, none = buf.low_latency_combine(recv, idx, w, handle)
        outs = [ref.low_latency_dispatch([a for a, _, _ in ins], [i for _, i, _ in ins], o, TMAX, E)["x"]
                for o in range(W)]
        assert none is None and torch.equal(combined, ref.low_latency_combine(outs, [i for _, i, _ in ins], me, w))
    # every op on CUDA tensors starts with the device ops' check: on a GPU the kernels' reports (a peer's refused
    # call, a rank that never came, mismatched arguments) are read there, at the next EP op, without a sync. (The
    # report here is mismatched arguments, an error every rank raises together: a peer's failure would mark this
    # rank's ABORT line, and the Buffer's destroy below would then name it.)
    from zbccl import ZbcclInvalidUsageError

    class Reported:
        def check(self, wait: bool = False):
            raise ZbcclInvalidUsageError("all_to_all_v: arguments differ across ranks, expected dtype 1, got 2 on "
                                         "group rank 1", ranks=(1,))

    buf._device_ep = D.DeviceEP(ops=lambda name: Reported(), empty=d.empty, in_heap=d.in_heap, rank=me, R=W,
                                ranks=d.ranks)
    with mock.patch.object(B.Buffer, "_on_device", lambda self, *t: True):
        for call in (lambda: buf.get_dispatch_layout(idx, E), lambda: buf.combine(recv_x, h, recv_w),
                     lambda: buf.low_latency_dispatch(x, idx, TMAX, E, use_fp8=False)):
            try:
                call()
            except ZbcclInvalidUsageError as exc:
                assert exc.ranks == (1,), exc
            else:
                raise AssertionError("a reported error went unraised")
    buf._device_ep = None
    buf.destroy()
    # the Buffer's device blocks come from the job's CUDA heap: without one, the error says how to get it
    from zbccl.ep.exchange import device_heap_empty

    try:
        device_heap_empty(comm, "cuda", (4, 4), torch.bfloat16)
    except ZbcclInvalidUsageError as exc:
        assert "no cuda heap in this job" in str(exc) and "init(device='cuda')" in str(exc), exc
    else:
        raise AssertionError("a cuda block without a cuda heap")
    return True


def test_the_buffer_routes_device_tensors_to_the_device_path():
    assert run_world(_buffer, 2, env=ENV, timeout=240) == [True] * 2


def _empty_rank(ctx):
    """A rank with no tokens (and one whose tokens select no expert at all): both modes still match the oracle."""
    from zbccl.ep import device as D
    from zbccl.ep import reference as ref

    comm, dev, W, me, E, d, ins = _world(ctx)
    ins[1] = tuple(t[:0] for t in ins[1])                          # rank 1: no tokens
    ins[0] = (ins[0][0], torch.full_like(ins[0][1], -1), ins[0][2])  # rank 0: every slot -1
    xs, idxs, ws = [a for a, _, _ in ins], [i for _, i, _ in ins], [v for _, _, v in ins]
    in_ranks = [ref.dispatch_layout(i, E, W)[2] for i in idxs]
    x, idx, w = ins[me]
    ntpr, ntpe, in_rank = D.layout(idx, E, W)
    recv_x, recv_idx, recv_w, lst, h = D.dispatch(d, x, idx, w, in_rank, ntpr, ntpe, None)
    want = ref.dispatch(xs, in_ranks, me, E, topk_idx=idxs, topk_weights=ws)
    assert torch.equal(recv_x, want["x"]) and torch.equal(recv_idx, want["topk_idx"])
    assert lst == want["num_recv_tokens_per_expert_list"]
    out, _ = D.combine(d, recv_x, h)
    assert torch.equal(out, ref.combine([ref.dispatch(xs, in_ranks, r, E)["x"] for r in range(W)], in_ranks, me)[0])
    rx, count, src_info, layout_range = D.ll_dispatch(d, x, idx, TMAX, E, use_fp8=False, round_scale=False,
                                                      use_ue8m0=False)
    wl = ref.low_latency_dispatch(xs, idxs, me, TMAX, E)
    assert torch.equal(count, wl["count"]) and torch.equal(layout_range, wl["layout_range"])
    got = D.ll_combine(d, rx, idx, w, (src_info, layout_range, TMAX, H, E))
    outs = [ref.low_latency_dispatch(xs, idxs, o, TMAX, E)["x"] for o in range(W)]
    assert torch.equal(got, ref.low_latency_combine(outs, idxs, me, w))
    return True


def test_a_rank_without_tokens_and_one_without_experts():
    assert run_world(_empty_rank, 2, env=ENV, timeout=240) == [True] * 2
