"""The auto-tuner's table: which algorithm per (op, dtype, bytes, world size, host).

zbccl ships defaults measured on small x86 hosts. ``zbccl tune`` measures this
machine and saves a table under ``ZBCCL_CACHE_DIR/tuning/<host>.json`` (or
``ZBCCL_TUNE_FILE``). A communicator uses rank 0's table, shared through the
bootstrap store on its first collective, so every rank picks the same
algorithm. ``ZBCCL_ALGO=all_reduce=twoshot,...`` forces a choice (debugging).
"""

from __future__ import annotations

import hashlib
import json
import platform
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import env
from ..errors import ZbcclInvalidUsageError
from .plan import ALGO_CODES, OP_ALGOS

__all__ = ["TuningTable", "DEFAULT_RULES", "DEFAULT_CHUNK", "table_for", "host_key", "table_path", "force_algorithm"]

#: op -> list of [max_bytes (inclusive), algorithm(, chunk bytes)]; the last rule has max_bytes -1
#: (any size). The chunk is the pipelining unit of chunked algorithms (twoshot).
DEFAULT_CHUNK = 1 << 20
DEFAULT_RULES: dict[str, list[list]] = {
    # twoshot won at every size measured on 2-core hosts (4 KiB: 3.0 vs 3.3 us at world 2,
    # equal at world 4); 'zbccl tune' finds where oneshot pays on hosts with more ranks.
    "all_reduce": [[-1, "twoshot", DEFAULT_CHUNK]],
    "all_gather": [[-1, "pull"]],
    "reduce_scatter": [[-1, "pull"]],
    "all_to_all": [[-1, "pull"]],
    "broadcast": [[-1, "pull"]],
}


def host_key() -> str:
    """What makes tuning results transferable: CPU model, usable cores, world-independent."""
    from ..bootstrap.topology import cpu_model, usable_cores

    cpu = cpu_model()
    raw = f"{platform.machine()}|{cpu}|{usable_cores()}"
    return hashlib.sha1(raw.encode()).hexdigest()[:12]


def table_path() -> Path:
    explicit = env.TUNE_FILE.get()
    if explicit:
        return Path(explicit)
    return env.CACHE_DIR.get() / "tuning" / f"{host_key()}.json"


@dataclass
class TuningTable:
    """Rules per op and world size: ``rules[op][str(world)]`` or ``rules[op]["*"]``."""

    rules: dict[str, dict[str, list[list]]] = field(default_factory=dict)
    forced: dict[str, str] = field(default_factory=dict)
    source: str = "defaults"

    @classmethod
    def defaults(cls) -> TuningTable:
        return cls({op: {"*": r} for op, r in DEFAULT_RULES.items()})

    @classmethod
    def load(cls) -> TuningTable:
        table = cls.defaults()
        path = table_path()
        if path.is_file():
            data = json.loads(path.read_text())
            for op, per_world in data.get("rules", {}).items():
                table.rules.setdefault(op, {}).update(per_world)
            table.source = str(path)
        table.forced = parse_forced(env.ALGO.get())
        return table

    def to_json(self) -> str:
        return json.dumps({"rules": self.rules, "forced": self.forced, "source": self.source})

    @classmethod
    def from_json(cls, text: str) -> TuningTable:
        d = json.loads(text)
        return cls(d["rules"], d.get("forced", {}), d.get("source", "?"))

    def choose(self, op: str, dtype: torch.dtype, nbytes: int, world_size: int) -> tuple[int, int]:
        """``(algorithm code, chunk bytes)`` for this op, size and world size."""
        per_world = self.rules.get(op, {})
        rules = per_world.get(str(world_size)) or per_world.get("*") or [[-1, OP_ALGOS[op][0]]]
        rule = next((r for r in rules if r[0] < 0 or nbytes <= r[0]), rules[-1])
        chunk = int(rule[2]) if len(rule) > 2 else DEFAULT_CHUNK
        if op in self.forced:
            return ALGO_CODES[self.forced[op]], chunk
        return ALGO_CODES[rule[1]], chunk


def parse_forced(text: str) -> dict[str, str]:
    forced = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        op, _, algo = item.partition("=")
        if op not in OP_ALGOS or algo not in OP_ALGOS[op]:
            raise ZbcclInvalidUsageError(
                f"ZBCCL_ALGO: bad entry, expected op=algo with algo in {OP_ALGOS.get(op, OP_ALGOS)}, got {item!r}")
        forced[op] = algo
    return forced


def table_for(ch) -> TuningTable:
    """The communicator's table: rank 0's, shared through the store on first use."""
    table = getattr(ch, "tuning", None)
    if table is None:
        comm = ch.comm
        if comm.rank == 0:
            table = TuningTable.load()
            comm.bootstrap.set("tuning", table.to_json().encode())
        else:
            table = TuningTable.from_json(comm.bootstrap.get("tuning", timeout=comm.timeout,
                                                             owner=comm.ranks[0]).decode())
        ch.tuning = table
    return table


def force_algorithm(comm, op: str, algo: str | None) -> None:
    """Force (or with None, release) ``op``'s algorithm on ``comm`` for this rank.

    For tests and ``zbccl tune``: every rank must make the same call, as the
    choice is checked in each op's handshake.
    """
    from .channel import channel_of

    if algo is not None and algo not in OP_ALGOS.get(op, ()):
        raise ZbcclInvalidUsageError(f"force_algorithm: expected one of {OP_ALGOS.get(op)}, got {algo!r}")
    ch = channel_of(comm)
    table = table_for(ch)
    if algo is None:
        table.forced.pop(op, None)
    else:
        table.forced[op] = algo
    ch.choices.clear()
