"""The auto-tuner's table: which algorithm per (op, dtype, bytes, world size, host).

zbccl ships defaults measured on small x86 hosts. ``zbccl tune`` measures this
machine and saves a table under ``ZBCCL_CACHE_DIR/tuning/<host>.json`` (or
``ZBCCL_TUNE_FILE``). A communicator uses rank 0's table, shared through the
bootstrap store on its first collective, so every rank picks the same
algorithm. ``ZBCCL_ALGO=all_reduce=twoshot,...`` forces a choice (debugging).

Every field of a loaded table is validated (:func:`validate_rules`). A bad
file or ``ZBCCL_ALGO`` on rank 0 is shared through the store in the table's
place, so every rank raises the same :class:`ZbcclInvalidUsageError` at the
communicator's first collective instead of rank 0 failing and the rest hanging.

:func:`choose` reads the table (cached per communicator). The one decision made at run time,
cached or streaming stores for all_reduce's pushes, is native: group rank 0 measures both and
chooses for the group (:func:`store_kind_mode`, ``native/csrc/core/kind.c`` "Store kind").
"""

from __future__ import annotations

import hashlib
import json
import platform
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .. import env
from ..errors import ZbcclInvalidUsageError
from ..native.abi import ALGO_NAMES, OP_NAMES

if TYPE_CHECKING:
    from .channel import OpChannel

__all__ = ["TuningTable", "DEFAULT_RULES", "DEFAULT_CHUNK", "MIN_CHUNK", "MAX_CHUNK", "OP_ALGOS", "ALGO_CODES",
           "table_for", "host_key", "table_path", "force_algorithm", "validate_rules", "load_file", "choose",
           "store_kind_mode", "HOSTS_CHUNK", "HOSTS_HIER_MIN", "HOSTS_DIRECT_MIN", "HOSTS_COLUMN_MAX",
           "HOSTS_DEFAULTS", "validate_hosts", "hosts_settings", "read_file", "hosts_chunk", "hosts_hierarchical",
           "EP_HOSTS_EAGER", "ep_hosts_eager"]

#: Algorithm name -> code (``native/abi.py``).
ALGO_CODES = {v: k for k, v in ALGO_NAMES.items()}
#: Algorithms each op implements (the first is the fallback).
OP_ALGOS = {
    "all_reduce": ("twoshot", "oneshot"),
    "all_gather": ("pull", "push"),
    "reduce_scatter": ("pull",),
    "all_to_all": ("pull", "push"),
    "broadcast": ("pull",),
}

#: op -> list of [max_bytes (inclusive), algorithm(, chunk bytes)]; the last rule has max_bytes -1
#: (any size). The chunk is the pipelining unit of chunked algorithms (twoshot).
DEFAULT_CHUNK = 1 << 20
#: Bounds of a rule's chunk bytes: a cache line, and a size whose chunk count stays small.
MIN_CHUNK, MAX_CHUNK = 64, 1 << 30
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


def _bad(where: str, source: str, expected: str, got: object) -> ZbcclInvalidUsageError:
    return ZbcclInvalidUsageError(f"tuning: bad {where} in {source}, expected {expected}, got {got!r}")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_rule(op: str, where: str, rule: object, prev: int | None, last: bool, source: str) -> int:
    """Validate one ``[max_bytes, algorithm(, chunk)]`` rule; returns its max_bytes."""
    if not isinstance(rule, list) or len(rule) not in (2, 3):
        raise _bad(where, source, "a rule [max_bytes, algorithm] or [max_bytes, algorithm, chunk]", rule)
    size, algo = rule[0], rule[1]
    if not _is_int(size) or size < -1:
        raise _bad(f"{where} max_bytes", source, "a non-negative int, or -1 for any size", size)
    if size == -1 and not last:
        raise _bad(f"{where} max_bytes", source, "-1 (any size) only in the last rule", size)
    if size >= 0 and prev is not None and size <= prev:
        raise _bad(f"{where} max_bytes", source, f"sizes ascending, above {prev}", size)
    if algo not in OP_ALGOS[op]:
        raise _bad(f"{where} algorithm", source, f"one of {OP_ALGOS[op]}", algo)
    if len(rule) == 3 and (not _is_int(rule[2]) or not MIN_CHUNK <= rule[2] <= MAX_CHUNK):
        raise _bad(f"{where} chunk", source, f"an int of {MIN_CHUNK}..{MAX_CHUNK} bytes", rule[2])
    return size


def validate_rules(rules: object, *, source: str) -> dict[str, dict[str, list[list]]]:
    """``rules`` if every field is valid, else :class:`ZbcclInvalidUsageError` naming the field.

    Shape: ``{op: {world: [[max_bytes, algorithm(, chunk)], ...]}}`` with ``op`` a
    collective, ``world`` ``"*"`` or a world size >= 1, ``max_bytes`` ascending
    non-negative ints with -1 (any size) only last, ``algorithm`` one of the op's,
    and ``chunk`` within :data:`MIN_CHUNK`..:data:`MAX_CHUNK`.
    """
    if not isinstance(rules, dict):
        raise _bad("rules", source, "an object {op: {world size: [rules]}}", type(rules).__name__)
    for op, per_world in rules.items():
        if op not in OP_ALGOS:
            raise _bad("op name", source, f"one of {tuple(OP_ALGOS)}", op)
        if not isinstance(per_world, dict):
            raise _bad(f"rules of {op}", source, "an object {world size: [rules]}", type(per_world).__name__)
        for world, rows in per_world.items():
            if world != "*" and not (isinstance(world, str) and re.fullmatch(r"[1-9][0-9]{0,5}", world)):
                raise _bad(f"world size key of {op}", source, '"*" or a world size >= 1', world)
            if not isinstance(rows, list) or not rows:
                raise _bad(f"rules of {op}[{world}]", source, "a non-empty list of rules", rows)
            prev = None
            for i, rule in enumerate(rows):
                size = _check_rule(op, f"rule {op}[{world}][{i}]", rule, prev, i == len(rows) - 1, source)
                prev = size if size >= 0 else prev
    return rules


def load_file(path: Path) -> dict[str, dict[str, list[list]]]:
    """The validated ``rules`` of a tuning file written by ``zbccl tune``."""
    return validate_rules(read_file(path)["rules"], source=str(path))


def read_file(path: Path) -> dict:
    """A tuning file's JSON object (it has ``"rules"``; ``"hosts"``, when present, is validated); raises
    :class:`ZbcclInvalidUsageError` on an unreadable or malformed one."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ZbcclInvalidUsageError(
            f"tuning: cannot read {path}, expected a JSON table written by 'zbccl tune', got {exc}") from exc
    if not isinstance(data, dict) or "rules" not in data:
        raise _bad("table", str(path), 'an object with "rules"', type(data).__name__ if not isinstance(data, dict)
                   else sorted(data))
    if "hosts" in data:
        validate_hosts(data["hosts"], source=str(path))
    return data


@dataclass
class TuningTable:
    """Rules per op and world size: ``rules[op][str(world)]`` or ``rules[op]["*"]``."""

    rules: dict[str, dict[str, list[list]]] = field(default_factory=dict)
    forced: dict[str, str] = field(default_factory=dict)
    source: str = "defaults"
    #: The file's ``"hosts"`` section (the inter-host choices it sets: :func:`hosts_settings`).
    hosts: dict = field(default_factory=dict)

    @classmethod
    def defaults(cls) -> TuningTable:
        return cls({op: {"*": r} for op, r in DEFAULT_RULES.items()})

    @classmethod
    def load(cls) -> TuningTable:
        """Defaults, overlaid with this host's tuning file; raises on a bad file or ``ZBCCL_ALGO``."""
        table = cls.defaults()
        path = table_path()
        if path.is_file() or env.TUNE_FILE.get():  # a named file must exist
            data = read_file(path)
            for op, per_world in validate_rules(data["rules"], source=str(path)).items():
                table.rules.setdefault(op, {}).update(per_world)
            table.hosts = data.get("hosts", {})
            table.source = str(path)
        table.forced = parse_forced(env.ALGO.get())
        return table

    def to_json(self) -> str:
        return json.dumps({"rules": self.rules, "forced": self.forced, "source": self.source, "hosts": self.hosts})

    @classmethod
    def from_json(cls, text: str) -> TuningTable:
        d = json.loads(text)
        return cls(d["rules"], d.get("forced", {}), d.get("source", "?"), d.get("hosts", {}))

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
    """The communicator's table: rank 0's, shared through the store on first use.

    If rank 0 cannot load its table it shares the error text instead, and every
    rank raises the same :class:`ZbcclInvalidUsageError` (at every later use too).
    """
    table = getattr(ch, "tuning", None)
    if table is None:
        comm = ch.comm
        if comm.rank == 0:
            try:
                shared = TuningTable.load().to_json()
            except ZbcclInvalidUsageError as exc:
                shared = json.dumps({"error": str(exc)})
            comm.bootstrap.set("tuning", shared.encode())
        else:
            shared = comm.bootstrap.get("tuning", timeout=comm.timeout, owner=comm.ranks[0],
                                        watch=getattr(comm, "store_watch", None)).decode()
        error = json.loads(shared).get("error")
        table = TuningTable.from_json(shared) if error is None else error
        ch.tuning = table
    if isinstance(table, str):
        raise ZbcclInvalidUsageError(table, ranks=(0,))  # group rank 0 loaded it
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
    ch.forget_plans()


def choose(ch: OpChannel, opcode: int, dtype: torch.dtype, nbytes: int) -> tuple[int, int]:
    """``(algorithm code, chunk bytes)`` for this op and size, from the communicator's shared table."""
    cache = ch.choices
    key = (opcode, dtype, nbytes)
    algo = cache.get(key)
    if algo is None:
        if len(cache) > 4096:
            cache.clear()
        algo = cache[key] = table_for(ch).choose(OP_NAMES[opcode], dtype, nbytes, ch.world_size)
    return algo


def store_kind_mode() -> int:
    """``ZBCCL_STREAM_STORES`` as the native channel's store-kind mode: -1 auto, 0 cached, 1 streaming.

    The policy itself is native core policy (``native/csrc/core/kind.c``): per log2 size bucket, group rank 0 times
    all_reduce under both kinds and uses the cheaper one for the group, re-measuring the other within
    64 ops or 200 ms.
    """
    mode = env.STREAM_STORES.get().lower()
    kind = {"auto": -1, "off": 0, "on": 1}.get(mode)
    if kind is None:
        raise ZbcclInvalidUsageError(f"ZBCCL_STREAM_STORES: expected auto, on or off, got {mode!r}")
    return kind


#: The collectives across hosts (``ops/hosts``): the pipelining unit of the inter-host steps (one slot of
#: each mesh region), and the size (all the ranks' bytes) from which all_reduce / all_gather take the
#: hierarchical algorithm on a regular topology (below it the flat exchange wins: one step, data in the
#: agreement step's writes; the hierarchical all_gather takes three rounds: 2 x 2 namespace hosts, 1 MiB
#: gathered flat in 2.8 ms and hierarchically in 3.3 ms, 4 MiB in 7.5 and 6.2 ms). all_reduce from 256 KiB
#: since small steps are relayed: ``zbccl tune --hosts``, three runs at 2 x 2, flat 1.2 against hierarchical
#: 1.6-2.0 ms at 16 KiB, 1.5-1.7 against 1.9-2.3 at 64 KiB, even at 256 KiB, 8 against 5 at 1 MiB. broadcast
#: from 4 MiB (1 MiB: flat 3.3 ms, hierarchical 2.9-3.7; 4 MiB 8.7-9.7 against 6.6). reduce_scatter never by
#: default: it halves what crosses at 2 x 2 but never won here (4 MiB of input: 7.9-8.5 against 8.5-9.8 ms; 16
#: MiB: 26.7-30.2 against 25.1-28.8; 64 MiB 96.7-96.9 against 105.5-106.1), where the namespace links are not
#: the bound: ``zbccl tune --hosts`` turns it on where it wins. Interleaved, 2 x 2.
HOSTS_CHUNK = 4 << 20
HOSTS_HIER_MIN = {"all_reduce": 256 << 10, "all_gather": 2 << 20, "broadcast": 4 << 20, "reduce_scatter": None}
#: Bytes over which a member's piece of an all_gather, all_to_all or broadcast across hosts is put straight into
#: its receiver's output (its heap offset comes in the agreement step's header), and a reduce_scatter's into a
#: heap scratch of its receiver, instead of through the slots: two round trips more (the piece waits for the
#: header, a step publishes it), no staging copy, no copy out, no chunk-by-chunk lockstep. A large flat
#: all_reduce runs as such a reduce_scatter, then such an all_gather (``hosts.flat.split``).
HOSTS_DIRECT_MIN = 1 << 20
#: Bytes up to which the hierarchical all_reduce runs as the host's all_reduce and one column step of the whole
#: tensor instead of reduce_scatter, column step, all_gather: 2 x 2 namespace hosts, interleaved, the whole op
#: 9-13 % faster at 64-256 KiB, and 30 % slower at 512 KiB, where each rank's whole tensor crossing costs more
#: than the third phase saves (``docs/benchmarks.md`` A.16).
HOSTS_COLUMN_MAX = 256 << 10
#: The inter-host choices and their defaults, which a tuning table's ``"hosts"`` section overrides (``zbccl tune
#: --hosts`` measures them): ``chunk`` (the pipelining unit, one slot), ``direct_min`` (``HOSTS_DIRECT_MIN``),
#: ``hier_min`` (``HOSTS_HIER_MIN`` per op; None: never hierarchical), ``column_max`` (``HOSTS_COLUMN_MAX``) and
#: ``relay`` (a small step of the collectives for several ranks of another host goes in one write, relayed there:
#: ``hosts/mesh.py``; EP's rounds always are).
#: A communicator across hosts uses rank 0's, agreed when it sets up (``hosts/state.py``).
HOSTS_DEFAULTS: dict = {"chunk": HOSTS_CHUNK, "direct_min": HOSTS_DIRECT_MIN, "hier_min": dict(HOSTS_HIER_MIN),
                        "column_max": HOSTS_COLUMN_MAX, "relay": True}


def validate_hosts(hosts: object, *, source: str, whole: bool = False) -> dict:
    """``hosts`` (a table's ``"hosts"`` section: some of ``HOSTS_DEFAULTS``' choices; ``whole``: all of them) if
    every field is valid, else :class:`ZbcclInvalidUsageError` naming the field."""
    if not isinstance(hosts, dict):
        raise _bad("hosts section", source, "an object {choice: value}", type(hosts).__name__)
    for key, value in hosts.items():
        if key == "chunk":
            ok, want = _is_int(value) and 4096 <= value <= MAX_CHUNK and value % 64 == 0, \
                f"a multiple of 64 in 4096..{MAX_CHUNK}"
        elif key in ("direct_min", "column_max"):
            ok, want = _is_int(value) and 0 <= value <= 1 << 62, "an int of bytes >= 0"
        elif key == "relay":
            ok, want = isinstance(value, bool), "true or false"
        elif key == "hier_min":
            ok = isinstance(value, dict) and all(k in HOSTS_HIER_MIN and (v is None or _is_int(v) and 0 <= v <= 1 << 62)
                                                 for k, v in value.items())
            ok, want = ok and (not whole or set(value) == set(HOSTS_HIER_MIN)), \
                f"an object {{op: bytes or null}} with ops among {tuple(HOSTS_HIER_MIN)}"
        else:
            raise _bad("hosts choice", source, f"one of {tuple(HOSTS_DEFAULTS)}", key)
        if not ok:
            raise _bad(f"hosts.{key}", source, want, value)
    if whole and set(hosts) != set(HOSTS_DEFAULTS):
        raise _bad("hosts section", source, f"every choice of {tuple(HOSTS_DEFAULTS)}", sorted(hosts))
    return hosts


def hosts_settings(section: dict | None = None) -> dict:
    """Every inter-host choice: ``HOSTS_DEFAULTS`` overlaid with a (validated) ``"hosts"`` section."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in HOSTS_DEFAULTS.items()}
    for key, value in (section or {}).items():
        if key == "hier_min":
            out[key].update(value)
        else:
            out[key] = value
    return out


#: EP across hosts (``ep/wire.py``): a part of a dispatch or combine up to this many bytes rides in its op's round
#: (the mesh step that carries the headers: one write, no round trip of its own); a larger one is read by its
#: receiver from the sender's heap (two round trips: the heap's size, then the bytes). Each rank holds a mesh
#: region of ``2 * R`` slots of it. Measured by host id, 2 x 1, 512 tokens x 2048 bf16 (2 MiB parts): 12.5 ms
#: per dispatch + combine read, 11.0 ms riding in the rounds (4 MiB).
EP_HOSTS_EAGER = 4 << 20


def ep_hosts_eager(heap_bytes: int, ranks: int, budget: int = 0) -> int:
    """This rank's proposal of the EP eager limit across hosts (the group takes the smallest): ``EP_HOSTS_EAGER``,
    or less where the ``2 * ranks`` slots would take more than an eighth of the heap, or more than ``budget`` bytes
    (the Buffer's ``num_rdma_bytes``; 0: none given); at least 4 KiB."""
    room = heap_bytes // 8 if budget <= 0 else min(heap_bytes // 8, budget)
    fit = room // max(1, 2 * ranks) // 4096 * 4096
    return max(4096, min(EP_HOSTS_EAGER, fit))


def hosts_chunk(heap_bytes: int, slots: int, most: int = HOSTS_CHUNK) -> int:
    """This rank's proposal of the inter-host chunk (the group takes the smallest, so every rank agrees):
    ``most`` (the tuned chunk), or less where ``slots`` slots of it would take more than a quarter of the heap."""
    fit = heap_bytes // 4 // max(1, slots) // 4096 * 4096
    return max(4096, min(most, fit))


def hosts_hierarchical(op: str, nbytes: int, hosts: int, local: int, regular: bool,
                       hier_min: dict | None = None) -> bool:
    """Whether ``op`` of ``nbytes`` takes the hierarchical algorithm (identical on every rank: it reads only the
    topology, the size, which the ranks agree on or fail together, and ``hier_min``, the agreed thresholds;
    None: ``HOSTS_HIER_MIN``)."""
    least = (HOSTS_HIER_MIN if hier_min is None else hier_min).get(op)
    return regular and hosts >= 2 and local >= 2 and least is not None and nbytes >= least
