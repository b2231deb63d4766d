"""The host-state probe: what a store into a line the peer core just read costs here, now.

On the test VM the cost of writing cache lines that another core holds in its
cache flips between two states over minutes (``docs/benchmarks.md``, "Noise";
``cpu-baselines-measured.md`` observation 6). In-place collectives do exactly
that, so every benchmark table says which state it was measured in.

Protocol (:func:`probe_host_state`, collective over the whole communicator;
only group ranks 0 and 1 work, the others wait in the two barriers):

* Rank 0 owns ``shared`` (``LINES`` cache lines its peer will read) and
  ``private`` (as many lines nobody else touches), both in its heap; each of
  ranks 0 and 1 owns one flag line. Handles go through ``all_gather_object``.
* Round ``i`` (``1..warmup+reps``): rank 1 waits for rank 0's flag >= ``i``
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

import statistics
import time

import torch

__all__ = ["LINES", "SLOW_NS_PER_LINE", "probe_host_state", "classify", "format_state"]

#: Cache lines per probe buffer: 256 KiB, well inside one core's L2 (1 MiB on the test VM).
LINES = 4096
LINE = 64
#: ns per line of the store-after-peer-read from which the host is labelled "slow".
SLOW_NS_PER_LINE = 15.0


def classify(shared_ns: float) -> str:
    """``"slow"`` or ``"fast"`` for a store-after-peer-read cost in ns per line."""
    return "slow" if shared_ns >= SLOW_NS_PER_LINE else "fast"


def _aligned(comm, nbytes: int) -> tuple[torch.Tensor, int]:
    """A zeroed heap block of at least ``nbytes`` and its first 64-byte aligned address."""
    import zbccl

    block = zbccl.zeros(nbytes + LINE, dtype=torch.uint8, comm=comm)
    base = block.data_ptr()
    return block, base + (-base) % LINE


def _cpu() -> int:
    """The CPU this thread last ran on (``/proc``; -1 where unknown)."""
    try:
        with open("/proc/thread-self/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[36])
    except (OSError, ValueError, IndexError):
        return -1


def _peer_addr(comm, rank: int, handle) -> int:
    return comm.peer_tensor(rank, handle).data_ptr()


def _rounds(comm, *, role: int, mine: int, peer_flag: int, shared: int, private: int, scratch: int,
            rounds: int, timeout: float) -> list[tuple[int, int]]:
    """The handshake loop of rank 0 (``role`` 0) or rank 1; rank 0 returns ``(shared_ns, private_ns)``."""
    from ..runtime.waits import FlagSet, wait_flags

    ctx, prims = comm._ctx, comm._ctx.prims
    peer = 1 - role
    flags = FlagSet([comm.ranks[peer]], [peer_flag], [peer])
    nbytes, out = LINES * LINE, []
    if role == 0:
        prims.memset(shared, 1, nbytes)
        prims.signal(mine, 1)
    for i in range(1, rounds + 1):
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
    import zbccl

    t_start = time.perf_counter()
    timeout = comm.timeout if timeout is None else float(timeout)
    role = comm.rank if comm.rank < 2 else None
    nbytes = LINES * LINE
    keep, handle, samples = [], None, []
    if role is not None:
        flag_block, flag = _aligned(comm, LINE)
        keep.append(flag_block)
        if role == 0:
            data_block, shared = _aligned(comm, 2 * nbytes)
            keep.append(data_block)
            handle = (zbccl.export(flag_block, comm), flag - flag_block.data_ptr(),
                      zbccl.export(data_block, comm), shared - data_block.data_ptr())
        else:
            handle = (zbccl.export(flag_block, comm), flag - flag_block.data_ptr())
    handles = comm.all_gather_object(handle, timeout=timeout)
    if role is not None:
        peer_handle = handles[1 - role]
        peer_flag = _peer_addr(comm, 1 - role, peer_handle[0]) + peer_handle[1]
        if role == 0:
            args = {"shared": shared, "private": shared + nbytes, "scratch": 0}
        else:
            scratch_block, scratch = _aligned(comm, nbytes)
            keep.append(scratch_block)
            args = {"shared": _peer_addr(comm, 0, peer_handle[2]) + peer_handle[3], "private": 0,
                    "scratch": scratch}
        comm.barrier(timeout=timeout)  # every rank mapped its peer's blocks before any flag moves
        samples = _rounds(comm, role=role, mine=flag, peer_flag=peer_flag, rounds=warmup + reps,
                          timeout=timeout, **args)[warmup:]
    else:
        comm.barrier(timeout=timeout)
    comm.barrier(timeout=timeout)  # rank 1 finished reading rank 0's block before anyone frees it
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
    del keep
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
