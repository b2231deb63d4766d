"""One rank's memory in the cuda transport, as its owner holds it and as a peer maps it.

A rank has three regions:

* a **control block**: host pages in a memfd (``zbccl-<job>-r<rank>-cuda``,
  0600), shared like the shm transport's segment. It holds the cookie (checked
  by every peer after mapping), this rank's share of the job secret, the
  **published data size** (a release store by the owner, an acquire load by a
  peer's bounds check: host atomics, so a bounds check never reads device memory),
  and the growth handshake's words (``BELL``, ``ACKS``: see the transport's "Growth");
* a **signal pad**: one VMM chunk of device memory, zeroed at creation;
* a **data segment**: a VMM address range reserved over the rank's maximum
  size, with chunks mapped from its start; growth maps one more chunk.

The owner offers ``[control memfd, pad chunk, data chunks...]`` with a JSON
payload ``{"pad": bytes, "chunks": [bytes, ...]}`` through the handout server
(:mod:`..handout`, persistent). A peer imports everything at establish, and
again the chunks it lacks when it reads a published size beyond what it
mapped (:meth:`PeerMemory.refresh`).
"""

from __future__ import annotations

import json
import os
import secrets
import stat
import threading

import torch

from ....errors import ZbcclOutOfMemoryError, ZbcclRemoteError
from ... import layout
from ..handout import MAX_FDS
from ..shm.mapping import create_memfd, load_i64, map_fd, store_i64, tensor_at, unmap_addr
from . import vmm
from .tensors import device_tensor

__all__ = ["BELL", "GROWS", "ACKS", "ACK_FAILED", "ctrl_bytes", "OwnMemory", "PeerMemory", "MAX_CHUNKS"]

#: The growth bell (a flag line of the control block): a peer that grew adds 1 and wakes the owner's mapper.
BELL = 12 * layout.LINE
#: The owner's growth attempts so far (it counts one before ringing its peers' bells).
GROWS = 13 * layout.LINE
#: The acknowledgements, one flag line per local rank (its index in the local ranks): word 0 is how many bytes of
#: that rank's data the owner of this block has mapped; the word at byte ``ACK_FAILED`` is that rank's growth
#: attempt (``GROWS``) whose mapping failed here (0: none), so an old failure never fails a later attempt.
ACKS = 16 * layout.LINE
ACK_FAILED = 16


def ctrl_bytes(local_ranks: int) -> int:
    """Bytes of a control block in a job of ``local_ranks`` ranks on this host (whole pages)."""
    return -(-(ACKS + layout.LINE * max(local_ranks, 1)) // layout.PAGE) * layout.PAGE

#: Data chunks a rank may have (the handout's descriptors: the control block, the pad and these).
MAX_CHUNKS = MAX_FDS - 2


def _check_sizes(rank: int, got: object, gran: int) -> tuple[int, list[int]]:
    """The ``(pad, chunks)`` a peer offered, checked (the payload comes from a verified member, but still)."""
    try:
        pad, chunks = got["pad"], got["chunks"]  # type: ignore[index]
        if not (isinstance(pad, int) and pad > 0 and pad % gran == 0 and isinstance(chunks, list)
                and chunks and len(chunks) <= MAX_CHUNKS
                and all(isinstance(c, int) and c > 0 and c % gran == 0 for c in chunks)):
            raise ValueError(got)
    except (KeyError, TypeError, ValueError):
        raise ZbcclRemoteError(
            f"heap: rank {rank}'s cuda segment offer is malformed, expected {{pad, chunks}} in multiples of "
            f"{gran} bytes, got {str(got)[:200]}", ranks=(rank,)) from None
    return pad, chunks


class OwnMemory:
    """This rank's control block, pad and data, and the descriptors it offers (see the module docstring)."""

    def __init__(self, rank: int, device: int, job_id: str, *, data: int, reserve: int, pad: int,
                 local_ranks: int) -> None:
        self.rank, self.device = rank, device
        self.ctrl_bytes = ctrl_bytes(local_ranks)
        self.cookie = secrets.randbits(63) | 1
        self.gran = vmm.granularity(device)
        self.lock = threading.Lock()  # guards the offer against growth
        self.fds: list[int] = []  # [control, pad, chunk...], offered in this order
        self.chunk_sizes: list[int] = []
        self.ctrl_addr = 0
        self.pad: vmm.Mapping | None = None
        self.data: vmm.Mapping | None = None
        try:
            fd = create_memfd(f"zbccl-{job_id}-r{rank}-cuda", self.ctrl_bytes)
            self.fds.append(fd)
            self.ctrl_addr = map_fd(fd, self.ctrl_bytes, populate=True)
            store_i64(self.ctrl_addr + layout.H_COOKIE, self.cookie)
            tensor_at(self.ctrl_addr + layout.H_SECRET, layout.SECRET_BYTES).copy_(
                torch.frombuffer(bytearray(secrets.token_bytes(layout.SECRET_BYTES)), dtype=torch.uint8))
            store_i64(self.ctrl_addr + layout.H_HEAP_BYTES, data)
            self.pad = vmm.Mapping.reserve(device, pad)
            self._add(self.pad, self.pad.reserved, pad=True)
            self.data = vmm.Mapping.reserve(device, reserve)
            self._add(self.data, vmm.round_up(max(data, 1), self.gran))
            # Zeroed before any peer can map it: the pad's words start at 0.
            dev = torch.device("cuda", device)
            device_tensor(self.pad.va, self.pad.mapped, dev).zero_()
            torch.cuda.synchronize(dev)
        except BaseException:
            self.close(unmap=True)
            raise

    def _add(self, mapping: vmm.Mapping, nbytes: int, *, pad: bool = False) -> None:
        handle = vmm.create(nbytes, self.device)
        try:
            fd = vmm.export_fd(handle)
        except BaseException:
            vmm.release(handle)
            raise
        try:
            mapping.add(handle, nbytes)  # owns the handle from here (released on failure)
        except BaseException:
            os.close(fd)
            raise
        with self.lock:
            self.fds.append(fd)
            if not pad:
                self.chunk_sizes.append(nbytes)

    def offer(self) -> tuple[bytes, list[int]]:
        """What the handout server sends (on its thread)."""
        with self.lock:
            payload = {"pad": self.pad.mapped if self.pad else 0, "chunks": list(self.chunk_sizes)}
            return json.dumps(payload).encode(), list(self.fds)

    def grow(self, nbytes: int) -> None:
        """Back ``nbytes`` of data with chunks (one more if needed); the caller publishes the size after."""
        assert self.data is not None
        need = vmm.round_up(nbytes, self.gran) - self.data.mapped
        if need <= 0:
            return
        if len(self.chunk_sizes) >= MAX_CHUNKS:
            raise ZbcclOutOfMemoryError(
                f"heap: grow: too many growth steps, expected at most {MAX_CHUNKS} chunks, got a request for "
                f"chunk {len(self.chunk_sizes) + 1} (set a larger initial cuda heap)")
        if self.data.mapped + need > self.data.reserved:
            raise ZbcclOutOfMemoryError(
                f"heap: grow: heap of {nbytes} bytes requested, expected at most the {self.data.reserved} reserved")
        self._add(self.data, need)

    def publish(self, nbytes: int, prims) -> None:
        prims.signal(self.ctrl_addr + layout.H_HEAP_BYTES, nbytes)

    def secret(self) -> bytes:
        return bytes(tensor_at(self.ctrl_addr + layout.H_SECRET, layout.SECRET_BYTES).numpy())

    def close(self, *, unmap: bool) -> None:
        """Close the descriptors (the memory stays while mapped or imported anywhere); unmap when asked."""
        with self.lock:
            for fd in self.fds:
                os.close(fd)
            self.fds.clear()
        if unmap:
            for m in (self.data, self.pad):
                if m is not None:
                    m.close()
            self.data = self.pad = None
            if self.ctrl_addr:
                unmap_addr(self.ctrl_addr, self.ctrl_bytes)
                self.ctrl_addr = 0


class PeerMemory:
    """A peer's control block, pad and data as mapped here (import, map, refresh after its growth)."""

    def __init__(self, rank: int, device: int, *, reserve: int, local_ranks: int) -> None:
        self.rank, self.device = rank, device
        self.ctrl_bytes = ctrl_bytes(local_ranks)
        self.gran = vmm.granularity(device)
        self.reserve = reserve
        self.lock = threading.Lock()  # one refresh at a time
        self.ctrl_addr = 0
        self.pad: vmm.Mapping | None = None
        self.data: vmm.Mapping | None = None

    def attach(self, payload: bytes, fds: list[int], cookie: int) -> None:
        """Map what the peer offered at establish. Closes ``fds``; on failure unmaps what it mapped."""
        try:
            pad, chunks = self._parse(payload, fds)
            st = os.fstat(fds[0])
            if not stat.S_ISREG(st.st_mode) or st.st_size != self.ctrl_bytes:
                raise ZbcclRemoteError(
                    f"heap: rank {self.rank}'s control block is wrong, expected a memfd of {self.ctrl_bytes} "
                    f"bytes, got {st.st_size} bytes (mode {stat.filemode(st.st_mode)}); not mapping it",
                    ranks=(self.rank,))
            self.ctrl_addr = map_fd(fds[0], self.ctrl_bytes, populate=True)
            if load_i64(self.ctrl_addr + layout.H_COOKIE) != cookie:
                raise ZbcclRemoteError(
                    f"heap: rank {self.rank}'s segment carries the wrong cookie, expected the one it published "
                    "through the store, got another (not its segment); unmapped it", ranks=(self.rank,))
            self.pad = vmm.Mapping.reserve(self.device, pad)
            self.pad.add(vmm.import_fd(fds[1]), pad)
            self.data = vmm.Mapping.reserve(self.device, self.reserve)
            self._import(chunks, fds[2:])
        except BaseException:
            self.close()
            raise
        finally:
            for fd in fds:
                os.close(fd)

    def _parse(self, payload: bytes, fds: list[int]) -> tuple[int, list[int]]:
        try:
            got = json.loads(payload)
        except ValueError:
            got = payload[:100]
        pad, chunks = _check_sizes(self.rank, got, self.gran)
        if len(fds) != 2 + len(chunks):
            raise ZbcclRemoteError(
                f"heap: rank {self.rank} offered the wrong number of descriptors, expected {2 + len(chunks)} "
                f"(control, pad, {len(chunks)} chunks), got {len(fds)}", ranks=(self.rank,))
        if sum(chunks) > vmm.round_up(self.reserve, self.gran):
            raise ZbcclRemoteError(
                f"heap: rank {self.rank}'s data is larger than it announced, expected at most "
                f"{vmm.round_up(self.reserve, self.gran)} bytes, got {sum(chunks)}", ranks=(self.rank,))
        return pad, chunks

    def _import(self, chunks: list[int], fds: list[int]) -> None:
        assert self.data is not None
        have = len(self.data.chunks)
        mapped = [c.nbytes for c in self.data.chunks]
        if chunks[:have] != mapped:
            raise ZbcclRemoteError(
                f"heap: rank {self.rank}'s chunks changed under us, expected them to start with {mapped}, got "
                f"{chunks[:have]}", ranks=(self.rank,))
        for nbytes, fd in zip(chunks[have:], fds[have:]):
            self.data.add(vmm.import_fd(fd), nbytes)

    def published(self, prims) -> int:
        """The size the owner published (acquire), clamped to what it announced it may grow to."""
        return min(prims.load_acquire(self.ctrl_addr + layout.H_HEAP_BYTES), self.reserve)

    def refresh(self, fetch) -> None:
        """Import the chunks the owner added since: ``fetch()`` returns its current ``(payload, fds)``."""
        with self.lock:
            payload, fds = fetch()
            try:
                _, chunks = self._parse(payload, fds)
                self._import(chunks, fds[2:])
            finally:
                for fd in fds:
                    os.close(fd)

    @property
    def mapped(self) -> int:
        return self.data.mapped if self.data is not None else 0

    def secret(self) -> bytes:
        return bytes(tensor_at(self.ctrl_addr + layout.H_SECRET, layout.SECRET_BYTES).numpy())

    def close(self, *, unmap: bool = True) -> None:
        for m in (self.data, self.pad):
            if m is not None:
                m.close()
        self.data = self.pad = None
        if self.ctrl_addr:
            unmap_addr(self.ctrl_addr, self.ctrl_bytes)
            self.ctrl_addr = 0
