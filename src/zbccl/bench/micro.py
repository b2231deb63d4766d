"""Host-side overheads measured inside a rank: the heap allocator hook and native call costs.

* ``alloc``: ``torch.empty(n, dtype=uint8); del`` inside ``zbccl.heap_scope()``
  against the same pair with torch's default CPU allocator, for 4 KiB to
  16 MiB, as a ratio (the target is at most 1.5x). The scope's hot path is a
  native per-size-class cache, so it does not enter Python.
* ``native``: the cost of one call into the native core from Python (an
  atomic load, a flag signal, a satisfied wait, a 64-element bf16 reduction),
  the floor under every small-message collective (the cost of an empty Python
  call through the same loop is subtracted).
* ``small_call`` (:func:`small_call_overhead`, collective): ``zbccl.all_reduce``
  of 4 KiB fp32 on a heap tensor, the whole call (every rank, back-to-back,
  slowest rank) against its Python part alone: the same call on every rank at
  once with the channel's native call (``chan_run``, or ``hot_submit``, which
  also takes the channel's lock and numbers the op) replaced by a stub that returns
  0, so only the Python steps between the call and the native op remain (the
  stub's own cost, an empty Python call, is subtracted; the ctypes crossing
  itself is ``native_ns``). The Python part is timed in thread CPU time
  (nothing waits once the native op is stubbed, so a busy machine's
  preemptions do not count); the whole call in wall time (it waits for the
  peers). The channel's sequence number is restored after.
"""


from __future__ import annotations

import statistics
import time

import numpy as np
import torch

__all__ = ["host_overheads", "small_call_overhead", "format_overheads"]

_ALLOC_SIZES = (4 << 10, 64 << 10, 1 << 20, 16 << 20)


def _ns_per_call(fn, iters: int, reps: int = 5, clock=time.perf_counter) -> float:
    samples = []
    for _ in range(reps):
        t0 = clock()
        for _ in range(iters):
            fn()
        samples.append((clock() - t0) / iters * 1e9)
    return statistics.median(samples)


def _alloc_pair(n: int):
    def fn():
        x = torch.empty(n, dtype=torch.uint8)
        del x
    return fn


def host_overheads(comm, *, quick: bool = False) -> dict:
    """Measure on this rank (not collective; the other ranks should be idle meanwhile)."""
    import zbccl

    iters = 2000 if quick else 20000
    alloc = []
    for n in _ALLOC_SIZES:
        fn = _alloc_pair(n)
        fn()
        default_ns = _ns_per_call(fn, iters)
        with zbccl.heap_scope(comm):
            fn()
            scope_ns = _ns_per_call(fn, iters)
        alloc.append({"bytes": n, "default_ns": round(default_ns, 1), "scope_ns": round(scope_ns, 1),
                      "ratio": round(scope_ns / default_ns, 3)})
    core = comm._ctx.prims
    flag = zbccl.zeros(16, dtype=torch.int64, comm=comm)
    addr = flag.data_ptr()
    addrs = np.asarray([addr], dtype=np.uint64)
    addrs_ptr = int(addrs.ctypes.data)
    a = zbccl.zeros(64, dtype=torch.bfloat16, comm=comm)
    dst = a.data_ptr()
    srcs = np.asarray([dst, dst], dtype=np.uint64)
    srcs_ptr = int(srcs.ctypes.data)
    empty_ns = _ns_per_call(lambda: None, iters)  # the lambda and loop themselves
    native = {
        "load_acquire": _ns_per_call(lambda: core.load_acquire(addr), iters),
        "signal": _ns_per_call(lambda: core.signal(addr, 0), iters),
        "wait_ge_satisfied": _ns_per_call(lambda: core.wait_ge(addrs_ptr, 1, 0, 0, 0), iters),
        "reduce_n_64_bf16": _ns_per_call(lambda: core.reduce_n(dst, srcs_ptr, 2, 64, 1, 0, 1.0, 1), iters),
    }
    native = {k: v - empty_ns for k, v in native.items()}
    return {"alloc": alloc, "native_ns": {k: round(v, 1) for k, v in native.items()}}


def small_call_overhead(comm, *, ctl, nbytes: int = 4096, quick: bool = False) -> dict:
    """Collective: the Python part of ``zbccl.all_reduce`` (``nbytes`` fp32) against the whole call, in ns.

    The Python path's part: a registered tensor runs through the native hot entry instead
    (``OpChannel.hot``), which has no Python part left to stub."""
    import zbccl

    from .timing import TimingConfig, time_calls

    t = zbccl.zeros(nbytes // 4, dtype=torch.float32, comm=comm)
    call = lambda: zbccl.all_reduce(t, comm=comm)  # noqa: E731
    cfg = TimingConfig(target_s=0.01 if quick else 0.05, reps=3 if quick else 5, warmup=20)
    whole = time_calls(call, ctl=ctl, sync=comm.barrier, cfg=cfg).stats["median"] * 1e3
    ch = comm.op_state
    iters = 2000 if quick else 20000
    comm.barrier()
    seq, hot, real = ch.seq, ch.hot, {k: getattr(ch, k) for k in ("_chan_run", "_hot_submit") if hasattr(ch, k)}
    # the Python path (the hot entry cannot be stubbed): submit's native call is chan_run, or hot_submit where
    # the channel has a hot table (the channel's lock, the op's number and chan_run in one call)
    for k in real:
        setattr(ch, k, lambda *args: 0)
    ch.hot = None
    try:
        # CPU time of this thread: nothing waits with the stub, and a busy machine's preemptions don't count
        stub_ns = _ns_per_call(lambda: (lambda *args: 0)(0, 0, 0), iters, clock=time.thread_time)
        python_ns = _ns_per_call(call, iters, clock=time.thread_time) - stub_ns
    finally:
        for k, fn in real.items():
            setattr(ch, k, fn)
        ch.hot, ch.seq = hot, seq
    python_ns = ctl.max([python_ns])[0]
    comm.barrier()
    call()  # the channel still works: one more real call on every rank
    return {"bytes": nbytes, "dtype": "fp32", "whole_ns": round(whole, 1), "python_ns": round(python_ns, 1),
            "python_share": round(python_ns / whole, 3) if whole else None}


def format_overheads(o: dict) -> list[str]:
    lines = ["# host overheads (rank 0)", "heap_scope allocator: torch.empty(n, uint8) + del, scope vs default",
             f"{'bytes':>10} {'default_ns':>11} {'scope_ns':>9} {'ratio':>6}"]
    for row in o["alloc"]:
        lines.append(f"{row['bytes']:>10} {row['default_ns']:>11.0f} {row['scope_ns']:>9.0f} {row['ratio']:>6.2f}")
    lines.append("native core, ns per call from Python: "
                 + ", ".join(f"{k} {v:.0f}" for k, v in o["native_ns"].items()))
    sc = o.get("small_call")
    if sc:
        lines.append(f"all_reduce {sc['bytes']} B {sc['dtype']}: whole call {sc['whole_ns'] / 1e3:.2f} us, "
                     f"Python part {sc['python_ns']:.0f} ns ({100 * sc['python_share']:.0f}%; "
                     f"native call stubbed, CPU time, slowest rank)")
    return lines
