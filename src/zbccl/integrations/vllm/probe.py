"""Worker-side probes for tests and benchmarks, run through ``LLM.collective_rpc(fn)``.

* :func:`start_timing` wraps the TP/PP device communicators of the calling worker (vLLM's own or
  zbccl's) so that every collective's host time is summed per op (``time.perf_counter_ns``
  around the call: the communication time of a step, for either communicator alike).
* :func:`stats` returns those sums, the communicator class per group, zbccl's
  ``memory_stats()`` (``staged_bytes``: bytes copied into the heap because an operand was not a
  heap tensor) and the bytes vLLM's shm buffers take for the same groups.
"""

from __future__ import annotations

import functools
import time

import torch

__all__ = ["start_timing", "stats", "vllm_shm_bytes"]

_OPS = ("all_reduce", "all_gather", "all_gatherv", "reduce_scatter", "reduce_scatterv", "gather",
        "broadcast", "send", "recv", "send_tensor_dict", "recv_tensor_dict")
_times: dict[str, list[int]] = {}
_staged = [0]


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
    _staged[0] = _staged_bytes()
    for g in _groups():
        dc = g.device_communicator
        for name in _OPS:
            fn = getattr(dc, name, None)
            if fn is None or getattr(fn, "_zbccl_timed", False):
                continue
            setattr(dc, name, _timed(f"{g.unique_name}.{name}", fn))


def _timed(key: str, fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        t0 = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            rec = _times.setdefault(key, [0, 0])
            rec[0] += 1
            rec[1] += time.perf_counter_ns() - t0

    run._zbccl_timed = True
    return run


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
           "groups": {g.unique_name: type(g.device_communicator).__name__ + (
               "[zbccl]" if getattr(g.device_communicator, "zb", None) is not None else "")
               for g in _groups()},
           "vllm_shm_bytes": sum(vllm_shm_bytes(g.world_size) for g in _groups()),
           "threads": torch.get_num_threads(), "dev_shm_cpushm_bytes": _dev_shm_bytes("cpushm")}
    if get_default() is not None:
        out["staged_bytes_timed"] = _staged_bytes() - _staged[0]

        out["zbccl"] = {k: v for k, v in memory_stats().items() if isinstance(v, (int, float))}
    return out
