"""Which stores a dispatch's pull writes its received rows with: cached or streaming, measured per rank.

A rank's received rows (``recv_x``) live in a block it reuses step after step, and its peers read
that block in every combine. On this VM's slow cross-core state a cached store into a line another
core has just read costs ~28 ns (``docs/benchmarks.md``, "Host state probe"), so a 4 MiB pull takes
~0.9 ms with cached stores and ~0.18 ms with streaming ones; in the fast state the streaming pull is
2x slower than the cached one (it leaves nothing in this core's cache and bypasses nothing it
needed to). Neither kind is right in both states, and the state flips over minutes, so each rank
times its own pulls under both kinds and uses the faster one.

Unlike all_reduce's store kind (chosen by group rank 0 from whole-op times, ``chan_ops.c``), a pull
is purely local work (it reads peers' published rows and writes this rank's block, with no wait in
between), so a rank's own timing measures its own choice, and the kinds give bitwise identical
rows, so ranks need not agree. Policy (:class:`PullStores`): pulls under ``MIN_BYTES`` are cached;
otherwise each kind is first sampled ``FIRST_SAMPLES`` times, alternating, cached first (a first
pull into a fresh block is slower than the steady state, and one such sample must not decide),
then the kind with the lower rate (the least of its last ``SAMPLES`` ns/byte samples) runs, and the
other kind is sampled again once ``EXPLORE_OPS`` pulls or ``STALE_S`` seconds passed since its last
sample. ``ZBCCL_STREAM_STORES=on|off`` fixes the kind (the same variable as
all_reduce's).
"""

from __future__ import annotations

import time
from collections import deque

from ..ops.tuner import store_kind_mode

__all__ = ["PullStores", "MIN_BYTES", "FIRST_SAMPLES", "SAMPLES", "EXPLORE_OPS", "STALE_S"]

MIN_BYTES = 256 << 10
FIRST_SAMPLES = 2
SAMPLES = 4
EXPLORE_OPS = 32
STALE_S = 0.2


class PullStores:
    """The store kind of one rank's dispatch pulls: 0 cached, 1 streaming (see the module docstring)."""

    def __init__(self, mode: int | None = None, clock=time.monotonic) -> None:
        #: -1 measures (auto), 0 or 1 fixes the kind.
        self.mode = store_kind_mode() if mode is None else mode
        self._clock = clock
        self._rates: tuple[deque, deque] = (deque(maxlen=SAMPLES), deque(maxlen=SAMPLES))
        self._since = [0, 0]  # pulls since each kind's last sample
        self._at = [0.0, 0.0]  # when each kind was last sampled

    def choose(self, nbytes: int) -> int:
        """The kind for a pull of ``nbytes``."""
        if self.mode >= 0:
            return self.mode
        if nbytes < MIN_BYTES:
            return 0
        for n in range(FIRST_SAMPLES):
            for kind in (0, 1):
                if len(self._rates[kind]) <= n:
                    return kind
        best = min((0, 1), key=lambda k: min(self._rates[k]))
        other = 1 - best
        if self._since[other] >= EXPLORE_OPS or self._clock() - self._at[other] >= STALE_S:
            return other
        return best

    def record(self, kind: int, nbytes: int, ns: int) -> None:
        """A pull of ``nbytes`` under ``kind`` took ``ns``."""
        if self.mode >= 0 or nbytes < MIN_BYTES:
            return
        self._rates[kind].append(ns / nbytes)
        self._since[kind] = 0
        self._since[1 - kind] += 1
        self._at[kind] = self._clock()

    def rates(self) -> dict[str, float | None]:
        """The current ns/byte estimate of each kind (None: not measured yet), for reports."""
        return {name: (min(r) if r else None) for name, r in zip(("cached", "streaming"), self._rates)}
