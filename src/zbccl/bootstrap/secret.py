"""The job's secret: what makes a value read from the rendezvous store trustworthy.

The store (a TCPStore port) is readable and writable by any local user, so
nothing read from it is believed on its own. Once the heap is up, every value
zbccl writes there is *sealed*: ``b"ZB1" + HMAC-SHA256(key, job_id, store key,
payload) + payload``, and every value read back is *opened*: the MAC is
checked (``hmac.compare_digest``) before anything is parsed, let alone
unpickled. A value moved to another key, from an earlier job or another
group's prefix fails, since the key and the job id are under the MAC.

Where the key comes from is the transport's business; this object only
holds it. The CPU transport derives it from random bytes each rank writes into
its own segment's header before the segment is handed out (memfds given only
to processes of the job's uid, checked by ``SO_PEERCRED``), so only holders of
every segment of the job know it, and it never goes through the store. A
transport between hosts (Mooncake) would agree on it in its own authenticated
handshake and build the same object from it.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

__all__ = ["JobSecret", "SealError", "SHARE_BYTES"]

#: Bytes of each rank's share of the secret.
SHARE_BYTES = 32
_MAGIC = b"ZB1"
_MAC_BYTES = 32


class SealError(ValueError):
    """A store value failed authentication (the caller names the key and the op)."""


class JobSecret:
    """A per-job key: :meth:`seal` what goes into the store, :meth:`open` what comes out.

    Pure computation (no I/O); the same on every rank of the job.
    """

    def __init__(self, key: bytes, job_id: str) -> None:
        if len(key) < 16:
            raise ValueError(f"job secret too short, expected at least 16 bytes, got {len(key)}")
        self._key = bytes(key)
        self.job_id = job_id

    @classmethod
    def from_shares(cls, shares: Sequence[bytes], job_id: str) -> JobSecret:
        """The key of a job whose ranks each contributed ``shares[rank]`` (random, secret bytes)."""
        h = hashlib.sha256(b"zbccl job secret\0" + job_id.encode() + b"\0")
        for share in shares:
            h.update(len(share).to_bytes(4, "little") + share)
        return cls(h.digest(), job_id)

    def _mac(self, key: str, payload: bytes) -> bytes:
        msg = self.job_id.encode() + b"\0" + key.encode() + b"\0" + payload
        return hmac.new(self._key, msg, hashlib.sha256).digest()

    def seal(self, key: str, payload: bytes) -> bytes:
        """``payload`` as stored under ``key``: magic, MAC, payload."""
        return _MAGIC + self._mac(key, payload) + payload

    def open(self, key: str, blob: bytes) -> bytes:
        """The payload sealed under ``key``; :class:`SealError` when ``blob`` was not sealed by this job."""
        blob = bytes(blob)
        if len(blob) < len(_MAGIC) + _MAC_BYTES or not blob.startswith(_MAGIC):
            raise SealError(f"a {len(blob)}-byte value without the job's seal")
        mac, payload = blob[len(_MAGIC):len(_MAGIC) + _MAC_BYTES], blob[len(_MAGIC) + _MAC_BYTES:]
        if not hmac.compare_digest(mac, self._mac(key, payload)):
            raise SealError(f"a {len(blob)}-byte value whose MAC does not match the job's secret")
        return payload

    def __repr__(self) -> str:  # never the key
        return f"JobSecret(job={self.job_id})"
