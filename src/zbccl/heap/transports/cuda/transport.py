"""CUDA transport: each rank's heap and signal pad in GPU memory (CUDA VMM), shared between the processes of one host.

Memory (:mod:`.segments`): per rank a host control page (memfd: cookie,
secret share, published size), a device signal pad (one VMM chunk, zeroed)
and a device data segment (a VMM range reserved over the rank's maximum size,
chunks mapped from its start). Descriptors travel through the authenticated
handout shared with the shm transport (:mod:`..handout`: ``SO_PEERCRED`` both
ways, the cookie checked after mapping); death is noticed by pidfd
(:mod:`..liveness`), as on shm. Peers may sit on the same GPU (tests, one
GPU shared by several ranks) or on different ones (access is set for this
rank's device; the devices must be peer-capable).

Establish (collective over the local ranks): create own memory and start the
server -> agree "cuda-listen" (pid, uid, token, cookie, or the error) -> fetch
every peer's offer, import, map, check the cookie -> agree "cuda-mapped". The
server keeps serving: growth adds a chunk, and a peer that reads a published
size beyond what it mapped fetches the offer again and maps the new chunks
(one socket round trip and a ``cuMemMap`` per growth, never per access).
Addresses never move: a rank's range is reserved at its maximum from the start.

Growth is acknowledged: ``grow`` returns only once every local peer has mapped
the new chunks, so no offset this rank hands out (to its SMA, hence to a kernel
argument a peer's kernel reads) lies in memory a peer has not mapped. A peer's
kernel may already be running, launched before the growth, when it reads that
offset: nothing on its host can map in time then, so the mapping must exist
before the offset does. The handshake lives in the host control blocks: the
grower publishes its size, adds 1 to each peer's ``BELL`` (waking it), and
waits (bounded, with liveness) until each peer's ``ACKS`` line for it reaches
its new mapped size. Each rank runs a *mapper* thread that sleeps on its own
bell (a futex: no polling), maps what peers grew by, and writes its
acknowledgements; a closing rank acknowledges everything, so that nobody waits
for it. A peer that dies, or cannot map, makes ``grow`` raise naming it.

Verbs and their cost (host verbs, for control paths and tests; the
collectives' kernels touch the same memory from the device and never call
these):

* views are CUDA tensors aliasing the mapping (zero-copy, no synchronisation
  of their own: they run on the caller's stream, as any torch op);
* ``put``/``get``/``get_into``/``zero`` copy on the transport's private
  stream after it waited for the caller's current stream, and return once the
  copy completed (host-synchronous, as the base contract says);
* ``signal`` is a release: it first synchronises the device (every stream of
  this process: whatever was written through views, on any stream, is done),
  then ``cuStreamWriteValue64`` on the private stream, and waits for it
  (tens of microseconds);
* ``load`` is an 8-byte device-to-host copy into pinned memory on the private
  stream (about 10 us); ``fetch_add`` a one-thread Triton kernel doing a
  system-scope ``atomic_add`` (acq_rel) after a device synchronise (compiled
  once per process, then tens of microseconds);
* ``wait_until`` polls the words (one batch of 8-byte copies and one stream
  synchronise per poll), backing off from 10 us to 500 us between polls, and
  checks the pidfds every ``liveness`` seconds.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from .... import errors
from ....bootstrap.base import Bootstrap
from ....bootstrap.secret import JobSecret
from ....bootstrap.topology import Topology
from ....errors import ZbcclError, ZbcclRemoteError, ZbcclSystemError
from ... import flags, layout
from ...releases import drain
from ..base import NativeHandle, Segment, SignalPad, Transport, ViewRelease
from ..handout import FdServer, Member, agree, check_uids, member_of, os_error, receive
from ..liveness import Pidfds
from . import vmm
from .segments import ACK_FAILED, ACKS, BELL, GROWS, OwnMemory, PeerMemory
from .tensors import device_tensor
from .words import DeviceWords

__all__ = ["CudaTransport", "signal_pad_bytes"]

_log = logging.getLogger("zbccl")


def signal_pad_bytes(world: int) -> int:
    """Bytes of a rank's device signal pad, laid out as the shm transport's control area: the host verbs'
    lines (``layout.slot_line``: the header, then one comm slot per communicator) in ``[0, COMM_BYTES)``,
    then the kernels' area (``layout.kernel_pad_bytes``) at ``KERNEL_AREA`` (``KERNEL_LINE``), so that host
    signals and the kernels' words never share a byte. The kernel area's size does not depend on the world
    (a world beyond ``KMAX_WORLD`` cannot run the kernels, but the transport still serves it)."""
    return layout.KERNEL_AREA + layout.kernel_pad_bytes(min(max(world, 1), layout.KMAX_WORLD))


class CudaTransport(Transport):
    """GPU memory shared between the processes of one host (see the module docstring)."""

    name = "cuda"
    #: The kernels' area in each pad: after the host verbs' lines, as in a shm segment (``signal_pad_bytes``).
    KERNEL_LINE = layout.KERNEL_AREA

    def __init__(self, *, device: torch.device | str = "cuda", populate: bool = True) -> None:
        super().__init__(device=device)
        if self.device.type != "cuda":
            raise errors.ZbcclInvalidUsageError(
                f"heap: the cuda transport holds GPU memory, expected a cuda device, got {self.device}")
        del populate  # accepted like shm's (device memory is always backed when mapped)
        self.rank = -1
        self.index = -1  # the CUDA device ordinal, known at establish
        self.segments: dict[int, Segment] = {}
        self._own: OwnMemory | None = None
        self._peers: dict[int, PeerMemory] = {}
        self._members: dict[int, Member] = {}
        self._job = ""
        self._server: FdServer | None = None
        self._live = Pidfds()
        self._prims = flags.primitives()
        self.words: DeviceWords | None = None  # the host verbs on device words (made at establish)
        self._own_flat: torch.Tensor | None = None
        self._native = _CudaNative(self)
        self._timeout = 60.0
        self._pid = os.getpid()
        self.views = 0
        self._slots: dict[int, int] = {}  # local rank -> its index among the local ranks (its ACKS line)
        self._mapper: threading.Thread | None = None
        self._stopping = False
        self._acked = 0  # the data size every local peer has acknowledged mapping

    # ------------------------------------------------------------ lifecycle
    def establish(self, bootstrap: Bootstrap, topology: Topology, *, data_bytes: list[int], job_id: str,
                  timeout: float, reserve_bytes: list[int] | None = None) -> dict[int, Segment]:
        rank = self.rank = bootstrap.rank
        reserve = list(data_bytes) if reserve_bytes is None else list(reserve_bytes)
        peers = [r for r in topology.local_ranks if r != rank]
        self._slots = {r: i for i, r in enumerate(topology.local_ranks)}
        self._job, self._timeout, self._pid = job_id, timeout, os.getpid()
        me = Member(rank, os.getpid(), os.geteuid(), secrets.token_hex(16), 1)
        error: ZbcclError | None = None
        try:
            try:
                self._open_device()
                with self._on_device():
                    own = self._own = OwnMemory(rank, self.index, job_id, data=data_bytes[rank],
                                                reserve=reserve[rank], pad=signal_pad_bytes(bootstrap.world_size),
                                                local_ranks=len(self._slots))
                me = Member(rank, me.pid, me.uid, me.token, own.cookie)
                self._server = FdServer(job_id, rank, me.token, offer=own.offer, persistent=True)
            except ZbcclError as exc:
                error = exc
            except OSError as exc:
                error = os_error("heap: cannot create this rank's cuda segment", exc, rank)
            except Exception as exc:  # noqa: BLE001 - torch's CUDA errors too: every rank must hear it
                error = ZbcclSystemError(f"heap: cannot create this rank's cuda segment: {type(exc).__name__}: "
                                         f"{exc}", ranks=(rank,))
            got = agree(bootstrap, {"pid": me.pid, "uid": me.uid, "token": me.token, "cookie": me.cookie},
                        error, timeout=timeout, tag="cuda-listen")
            self._members = {p: member_of(p, got[p]) for p in peers}
            error = check_uids(me, self._members)
            if error is None:
                self._server.serve(list(self._members.values()))
                try:
                    for p in peers:
                        self._attach(p, reserve[p], data_bytes[p], timeout)
                except ZbcclError as exc:
                    error = exc
                except OSError as exc:
                    error = os_error("heap: cannot map the peers' cuda segments", exc, rank)
                except Exception as exc:  # noqa: BLE001 - every rank must hear it
                    error = ZbcclSystemError(f"heap: cannot map the peers' cuda segments: {type(exc).__name__}: "
                                             f"{exc}", ranks=(rank,))
            agree(bootstrap, {}, error, timeout=timeout, tag="cuda-mapped")
            if peers:
                self._mapper = threading.Thread(target=self._map_loop, name=f"zbccl-cuda-mapper-{rank}", daemon=True)
                self._mapper.start()
        except BaseException:
            try:
                self.close(unmap=True)
            except Exception as exc:  # noqa: BLE001 - the set-up error is the one to report
                _log.warning("zbccl: cleaning up a failed cuda transport set-up failed too: %s", exc)
            raise
        self.segments[rank] = Segment(rank, data_bytes[rank], "cuda", owner=True, reserved=reserve[rank])
        self._acked = self._own.data.mapped
        return dict(self.segments)

    def _open_device(self) -> None:
        if not torch.cuda.is_available():
            raise ZbcclSystemError("heap: the cuda transport needs a GPU, expected torch.cuda.is_available(), "
                                   f"got False (torch {torch.__version__}, built for CUDA {torch.version.cuda})",
                                   ranks=(self.rank,))
        self.index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", self.index)
        with torch.cuda.device(self.index):
            torch.cuda.init()
            vmm.ensure_context(self.index)
            self.stream = torch.cuda.Stream(self.device)
        self.words = DeviceWords(self.device, self.stream, self._on_device)

    def _attach(self, peer: int, reserve: int, nbytes: int, timeout: float) -> None:
        payload, fds, pidfd = receive(self._job, self._members[peer], timeout=timeout)
        mem = PeerMemory(peer, self.index, reserve=reserve, local_ranks=len(self._slots))
        try:
            with self._on_device():
                mem.attach(payload, fds, self._members[peer].cookie)
        except BaseException:
            os.close(pidfd)
            raise
        self._peers[peer] = mem
        self.segments[peer] = Segment(peer, nbytes, "cuda", owner=False, reserved=reserve)
        self._live.add(peer, pidfd)

    def grow(self, nbytes: int) -> None:
        """Owner only: back ``nbytes`` of data (a new chunk when needed), publish the size (release), then wait
        until every local peer has mapped it (see "Growth" in the module docstring)."""
        seg = self.segments.get(self.rank)
        if seg is None or self._own is None:
            raise ZbcclSystemError("heap: grow: this process holds no cuda segment of its own to grow")
        if nbytes > seg.reserved:
            raise errors.ZbcclOutOfMemoryError(
                f"heap: grow: heap of {nbytes} bytes requested, expected at most the {seg.reserved} reserved")
        if nbytes > seg.nbytes:
            with self._on_device():
                self._own.grow(nbytes)  # nothing changed if it raises
            seg.nbytes = nbytes
            self._own_flat = None
            self._own.publish(nbytes, self._prims)
        if self._acked < self._own.data.mapped:  # also after an earlier grow that raised while waiting
            self._await_maps(self._own.data.mapped)

    def _await_maps(self, target: int) -> None:
        """Ring every local peer's bell, then wait until each acknowledged ``target`` bytes of this rank's data
        mapped: bounded by the transport's timeout; a peer that died, or failed to map, raises naming it."""
        prims, me = self._prims, self._slots[self.rank]
        peers = sorted(self._peers)
        attempt = prims.fetch_add(self._own.ctrl_addr + GROWS, 1) + 1  # only this thread writes it
        for p in peers:
            prims.fetch_add_signal(self._peers[p].ctrl_addr + BELL, 1)
        acks = {p: self._peers[p].ctrl_addr + ACKS + layout.LINE * me for p in peers}
        deadline = time.monotonic() + self._timeout
        while True:
            late = [p for p in peers if prims.load_acquire(acks[p]) < target]
            if not late:
                self._acked = target
                return
            failed = [p for p in late if prims.load_acquire(acks[p] + ACK_FAILED) == attempt]
            if failed:
                raise ZbcclRemoteError(
                    f"heap: grow: ranks {failed} could not map this rank's grown cuda heap (their log says why), "
                    f"expected every local rank to map it, got a failure", ranks=tuple(failed))
            dead = sorted(set(late) & set(self._live.dead()))
            if dead:
                raise ZbcclRemoteError(
                    f"heap: grow: ranks {dead} died before mapping this rank's grown cuda heap", ranks=tuple(dead))
            left = deadline - time.monotonic()
            if left <= 0:
                raise errors.ZbcclTimeoutError(
                    f"heap: grow: timed out after {self._timeout:.1f}s waiting for ranks {late} to map this "
                    f"rank's grown cuda heap, expected {target} bytes acknowledged, got "
                    f"{[prims.load_acquire(acks[p]) for p in late]}", ranks=tuple(late))
            addrs = np.asarray([acks[p] for p in late], dtype=np.uint64)
            prims.wait_ge(int(addrs.ctypes.data), len(late), target, 0, int(min(left, 0.1) * 1e9))

    def _map_loop(self) -> None:
        """The mapper thread: sleep on this rank's bell; when it moved, map what every peer grew by and
        acknowledge each peer's mapped size (a peer's failure is logged and flagged in its line)."""
        prims, own = self._prims, self._own
        bell = np.asarray([own.ctrl_addr + BELL], dtype=np.uint64)
        seen = 0
        try:
            with self._on_device():
                vmm.relax_capture_mode()  # its maps never invalidate a capture of another thread
        except Exception as exc:  # noqa: BLE001 - mapping still works; a peer's growth mid-capture may not
            _log.warning("zbccl: rank %d's cuda mapper keeps the default capture mode: %s", self.rank, exc)
        while not self._stopping:
            rung = prims.load_acquire(int(bell[0]))
            if rung == seen:
                prims.wait_ge(int(bell.ctypes.data), 1, seen + 1, 0, 1_000_000_000)
                continue
            seen = rung
            for p, mem in list(self._peers.items()):
                line = own.ctrl_addr + ACKS + layout.LINE * self._slots[p]
                try:
                    if mem.published(prims) > mem.mapped:
                        self._refresh(p, mem)
                except Exception as exc:  # noqa: BLE001 - the grower raises naming this rank; say why here
                    if not self._stopping:
                        _log.warning("zbccl: rank %d cannot map rank %d's grown cuda heap: %s", self.rank, p, exc)
                        prims.signal(line + ACK_FAILED, prims.load_acquire(mem.ctrl_addr + GROWS))
                    continue
                prims.signal(line, mem.mapped)

    def _stop_mapper(self) -> None:
        """Stop the mapper thread, then acknowledge every peer's growth for good: a peer that grows while this
        rank closes must not wait for it."""
        mapper, self._mapper = self._mapper, None
        if mapper is None or self._own is None:
            return
        self._stopping = True
        self._prims.fetch_add_signal(self._own.ctrl_addr + BELL, 1)
        mapper.join(self._timeout + 5.0)
        if mapper.is_alive():
            _log.warning("zbccl: rank %d's cuda mapper thread is still mapping a peer's growth at close", self.rank)
        for p in self._slots:
            self._prims.signal(self._own.ctrl_addr + ACKS + layout.LINE * self._slots[p], (1 << 63) - 1)

    def close(self, *, unmap: bool) -> None:
        forked = self._pid != os.getpid()  # a forked child: CUDA is unusable here, and the memory is the parent's
        if not forked:
            self._stop_mapper()  # before the server stops: a refresh in flight fetches from peers' servers only
        if self._server is not None:
            self._server.stop()  # before the offered descriptors close
            self._server = None
        self._live.close()
        if self._own is not None:
            self._own.close(unmap=False)
        self._own_flat = None
        self._tables.clear()
        if unmap and not forked:
            try:
                if self.index >= 0:
                    with self._on_device():
                        torch.cuda.synchronize(self.device)  # no kernel of ours still reads the mappings
                        self._unmap_all()
                else:
                    self._unmap_all()  # nothing of CUDA was set up (no device): only host memory to release
            finally:
                self._peers.clear()
                self._own = None
                self.segments.clear()

    def _unmap_all(self) -> None:
        first: BaseException | None = None
        for mem in [*self._peers.values(), self._own]:
            if mem is None:
                continue
            try:
                mem.close(unmap=True)
            except BaseException as exc:  # noqa: BLE001 - release the rest, then report
                first = first or exc
        if first is not None:
            raise first

    # ------------------------------------------------------------ geometry
    def reachable(self, rank: int) -> bool:
        return rank in self.segments

    def size(self, rank: int) -> int:
        if rank == self.rank:
            seg = self.segments.get(rank)
            return seg.nbytes if seg is not None else 0
        mem = self._peers.get(rank)
        if mem is None:
            return 0
        size, mapped = mem.published(self._prims), mem.mapped
        if size > mapped:
            self._refresh(rank, mem)
            mapped = mem.mapped
        return min(size, mapped)

    def _refresh(self, rank: int, mem: PeerMemory) -> None:
        def fetch():
            payload, fds, _ = receive(self._job, self._members[rank], timeout=self._timeout, pidfd=False)
            return payload, fds

        try:
            with self._on_device():
                mem.refresh(fetch)
        except ZbcclRemoteError:
            if rank in self._live.dead():
                raise ZbcclRemoteError(f"heap: rank {rank} died before its grown heap could be mapped here",
                                       ranks=(rank,)) from None
            raise

    def signal_pad(self, rank: int) -> SignalPad:
        mem = self._own if rank == self.rank else self._peers.get(rank)
        nbytes = mem.pad.mapped if mem is not None and mem.pad is not None else 0
        return SignalPad(rank, nbytes, self.LINE)

    def _data_va(self, rank: int) -> int:
        mem = self._own if rank == self.rank else self._peers[rank]
        return mem.data.va

    def _pad_va(self, rank: int) -> int:
        mem = self._own if rank == self.rank else self._peers[rank]
        return mem.pad.va

    # ------------------------------------------------------------ views
    def view(self, rank: int, offset: int, shape: Sequence[int], dtype: torch.dtype, *,
             stride: Sequence[int] | None = None, release: Callable[[], None] | None = None,
             op: str = "view") -> torch.Tensor:
        isz = dtype.itemsize
        if stride is None:
            span = isz * math.prod(shape)
        else:
            span = 0 if 0 in shape else (sum((n - 1) * st for n, st in zip(shape, stride)) + 1) * isz
        if offset % isz:
            raise errors.ZbcclInvalidUsageError(
                f"{op}: offset not aligned to {dtype}, expected a multiple of {isz}, got {offset}")
        if rank not in self.segments or offset < 0 or span < 0 or offset + span > self.size(rank):
            self.check_data(rank, offset, span, op=op)  # raises, naming what is wrong
        if rank == self.rank:
            if release is None:
                flat = self._own_bytes(offset + span)[offset:offset + span]
            else:
                flat = device_tensor(self._data_va(rank) + offset, span, self.device, release)
        else:
            self.views += 1
            flat = device_tensor(self._data_va(rank) + offset, span, self.device, ViewRelease(self, release))
        typed = flat.view(dtype)
        return typed.view(shape) if stride is None else typed.as_strided(shape, stride)

    def _own_bytes(self, end: int) -> torch.Tensor:
        flat = self._own_flat
        if flat is None or flat.numel() < end:
            flat = self._own_flat = device_tensor(self._data_va(self.rank), self.size(self.rank), self.device)
        return flat

    def pad_view(self, rank: int, line: int, nbytes: int, *, op: str = "signal pad") -> torch.Tensor:
        self.check_pad(rank, line, nbytes, op=op)
        return device_tensor(self._pad_va(rank) + line, nbytes, self.device)

    def live_views(self) -> int:
        drain()  # views that died count once their releases ran
        return self.views

    def offset_of(self, rank: int, t: torch.Tensor) -> int:
        if not isinstance(t, torch.Tensor) or t.device != self.device or rank not in self.segments:
            return -1
        st = t.untyped_storage()
        lo = st.data_ptr() - self._data_va(rank)
        if lo < 0 or st.nbytes() == 0 or lo + st.nbytes() > self.size(rank):
            return -1
        return lo + t.storage_offset() * t.element_size()

    # ------------------------------------------------------------ put / get (private stream, host-synchronous)
    def _on_device(self):
        return _Device(self)

    def _copy(self, fn: Callable[[], None]) -> None:
        with self._on_device():
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                fn()
            self.stream.synchronize()

    def put(self, rank: int, offset: int, src, *, op: str = "put") -> None:
        if isinstance(src, torch.Tensor):
            data = src.contiguous().view(-1).view(torch.uint8) if src.numel() else torch.empty(0, dtype=torch.uint8)
        else:
            raw = bytearray(src)
            data = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        dst = self.view_bytes(rank, offset, data.numel(), op=op)
        if data.numel():
            self._copy(lambda: dst.copy_(data))

    def get(self, rank: int, offset: int, nbytes: int, *, op: str = "get") -> bytes:
        src = self.view_bytes(rank, offset, nbytes, op=op)
        out = torch.empty(nbytes, dtype=torch.uint8, pin_memory=nbytes > 0 and self.device.type == "cuda")
        if nbytes:
            self._copy(lambda: out.copy_(src, non_blocking=True))
        return out.numpy().tobytes()

    def get_into(self, rank: int, offset: int, dst: torch.Tensor, *, op: str = "get") -> None:
        nbytes = dst.numel() * dst.element_size()
        src = self.view(rank, offset, (nbytes,), torch.uint8, op=op)
        if nbytes:
            self._copy(lambda: dst.copy_(src.view(dst.dtype).view(dst.shape)))

    def zero(self, rank: int, offset: int, nbytes: int, *, op: str = "zero") -> None:
        view = self.view_bytes(rank, offset, nbytes, op=op)
        if nbytes:
            self._copy(view.zero_)

    def clear_pad(self, rank: int, line: int, nbytes: int) -> None:
        if nbytes:
            view = self.pad_view(rank, line, nbytes, op="clear_pad")
            self._copy(view.zero_)

    # ------------------------------------------------------------ signals (device words, host verbs)
    def _word(self, rank: int, line: int, op: str) -> int:
        mem = self._own if rank == self.rank else self._peers.get(rank)
        if mem is None or mem.pad is None or not 0 <= line <= mem.pad.mapped - 8 or line % 8:
            self.check_pad(rank, line, 8, op=op)
        return mem.pad.va + line

    def signal(self, rank: int, line: int, value: int) -> None:
        self.words.signal(self._word(rank, line, "signal"), value)

    def load(self, rank: int, line: int) -> int:
        return self.words.load(self._word(rank, line, "load"))

    def fetch_add(self, rank: int, line: int, delta: int) -> int:
        return self.words.fetch_add(self._word(rank, line, "fetch_add"), delta)

    def wait_until(self, lines: Sequence[tuple[int, int]], target: int, *, timeout: float, op: str = "wait",
                   liveness: float = 1.0, labels: dict[int, int] | None = None) -> None:
        addrs = [self._word(r, line, op) for r, line in lines]
        self.words.wait(addrs, [r for r, _ in lines], target, timeout=timeout, op=op, liveness=liveness,
                        labels=labels, dead_peers=self.dead_peers)

    # ------------------------------------------------------------ trust, liveness, native
    def job_secret(self, job_id: str, world_size: int) -> JobSecret | None:
        if sorted(self.segments) != list(range(world_size)) or self._own is None:
            return None
        shares = [self._own.secret() if r == self.rank else self._peers[r].secret() for r in range(world_size)]
        return JobSecret.from_shares(shares, job_id)

    def dead_peers(self) -> list[int]:
        return self._live.dead()

    def native(self) -> NativeHandle:
        return self._native


class _Device:
    """``with``: the transport's device current on this thread, and its primary context for driver calls."""

    __slots__ = ("t", "guard")

    def __init__(self, t: CudaTransport) -> None:
        self.t, self.guard = t, torch.cuda.device(t.index)

    def __enter__(self) -> None:
        self.guard.__enter__()
        vmm.ensure_context(self.t.index)

    def __exit__(self, *exc) -> None:
        self.guard.__exit__(*exc)



class _CudaNative(NativeHandle):
    """Device addresses (in this process) of every mapped rank's data and pad, and the peers' pidfds."""

    __slots__ = ("_t",)

    def __init__(self, transport: CudaTransport) -> None:
        self._t = transport

    def data_addr(self, rank: int, offset: int = 0, nbytes: int = 0, *, op: str = "heap") -> int:
        t = self._t
        t.check_data(rank, offset, nbytes, op=op)
        return t._data_va(rank) + offset

    def pad_addr(self, rank: int, line: int = 0) -> int:
        return self._t._word(rank, line, "signal pad")

    def liveness_fd(self, rank: int) -> int:
        return self._t._live.fd(rank)
