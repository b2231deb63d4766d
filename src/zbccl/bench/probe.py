"""The host-state probe: what a store into a line the peer core just read costs here, now.

On the test VM the cost of writing cache lines that another core holds in its
cache flips between two states over minutes (``docs/benchmarks.md``, "Host
state probe"; ``cpu-baselines-measured.md`` observation 6). In-place
collectives write into lines peers read, so every benchmark table says which
state it was measured in (``bench/runner.py`` probes before and after each op
block). all_reduce itself needs no probe: the store-kind policy of the native
core measures the ops and follows a change of state within a few hundred
milliseconds (``native/csrc/core/kind.c``, "Store kind").

Protocol (:func:`probe_host_state`, collective over the whole communicator;
only group ranks 0 and 1 work, the others wait in the two barriers):

* ``shared`` is the ``PROBE`` area of rank 0's segment header (``LINES`` cache
  lines its peer will read; ``heap/layout.py``), ``private`` as many lines of
  rank 0's own memory that nobody else touches; each of ranks 0 and 1 owns the
  ``PROBE_FLAG`` line of its header. No heap block is used, so the probe shows
  nowhere in ``memory_stats``. Flag values continue from the last probe: the
  ranks agree on a base (the highest flag) through ``all_gather_object``.
* Round ``i`` (``1..warmup+reps``, after the base): rank 1 waits for rank 0's flag >= ``i``
  (rank 0 has written ``shared``), reads every line of ``shared`` into a
  private scratch, and signals its own flag ``i``. Rank 0 waits for it, then
  times one ``memset`` of ``shared`` (every store must invalidate the peer's
  copy: the store-after-peer-read) and one of ``private`` (lines only it
  holds: the baseline), and signals its flag ``i + 1``.
* Rank 0 reports the median ns per line of each (warm-up rounds dropped) and
  their ratio; rank 0's result reaches every rank through ``all_gather_object``.

Every wait is bounded by the communicator's timeout and names the late rank.
The cost is a few milliseconds plus two barriers and two store round trips.

The label: ``slow`` when the store-after-peer-read costs at least
``SLOW_NS_PER_LINE`` ns per line, else ``fast``. The threshold sits between
the two clusters measured on the test VM (see ``docs/benchmarks.md``, "Host
state probe"); an absolute cost is used rather than the ratio because the
private baseline itself moves with the host's load.
"""

from __future__ import annotations

import ctypes
import statistics
import time

from ..heap import layout

__all__ = ["LINES", "SLOW_NS_PER_LINE", "probe_host_state", "classify", "format_state"]

LINE = layout.LINE
#: Cache lines per probe buffer: 32 KiB, inside one core's L1 and L2.
LINES = layout.PROBE_BYTES // LINE
#: ns per line of the store-after-peer-read from which the host is labelled "slow".
SLOW_NS_PER_LINE = 15.0


def classify(shared_ns: float) -> str:
    """``"slow"`` or ``"fast"`` for a store-after-peer-read cost in ns per line."""
    return "slow" if shared_ns >= SLOW_NS_PER_LINE else "fast"


def _cpu() -> int:
    """The CPU this thread last ran on (``/proc``; -1 where unknown)."""
    try:
        with open("/proc/thread-self/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[36])
    except (OSError, ValueError, IndexError):
        return -1


def _ctrl(comm, rank: int, offset: int) -> int:
    """Local address of byte ``offset`` of group rank ``rank``'s control area."""
    return comm.heap.ctrl_addr(comm.ranks[rank], offset)


def _rounds(comm, *, role: int, mine: int, peer_flag: int, base: int, shared: int, private: int, scratch: int,
            rounds: int, timeout: float) -> list[tuple[int, int]]:
    """The handshake loop of rank 0 (``role`` 0) or rank 1; rank 0 returns ``(shared_ns, private_ns)``."""
    from ..runtime.waits import FlagSet, wait_flags

    ctx, prims = comm._ctx, comm._ctx.prims
    peer = 1 - role
    flags = FlagSet([comm.ranks[peer]], [peer_flag], [peer])
    nbytes, out = LINES * LINE, []
    if role == 0:
        prims.memset(shared, 1, nbytes)
        prims.signal(mine, base + 1)
    for i in range(base + 1, base + rounds + 1):
        if role == 1:
            wait_flags(ctx, flags, i, timeout=timeout, op="probe_host_state")
            prims.memcpy(scratch, shared, nbytes)  # every line of shared is now in both caches
            prims.signal(mine, i)
            continue
        wait_flags(ctx, flags, i, timeout=timeout, op="probe_host_state")
        t0 = prims.now_ns()
        prims.memset(shared, (i + 1) & 0xFF, nbytes)
        t1 = prims.now_ns()
        prims.memset(private, (i + 1) & 0xFF, nbytes)
        t2 = prims.now_ns()
        out.append((t1 - t0, t2 - t1))
        prims.signal(mine, i + 1)
    return out


def probe_host_state(comm, *, reps: int = 15, warmup: int = 3, timeout: float | None = None) -> dict | None:
    """Collective: measure the store-after-peer-read cost between group ranks 0 and 1.

    Blocks the host on every rank (ranks >= 2 only join the barriers and the
    result exchange). Returns the same dict on every rank::

        {"state": "fast" | "slow", "shared_ns_per_line": float, "private_ns_per_line": float,
         "ratio": float, "lines": int, "reps": int, "samples_ns_per_line": [[shared, private], ...],
         "cost_ms": float, "threshold_ns_per_line": float, "cpus": [cpu of rank 0, cpu of rank 1]}

    ``None`` at world size 1 (no peer core to probe). Raises
    :class:`~zbccl.errors.ZbcclTimeoutError` naming the late rank if rank 0 or
    1 stops answering within ``timeout`` (default: the communicator's).
    """
    if comm.world_size < 2:
        return None
    if reps < 1 or warmup < 0:
        raise ValueError(f"probe_host_state: bad repetitions, expected reps >= 1 and warmup >= 0, "
                         f"got reps={reps} warmup={warmup}")
    t_start = time.perf_counter()
    timeout = comm.timeout if timeout is None else float(timeout)
    role = comm.rank if comm.rank < 2 else None
    nbytes = LINES * LINE
    prims, samples = comm._ctx.prims, []
    if role is not None:
        base = prims.load_acquire(_ctrl(comm, role, layout.H_PROBE_FLAG))
    base = max(filter(None, comm.all_gather_object(base if role is not None else None, timeout=timeout)),
               default=0)
    if role is not None:
        private = ctypes.create_string_buffer(nbytes + LINE)  # lines only this rank touches
        aligned = ctypes.addressof(private) + (-ctypes.addressof(private)) % LINE
        args = {"shared": _ctrl(comm, 0, layout.H_PROBE), "private": aligned if role == 0 else 0,
                "scratch": aligned if role == 1 else 0}
        samples = _rounds(comm, role=role, mine=_ctrl(comm, role, layout.H_PROBE_FLAG),
                          peer_flag=_ctrl(comm, 1 - role, layout.H_PROBE_FLAG), base=base,
                          rounds=warmup + reps, timeout=timeout, **args)[warmup:]
    comm.barrier(timeout=timeout)  # rank 1 finished reading before anyone probes again
    result = None
    if role == 0:
        shared_ns = statistics.median(s for s, _ in samples) / LINES
        private_ns = statistics.median(p for _, p in samples) / LINES
        result = {"state": classify(shared_ns), "shared_ns_per_line": round(shared_ns, 2),
                  "private_ns_per_line": round(private_ns, 2), "ratio": round(shared_ns / max(private_ns, 1e-3), 2),
                  "lines": LINES, "reps": reps,
                  "samples_ns_per_line": [[round(s / LINES, 2), round(p / LINES, 2)] for s, p in samples],
                  "threshold_ns_per_line": SLOW_NS_PER_LINE}
    got = comm.all_gather_object((result, _cpu()), timeout=timeout)
    result = got[0][0]
    result["cpus"] = [got[0][1], got[1][1]]  # equal: both ranks shared one CPU, no line crossed cores
    result["cost_ms"] = round((time.perf_counter() - t_start) * 1e3, 2)
    return result


def format_state(probe: dict | None) -> str:
    """One header line: ``host state: slow (store-after-peer-read 41 ns/line vs 6 ns/line private, ratio 6.8)``."""
    if not probe:
        return "host state: not probed (world size 1)"
    where = " on one CPU" if len(set(probe.get("cpus", []))) == 1 else ""
    return (f"host state: {probe['state']}{where} (store-after-peer-read {probe['shared_ns_per_line']:.1f} ns/line vs "
            f"{probe['private_ns_per_line']:.1f} ns/line private, ratio {probe['ratio']:.1f})")
