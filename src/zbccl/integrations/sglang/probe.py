"""What each SGLang TP worker reports about its communication, in ``/server_info``.

* :func:`add_internal_state` (an AFTER hook of ``Scheduler.get_internal_state``, registered with
  ``ZBCCL_ENABLE=1`` or ``ZBCCL_SGLANG_PROBE=1``): every TP rank of the scheduler answers SGLang's
  ``GetInternalStateReq`` (control requests are broadcast to all TP ranks), so each gathers its
  peers' :func:`local_stats` over the TP group's gloo ``cpu_group`` and adds the list as
  ``internal_state["zbccl"]``. It is read through ``GET /server_info`` (``internal_states[0]``) or
  ``Engine.get_server_info()``.
* With ``ZBCCL_SGLANG_PROBE=1`` (benchmarks, tests) :func:`probe_hooks` also times, on either path
  (SGLang's own or zbccl's), every routed ``GroupCoordinator`` op of the routed groups and the
  model forward: per op the call count, summed host ns (``time.perf_counter_ns``, one clock for
  every process of the host) and each call's (entry, exit), up to :data:`MAX_SPANS` per op, so a
  driver can take, per call, the time from the last rank's entry to the last rank's exit
  (:func:`zbccl.integrations.vllm.probe.last_arrival_ns` reads the same shape).
"""

from __future__ import annotations

import os
import sys
import time

__all__ = ["MAX_SPANS", "add_internal_state", "local_stats", "probe_hooks"]

MAX_SPANS = 1 << 16
"""Calls per op whose (entry, exit) times are kept; later calls are summed only."""

_GC = "sglang.srt.distributed.parallel_state.GroupCoordinator"
_MR = "sglang.srt.model_executor.model_runner.ModelRunner"
_SCHED = "sglang.srt.managers.scheduler.Scheduler"
_times: dict[str, list[int]] = {}
_spans: dict[str, list[list[int]]] = {}


def _timed(name: str):
    """AROUND hook of ``GroupCoordinator.<name>``: its host time on a routed group (either path)."""
    from .group import ROUTED_GROUPS

    clock = time.perf_counter_ns

    def hook(original, gc, *args, **kwargs):
        if gc.world_size <= 1 or gc.unique_name.split(":")[0] not in ROUTED_GROUPS:
            return original(gc, *args, **kwargs)
        t0 = clock()
        try:
            return original(gc, *args, **kwargs)
        finally:
            t1 = clock()
            key = f"{gc.unique_name}.{name}"
            rec = _times.get(key)
            if rec is None:
                rec = _times[key] = [0, 0]
                _spans[key] = []
            rec[0] += 1
            rec[1] += t1 - t0
            spans = _spans[key]
            if len(spans) < MAX_SPANS:
                spans.append([t0, t1])

    hook.__name__ = hook.__qualname__ = f"zbccl_probe_{name}"
    return hook


def _timed_forward(original, runner, *args, **kwargs):
    t0 = time.perf_counter_ns()
    try:
        return original(runner, *args, **kwargs)
    finally:
        rec = _times.setdefault("forward", [0, 0])
        rec[0] += 1
        rec[1] += time.perf_counter_ns() - t0


def probe_hooks(already: list[str] = ()) -> list[tuple[str, object, str]]:
    """(target, hook, HookType name) of the timing probe; registered after the routing hooks, so each
    wraps the routed op (HookRegistry wraps in registration order: the last registered is outermost)."""
    from .group import ROUTES

    hooks = [(f"{_GC}.{name}", _timed(name), "AROUND") for name in ROUTES if name != "destroy"]
    hooks.append((f"{_MR}.forward", _timed_forward, "AROUND"))
    if f"{_SCHED}.get_internal_state" not in already:
        hooks.append((f"{_SCHED}.get_internal_state", add_internal_state, "AFTER"))
    return hooks


def _mapped_segments() -> list[str]:
    """The zbccl heap segments this process maps (``/memfd:zbccl-...`` in /proc/self/maps)."""
    mark = "/memfd:zbccl-"
    try:
        with open("/proc/self/maps") as f:
            return sorted({ln[ln.index(mark) + 1:].split(" ")[0] for ln in f if mark in ln})
    except OSError:
        return []


def local_stats() -> dict:
    """This worker's communication: its zbccl groups and calls, heap statistics, mapped segments and,
    with the probe, per-op times and spans."""
    import torch
    import torch.distributed as dist

    from . import group

    out = {"pid": os.getpid(), "rank": dist.get_rank() if dist.is_initialized() else 0,
           "zbccl": group.running(), "fallback": group._start["reason"], "groups": group.stats(),
           "mapped": _mapped_segments(), "threads": torch.get_num_threads(),
           "times": {k: list(v) for k, v in _times.items()}, "spans": {k: list(v) for k, v in _spans.items()}}
    ep = sys.modules.get("zbccl.integrations.sglang.ep")  # imported only where the EP dispatcher was asked for
    out["ep"] = dict(ep.counts) if ep is not None else None
    if group.running():
        from ...adapters.tensors import memory_stats

        out["memory"] = {k: v for k, v in memory_stats().items() if isinstance(v, (int, float))}
    return out


def add_internal_state(result, scheduler, *args, **kwargs):
    """AFTER hook of ``Scheduler.get_internal_state``: every TP rank's :func:`local_stats`, in rank order."""
    import torch.distributed as dist

    mine = local_stats()
    tp = scheduler.tp_group
    if tp.world_size > 1:
        every = [None] * tp.world_size
        dist.all_gather_object(every, mine, group=tp.cpu_group)  # the control path: gloo, as SGLang's
    else:
        every = [mine]
    state = getattr(result, "internal_state", None)
    if isinstance(state, dict):
        state["zbccl"] = every
    return result

