"""Flat collectives between hosts through the transport verbs: all_gather and all_reduce by put + signal.

The first collectives that cross hosts (issue 21), for one rank per host
(2 x 1): they use only the verbs every transport has (put, signal,
wait_until, load), so they run over the mooncake transport, where a peer's
memory cannot be viewed. The hierarchical algorithms (an intra-host phase on
shm around this exchange) build on it.

Memory: the same ``region`` of every member's heap (``data_offset``, room
for ``len(ranks)`` slots of the largest message) and a block of signal lines
in every member's pad from ``line_base``: one *arrived* word per source rank
(``line_base + LINE * i``, written by source ``i``) and one *done* word
(``line_base + LINE * n``, written by its owner).

Synchronisation protocol (exchange number ``seq``, 1, 2, ... on every member):

1. wait until every peer's *done* word is ``>= seq - 1`` (it has copied out
   the previous exchange, so its slots may be overwritten);
2. put this rank's bytes into slot ``i`` (its index) of every peer, then
   signal that peer's *arrived[i]* word with ``seq`` (the signal is ordered
   after the put: Mooncake's TCP v2 completes a write only when it landed);
3. wait until this rank's own *arrived[j]* words are all ``>= seq``;
4. copy the slots out (own slot from the input), then store ``seq`` into the
   own *done* word.

all_reduce reduces the gathered slots in member order, so every rank computes
bit-identical sums, equal to ``sum(x_r for r in ranks)`` in that order.
Inter-host bytes per rank: ``(n - 1) * nbytes`` sent (a ring's ``2 (n-1)/n
nbytes`` at n = 2).
"""

from __future__ import annotations

import torch

from ..errors import ZbcclInvalidUsageError
from ..heap.transports.base import Transport

__all__ = ["HostExchange"]


class HostExchange:
    """Flat all_gather / all_reduce among ``ranks`` over ``transport``'s verbs (see the module docstring).

    Not thread-safe; one exchange at a time per instance, on every member in the same order (collective).
    """

    def __init__(self, transport: Transport, ranks: list[int], me: int, *, data_offset: int, data_bytes: int,
                 line_base: int, timeout: float = 60.0) -> None:
        if me not in ranks:
            raise ZbcclInvalidUsageError(f"internode: this rank is not a member, expected one of {ranks}, got {me}")
        n = len(ranks)
        pad = transport.signal_pad(me).nbytes
        if line_base % transport.LINE or line_base < 0 or line_base + transport.LINE * (n + 1) > pad:
            raise ZbcclInvalidUsageError(
                f"internode: signal lines out of the pad, expected {n + 1} lines from a {transport.LINE}-aligned "
                f"base within [0, {pad}), got base {line_base}")
        self.t, self.ranks, self.me, self.index = transport, list(ranks), me, ranks.index(me)
        if data_offset % 64:
            raise ZbcclInvalidUsageError(f"internode: region offset not 64-byte aligned, expected a multiple of 64, "
                                         f"got {data_offset}")
        self.data_offset, self.slot = data_offset, data_bytes // n // 64 * 64  # every slot aligned for any dtype
        self.line_base, self.timeout, self.seq = line_base, timeout, 0
        if self.slot <= 0:
            raise ZbcclInvalidUsageError(
                f"internode: region too small, expected at least {64 * n} bytes, got {data_bytes}")

    def _arrived(self, i: int) -> int:
        return self.line_base + self.t.LINE * i

    @property
    def _done(self) -> int:
        return self.line_base + self.t.LINE * len(self.ranks)

    def _exchange(self, x: torch.Tensor, op: str) -> tuple[torch.Tensor, int]:
        """Steps 1-3: this rank's bytes in every peer's slot, every peer's in this rank's; ``(src, seq)``."""
        src = x.detach().contiguous().cpu()
        nbytes = src.numel() * src.element_size()
        if nbytes > self.slot:
            raise ZbcclInvalidUsageError(
                f"{op}: message too large for the exchange region, expected at most {self.slot} bytes, got {nbytes}")
        t, me, peers = self.t, self.me, [r for r in self.ranks if r != self.me]
        self.seq += 1
        seq = self.seq
        if seq > 1:  # 1. every peer copied out the previous exchange
            t.wait_until([(p, self._done) for p in peers], seq - 1, timeout=self.timeout, op=op)
        at = self.data_offset + self.index * self.slot
        for p in peers:  # 2. data, then the signal that publishes it
            t.put(p, at, src, op=op)
            t.signal(p, self._arrived(self.index), seq)
        t.wait_until([(me, self._arrived(self.ranks.index(p))) for p in peers], seq,  # 3.
                     timeout=self.timeout, op=op)
        return src, seq

    def _slot(self, i: int, like: torch.Tensor) -> torch.Tensor:
        """Member ``i``'s bytes as they arrived here: a view of this rank's own heap (always viewable)."""
        return self.t.view(self.me, self.data_offset + i * self.slot, tuple(like.shape), like.dtype, op="exchange")

    def all_gather(self, x: torch.Tensor, *, op: str = "all_gather") -> torch.Tensor:
        """``[len(ranks), *x.shape]``: every member's ``x`` (same shape and dtype everywhere), in member order."""
        src, seq = self._exchange(x, op)
        out = torch.empty((len(self.ranks), *src.shape), dtype=src.dtype)
        for i, r in enumerate(self.ranks):  # 4. copy out, then release the slots
            out[i].copy_(src if r == self.me else self._slot(i, src))
        self.t.signal(self.me, self._done, seq)
        return out

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every member's ``x``, reduced in member order (bit-identical on every member).

        Reduced straight from the slots (no gathered copy); the slots are released after the sum.
        """
        src, seq = self._exchange(x, "all_reduce")
        parts = [src if r == self.me else self._slot(i, src) for i, r in enumerate(self.ranks)]
        acc = parts[0].clone()
        for part in parts[1:]:
            acc += part
        self.t.signal(self.me, self._done, seq)
        return acc
