"""Worker-side probes for tests and benchmarks, run through ``LLM.collective_rpc(fn)``.

* :func:`start_timing` wraps the TP/PP device communicators of the calling worker (vLLM's own or
  zbccl's) so that every collective's host time is summed per op (``time.perf_counter_ns``
  around the call: the communication time of a step, for either communicator alike), and each
  call's entry and exit times are kept (up to :data:`MAX_SPANS` per op). ``perf_counter_ns`` is
  ``CLOCK_MONOTONIC``, one clock for every process of the host, so the ranks' spans of the i-th
  call of an op line up: :func:`last_arrival_ns` turns them into the time from the last rank's
  entry to the last rank's exit, the op's own cost without the ranks' compute skew. With zbccl it
  also counts the all_reduce calls that missed the hot path (no plan for that tensor yet), and
  times each group's native op calls (``native``: calls and summed ns), so that a step's
  communication splits into the native op and the Python around it.
* :func:`stats` returns those sums, the communicator class per group, zbccl's
  ``memory_stats()`` (``staged_bytes``: bytes copied into the heap because an operand was not a
  heap tensor) and the bytes vLLM's shm buffers take for the same groups.
"""

from __future__ import annotations

import functools
import time

import torch

__all__ = ["MAX_SPANS", "last_arrival_ns", "start_timing", "stats", "vllm_shm_bytes"]

MAX_SPANS = 1 << 16
"""Calls per op whose (entry, exit) times are kept; later calls are summed only."""

_OPS = ("all_reduce", "all_gather", "all_gatherv", "reduce_scatter", "reduce_scatterv", "gather",
        "broadcast", "send", "recv", "send_tensor_dict", "recv_tensor_dict")
_times: dict[str, list[int]] = {}
_spans: dict[str, list[tuple[int, int]]] = {}
_staged = [0]
_slow = [0]
_native: dict[str, list[int]] = {}
_native_spans: dict[str, list[tuple[int, int]]] = {}


def _staged_bytes() -> int:
    from ...adapters.tensors import memory_stats
    from ...runtime.registry import get_default

    if get_default() is None:
        return 0
    return int(memory_stats()["staged_bytes"])


def _groups():
    from vllm.distributed import parallel_state as ps

    return [g for g in (ps._TP, ps._PP) if g is not None and g.device_communicator is not None]


def start_timing(worker=None) -> None:
    """Collective-free: from now on sum each op's host time on this worker's TP/PP communicators."""
    _times.clear()
    _spans.clear()
    _native.clear()
    _native_spans.clear()
    _staged[0] = _staged_bytes()
    _count_slow_all_reduce()
    for g in _groups():
        dc = g.device_communicator
        if getattr(dc, "zb", None) is not None:
            _time_native(g.unique_name, dc.zb)
        for name in _OPS:
            fn = getattr(dc, name, None)
            if fn is None or getattr(fn, "_zbccl_timed", False):
                continue
            setattr(dc, name, _timed(f"{g.unique_name}.{name}", fn))


def _native_timer(key: str, run):
    """``run`` (a native call) with its time summed under ``key`` and its span kept. A hot-entry
    call that did not serve the tensor (-1) is not counted: the Python path's own call is."""
    rec = _native.setdefault(key, [0, 0])
    spans = _native_spans.setdefault(key, [])
    clock = time.perf_counter_ns

    def timed(*args):
        t0 = clock()
        rc = -1
        try:
            rc = run(*args)
            return rc
        finally:
            if rc != -1:
                t1 = clock()
                rec[0] += 1
                rec[1] += t1 - t0
                if len(spans) < MAX_SPANS:
                    spans.append((t0, t1))

    timed._zbccl_timed = True
    timed.__wrapped__ = run
    return timed


def _time_native(key: str, comm) -> None:
    """Sum the time of ``comm``'s native op calls (its channel's ``chan_run`` or ``hot_submit``, and hot entries)
    under ``key``."""
    from ...ops.channel import channel_of

    ch = channel_of(comm)
    for name in ("_chan_run", "_hot_submit", "hot", "hot_gather"):  # every way into a native op
        fn = getattr(ch, name, None)
        if fn is not None:
            setattr(ch, name, _native_timer(key, getattr(fn, "__wrapped__", fn)))


def _count_slow_all_reduce() -> None:
    """Count zbccl all_reduce calls that miss the hot path (a tensor no plan was made for yet)."""
    from ...ops import allreduce
    from ...runtime.registry import get_default

    _slow[0] = 0
    if get_default() is None:
        return
    slow = allreduce._all_reduce
    if getattr(slow, "_zbccl_counted", False):
        return

    @functools.wraps(slow)
    def counted(*args, **kwargs):
        _slow[0] += 1
        return slow(*args, **kwargs)

    counted._zbccl_counted = True
    allreduce._all_reduce = counted


def _timed(key: str, fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        t0 = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            t1 = time.perf_counter_ns()
            rec = _times.setdefault(key, [0, 0])
            rec[0] += 1
            rec[1] += t1 - t0
            spans = _spans.setdefault(key, [])
            if len(spans) < MAX_SPANS:
                spans.append((t0, t1))

    run._zbccl_timed = True
    return run


def last_arrival_ns(workers: list[dict]) -> dict[str, int]:
    """Per op, the summed time from the last rank's entry to the last rank's exit, from :func:`stats`.

    ``workers`` are the ranks' :func:`stats` of one group (every rank calls the group's collectives in
    the same order, so the i-th span of an op is the same call everywhere). Waiting for a rank
    whose compute finished later is not counted; what is left is the collective itself plus the
    communicator's entry and exit on the rank that came last. Ops that not every rank recorded
    (send/recv, a rank over :data:`MAX_SPANS`) count only their common calls.
    """
    keys = set.intersection(*(set(w.get("spans", {})) for w in workers)) if workers else set()
    out = {}
    for key in sorted(keys):
        calls = zip(*(w["spans"][key] for w in workers))
        out[key] = sum(max(t1 for _, t1 in call) - max(t0 for t0, _ in call) for call in calls)
    return out


def vllm_shm_bytes(world_size: int, threads: int | None = None) -> int:
    """vLLM 0.32's shm segment of one group and rank (csrc/cpu/shm.cpp):
    round64(threads * sizeof(ThreadSHMContext)) + threads * 4 MiB, with sizeof taken as 256 B (a
    1-thread segment measures 4 MiB + 256 B in /dev/shm). Independent of ``world_size``.
    """
    threads = torch.get_num_threads() if threads is None else threads
    ctx = threads * 256
    return ((ctx + 63) // 64) * 64 + threads * (4 << 20)


def _dev_shm_bytes(word: str) -> int:
    """Bytes of the /dev/shm files whose name holds ``word`` (vLLM's shm segments: ``...-cpushm...``)."""
    import os

    total = 0
    for name in os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else ():
        if word in name:
            try:
                total += os.stat(os.path.join("/dev/shm", name)).st_size
            except OSError:
                pass
    return total


def stats(worker=None) -> dict:
    """This worker's communication times, communicator kinds, zbccl heap stats and vLLM shm bytes."""
    from ...adapters.tensors import memory_stats
    from ...runtime.registry import get_default

    out = {"times": {k: tuple(v) for k, v in _times.items()},
           "spans": {k: list(v) for k, v in _spans.items()},
           "native": {k: tuple(v) for k, v in _native.items()},
           "native_spans": {k: list(v) for k, v in _native_spans.items()},
           "groups": {g.unique_name: type(g.device_communicator).__name__ + (
               "[zbccl]" if getattr(g.device_communicator, "zb", None) is not None else "")
               for g in _groups()},
           "vllm_shm_bytes": sum(vllm_shm_bytes(g.world_size) for g in _groups()),
           "threads": torch.get_num_threads(), "dev_shm_cpushm_bytes": _dev_shm_bytes("cpushm")}
    if get_default() is not None:
        out["staged_bytes_timed"] = _staged_bytes() - _staged[0]
        out["all_reduce_slow_path_calls"] = _slow[0]

        out["zbccl"] = {k: v for k, v in memory_stats().items() if isinstance(v, (int, float))}
    return out
