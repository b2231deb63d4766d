"""Host verbs on int64 words in device memory (signal pads, through this process's mappings).

One :class:`DeviceWords` per cuda transport: a private stream, a pinned host buffer and a lock.
What each verb costs is in :mod:`.transport`'s docstring. The device kernels never use these:
they load, store and spin on the same words themselves.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

import torch

from ....errors import ZbcclRemoteError, ZbcclSystemError, ZbcclTimeoutError
from . import vmm
from .tensors import device_tensor

__all__ = ["DeviceWords"]

_log = logging.getLogger("zbccl")
# wait_until: polls without a pause, then sleeps doubling from the least to the most pause.
_SPIN_POLLS, _POLL_MIN_S, _POLL_MAX_S = 32, 10e-6, 500e-6


class DeviceWords:
    """Release stores, acquire loads, atomic adds and bounded waits on device words, from the host.

    ``on_device()`` makes the transport's device (and its primary context) current for a ``with`` block.
    """

    def __init__(self, device: torch.device, stream, on_device: Callable[[], AbstractContextManager]) -> None:
        self.device, self.stream, self.on_device = device, stream, on_device
        self.lock = threading.Lock()  # the pinned buffer, the output word and the private stream's host waits
        self._host = torch.zeros(64, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._out = torch.zeros(1, dtype=torch.int64, device=device)
        self._write_value_ok = True

    def signal(self, addr: int, value: int) -> None:
        """Release-store ``value`` at ``addr``: the device is synchronised first (every stream of this
        process: whatever it wrote through views is done), then one 64-bit store, waited for."""
        with self.on_device(), self.lock:
            torch.cuda.synchronize(self.device)
            self._store(addr, value)
            vmm.stream_sync(self.stream.cuda_stream)

    def _store(self, addr: int, value: int) -> None:
        """Enqueue one 64-bit store on the private stream: ``cuStreamWriteValue64``, or a one-element fill
        where the device refuses stream memory operations (caller holds ``lock``)."""
        if self._write_value_ok:
            try:
                vmm.write_value64(self.stream.cuda_stream, addr, value)
                return
            except ZbcclSystemError as exc:
                if "CUDA_ERROR_NOT_SUPPORTED" not in str(exc):
                    raise
                self._write_value_ok = False
                _log.info("zbccl: cuStreamWriteValue64 unsupported here; signals use a one-element fill")
        with torch.cuda.stream(self.stream):
            device_tensor(addr, 8, self.device).view(torch.int64).fill_(value)

    def load(self, addr: int) -> int:
        with self.on_device(), self.lock:
            return self._read([addr])[0]

    def _read(self, addrs: list[int]) -> list[int]:
        """The words at ``addrs``, one stream synchronise for all (caller holds ``lock``)."""
        if len(addrs) > self._host.numel():
            self._host = torch.zeros(len(addrs), dtype=torch.int64, pin_memory=self.device.type == "cuda")
        base, s = self._host.data_ptr(), self.stream.cuda_stream
        for i, a in enumerate(addrs):
            vmm.copy_dtoh(base + 8 * i, a, 8, s)
        vmm.stream_sync(s)
        return self._host[:len(addrs)].tolist()

    def fetch_add(self, addr: int, delta: int) -> int:
        """Atomically add ``delta`` at ``addr`` (acq_rel, system scope, after a device synchronise); the old value."""
        from .kernels import fetch_add

        with self.on_device(), self.lock:
            torch.cuda.synchronize(self.device)
            with torch.cuda.stream(self.stream):
                fetch_add(addr, delta, self._out)
                return int(self._out.item())

    def wait(self, addrs: Sequence[int], ranks: Sequence[int], target: int, *, timeout: float, op: str,
             liveness: float, labels: dict[int, int] | None, dead_peers: Callable[[], list[int]]) -> None:
        """Poll until every word is ``>= target``; ``ZbcclRemoteError`` naming dead ranks (checked every
        ``liveness`` s), ``ZbcclTimeoutError`` naming the late ones (``labels``: the message's numbering)."""
        label = (labels or {}).get
        start = time.monotonic()
        deadline, next_live = start + timeout, start + liveness
        pause, polls = _POLL_MIN_S, 0
        addrs = list(addrs)
        while True:
            with self.on_device(), self.lock:
                values = self._read(addrs)
            late = [(r, v) for r, v in zip(ranks, values) if v < target]
            if not late:
                return
            now = time.monotonic()
            if now >= next_live or now >= deadline:
                next_live = now + liveness
                dead = sorted({r for r, _ in late} & set(dead_peers()))
                if dead:
                    names = [label(r, r) for r in dead]
                    raise ZbcclRemoteError(f"{op}: peer lost while waiting: rank(s) {names} died (process exited)",
                                           ranks=tuple(names))
                if now >= deadline:
                    names = [label(r, r) for r, _ in late]
                    got = ", ".join(f"{v} on rank {label(r, r)}" for r, v in late)
                    raise ZbcclTimeoutError(
                        f"{op}: timed out after {timeout:.1f}s waiting for ranks {names}, expected their signal >= "
                        f"{target}, got {got}", ranks=tuple(names))
            polls += 1
            if polls > _SPIN_POLLS:
                time.sleep(min(pause, max(0.0, min(deadline, next_live) - now)))
                pause = min(2 * pause, _POLL_MAX_S)
