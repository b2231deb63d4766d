"""``zbccl info``: environment, topology, shared-memory capacity, native build, configuration."""

from __future__ import annotations

import json
import platform
import sys

from .. import env
from .._version import __version__
from ..errors import ZbcclInvalidUsageError

__all__ = ["collect_info", "display_value", "native_lines", "print_info"]


def _cpu() -> dict:
    from ..bootstrap.topology import cpu_model

    model, flags = cpu_model(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    wanted = ["avx2", "avx512f", "avx512bw", "avx512_bf16", "amx_tile", "asimd", "sve"]
    return {"model": model, "arch": platform.machine(), "features": [f for f in wanted if f in flags]}


def _threads(plan, cpus: frozenset[int], torch_threads: int) -> dict:
    """zbccl's thread decision for this process alone, and whether it changes torch's setting."""
    try:
        want = env.THREADS.get()
    except ZbcclInvalidUsageError as exc:  # info reports a bad setting instead of failing on it
        return {"zbccl_threads_alone": None, "sets_torch_threads": False, "policy": f"invalid: {exc}"}
    ours, for_torch = plan(want, cpus, [cpus], torch_threads)
    policy = {True: f"ZBCCL_THREADS={want}: zbccl uses {want} and sets torch's intra-op threads to {want}",
              False: "ZBCCL_THREADS=0: zbccl follows torch's setting" if want == 0 else
              "default: this rank's cores divided by the local ranks pinned to them (decided at init from "
              "every local rank's affinity); torch's threads are left alone"}[for_torch is not None]
    return {"zbccl_threads_alone": ours, "sets_torch_threads": for_torch is not None, "policy": policy}


def _value(var: env.EnvVar) -> str:
    """The variable's value in effect, or ``invalid: <why>`` (what init would refuse)."""
    try:
        return display_value(var.name, var.get())
    except ZbcclInvalidUsageError as exc:
        return f"invalid: {exc}"


def collect_info() -> dict:
    """Everything ``zbccl info`` reports, as a dict (no process group needed)."""
    import torch

    from ..bootstrap.topology import format_cpus, local_host_info
    from ..heap.capacity import shm_capacity
    from ..runtime.threads import plan_threads

    host = local_host_info()
    try:
        from .. import native

        native_status = native.status()
    except Exception as exc:  # noqa: BLE001 - report, don't fail
        native_status = {"error": str(exc)}
    return {
        "zbccl": __version__,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu": _cpu(),
        "topology": {"hostname": host.hostname, "host_id": host.host_id, "usable_cores": host.cores,
                     "affinity": format_cpus(host.cpus), "torch_threads": torch.get_num_threads()},
        "threads": _threads(plan_threads, frozenset(host.cpus), torch.get_num_threads()),
        "shared_memory": shm_capacity(),
        "native": native_status,
        "transports": _transports(),
        "tuning": _tuning(),
        "config": {v.name: {"value": _value(v), "set": v.is_set(), "doc": v.doc} for v in env.VARIABLES},
    }


def _tuning() -> dict:
    """This host's tuning table: where it comes from, and the inter-host choices it gives (those of rank 0's
    table are a communicator's); ``{"error"}`` for a table that would fail the first op."""
    from ..errors import ZbcclInvalidUsageError
    from ..ops.tuner import TuningTable, hosts_settings

    try:
        table = TuningTable.load()
    except ZbcclInvalidUsageError as exc:
        return {"error": str(exc)}
    return {"source": table.source, "hosts": hosts_settings(table.hosts), "hosts_set": sorted(table.hosts)}


def tuning_line(tuning: dict) -> str:
    """``zbccl info``'s tuning line: the table's source and the inter-host choices."""
    if "error" in tuning:
        return f"tuning     error: {tuning['error']}"
    h = tuning["hosts"]
    size = lambda v: "never" if v is None else env.format_size(v)  # noqa: E731
    hier = ", ".join(f"{op} {'never' if v is None else 'from ' + env.format_size(v)}"
                     for op, v in h["hier_min"].items())
    given = ", ".join(tuning["hosts_set"])
    return (f"tuning     {tuning['source']}; between hosts ({given + ' from the table' if given else 'the defaults'}): "
            f"chunk {size(h['chunk'])}, direct pieces over {size(h['direct_min'])}, hierarchical {hier}, "
            f"two phases up to {size(h['column_max'])}, relayed small steps {'on' if h['relay'] else 'off'}")


def _transports() -> dict:
    """The registered transports, and what the mooncake transport gets here: the protocol asked for
    (``ZBCCL_MOONCAKE_PROTOCOL``) and the one Mooncake actually runs (a throwaway engine on loopback:
    ``rdma`` falls back to TCP without an HCA)."""
    from ..heap import transports
    from ..heap.transports.mooncake import missing_reason

    out: dict = {"registered": [e.name for e in transports.entries() if e.target is not None]}
    reason = missing_reason()
    mc: dict = {"available": reason is None, "protocol": env.MOONCAKE_PROTOCOL.get()}
    if reason is not None:
        mc["reason"] = reason
    else:
        try:
            from importlib.metadata import version

            from ..heap.transports.mooncake.engine import MooncakeEngine

            for dist in ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine"):
                try:
                    mc["wheel"] = f"{dist} {version(dist)}"
                    break
                except Exception:  # noqa: BLE001 - not this wheel
                    continue
            mc["transport"] = MooncakeEngine("127.0.0.1", protocol=mc["protocol"],
                                             device=env.MOONCAKE_DEVICE.get()).transport
        except Exception as exc:  # noqa: BLE001 - report, don't fail
            mc["error"] = str(exc)
    out["mooncake"] = mc
    return out


#: Variables whose -1 means "decided at init" (see their docs in zbccl.env).
_AUTO_NEGATIVE = ("ZBCCL_WAIT_SPIN", "ZBCCL_WAIT_POLL_US", "ZBCCL_THREADS")
#: Variables holding a byte count.
_SIZES = ("ZBCCL_HEAP_SIZE", "ZBCCL_HEAP_MAX", "ZBCCL_SMA_CACHE_LIMIT", "ZBCCL_CUDA_HEAP_SIZE", "ZBCCL_CUDA_HEAP_MAX")


def display_value(name: str, value: object) -> str:
    """A configuration value as a person reads it: ``auto`` for the decided-at-init defaults (None,
    -1), ``unlimited`` for the no-limit sentinel (>= 2**62), sizes as ``256M``, empty as ``(none)``."""
    if value is None or (name in _AUTO_NEGATIVE and isinstance(value, (int, float)) and value < 0):
        return "auto"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, int) and value >= 1 << 62:
        return "unlimited"
    if name in _SIZES and isinstance(value, int):
        return env.format_size(value)
    if value == "":
        return "(none)"
    return str(value)


def native_lines(native: dict) -> list[str]:
    if "error" in native and len(native) == 1:
        return [f"  unavailable: {native['error']}"]
    lines = []
    for name, row in native.items():
        if row.get("built"):
            how = row.get("origin", "built")
            if row.get("build_seconds") is not None:
                how += f", built in {row['build_seconds']} s"
            state = f"{how}{', loaded' if row.get('loaded') else ''}: {row.get('path')}"
        else:
            state = f"not built ({row.get('error') or 'builds at the first zbccl.init, or run zbccl build'})"
        lines.append(f"  {name:<16} {state}")
        if row.get("error") and row.get("built"):
            lines.append(f"  {'':<16} error: {row['error']}")
    return lines


def print_info(*, as_json: bool = False) -> None:
    info = collect_info()
    if as_json:
        print(json.dumps(info, indent=2, default=str))
        return
    print(f"zbccl {info['zbccl']}  python {info['python']}  torch {info['torch']}")
    print(f"platform   {info['platform']}")
    cpu = info["cpu"]
    print(f"cpu        {cpu['model']} ({cpu['arch']}; {' '.join(cpu['features']) or 'no SIMD flags found'})")
    topo = info["topology"]
    print(f"host       {topo['hostname']} id={topo['host_id']} usable_cores={topo['usable_cores']} "
          f"affinity={topo['affinity']} torch_threads={topo['torch_threads']}")
    thr = info["threads"]
    print(f"threads    zbccl {thr['zbccl_threads_alone']} (as the only local rank); "
          f"{'changes' if thr['sets_torch_threads'] else 'leaves'} torch's threads; {thr['policy']}")
    shm = info["shared_memory"]
    print("shared mem " + "  ".join(f"{k}={env.format_size(v) if v is not None else 'n/a'}" for k, v in shm.items()))
    print("native")
    for line in native_lines(info["native"]):
        print(line)
    tr = info["transports"]
    mc = tr["mooncake"]
    if mc["available"]:
        got = mc.get("transport") or f"error: {mc.get('error')}"
        state = f"{mc.get('wheel', 'installed')}; asked {mc['protocol']}, got {got}"
    else:
        state = f"unavailable: {mc['reason']}"
    print(f"transports {', '.join(tr['registered'])}")
    print(f"  mooncake {state}")
    print(tuning_line(info["tuning"]))
    print("config")
    for name, c in info["config"].items():
        print(f"  {name:<24} {c['value']:<28} {'(set)' if c['set'] else '(default)'}")
