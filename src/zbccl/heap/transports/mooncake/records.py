"""What the mooncake transport's ranks exchange through the bootstrap store, and the job cookie's key.

Each rank publishes ``{session id, ip, port, hostname, pad, data, ctrl}`` of its engine (or the error it
hit). With ``ZBCCL_JOB_COOKIE`` set, every record is sealed with the cookie's key (HMAC-SHA256 over job id,
store key and payload) and a record the key does not open fails setup on every rank, naming its writer.
Records are parsed strictly either way: the store is not authenticated without a cookie.
"""

from __future__ import annotations

import hashlib
import json

from .... import env
from ....bootstrap.base import Bootstrap
from ....bootstrap.secret import JobSecret, SealError
from ....bootstrap.store import in_range, parse_record
from ....errors import ZbcclError, ZbcclRemoteError
from .liveness import Peer

__all__ = ["cookie_secret", "exchange", "peer_of", "store_host"]


def cookie_secret(job_id: str) -> JobSecret | None:
    """The job's key from ``ZBCCL_JOB_COOKIE`` (the launcher's secret), or None when it is unset."""
    cookie = env.JOB_COOKIE.get()
    if not cookie:
        return None
    return JobSecret(hashlib.sha256(b"zbccl job cookie\0" + cookie.encode()).digest(), job_id)


def exchange(bootstrap: Bootstrap, secret: JobSecret | None, record: dict | None, error: ZbcclError | None, *,
         timeout: float, key: str, tag: str) -> list[dict]:
    """All-gather ``record`` (or this rank's error), sealed with the cookie's key when there is one;
    raise on every rank when any rank failed or sent what the key does not open."""
    me = bootstrap.rank
    raw = json.dumps({"error": str(error)} if error is not None else record).encode()
    if secret is not None:
        raw = secret.seal(f"{key}/{me}", raw)
    got = bootstrap.all_gather(raw, timeout=timeout, tag=tag)
    if error is not None:
        raise error
    out, failed = [], []
    for r, blob in enumerate(got):
        if secret is not None:
            try:
                blob = secret.open(f"{key}/{r}", blob)
            except SealError as exc:
                failed.append((r, f"its record is not sealed with this job's cookie ({exc}); expected "
                                  "ZBCCL_JOB_COOKIE to be the same on every rank"))
                continue
        d = parse_record(blob, _dict_of, op="heap", rank=r, what="a JSON object (a Mooncake record)")
        if d.get("error"):
            failed.append((r, str(d["error"])))
        out.append(d)
    if failed:
        what = "; ".join(f"rank {r}: {e}" for r, e in failed)
        raise ZbcclRemoteError(f"heap: a rank could not set up the mooncake transport: {what}",
                               ranks=tuple(r for r, _ in failed))
    return out


def store_host(bootstrap: Bootstrap) -> str | None:
    """The host of the TCPStore under ``bootstrap`` (through PrefixStores), or None."""
    store = getattr(bootstrap, "store", None)
    for _ in range(8):
        if store is None:
            return None
        host = getattr(store, "host", None)
        if isinstance(host, str) and host:
            return host
        store = getattr(store, "underlying_store", None)
    return None


def _dict_of(d) -> dict:
    if not isinstance(d, dict):
        raise TypeError(d)
    return d


def peer_of(rank: int, d: dict, reserved: int) -> Peer:
    """A peer's record, checked field by field (sealed or not, parsed strictly)."""
    def check(_) -> Peer:
        sid, ip, host = d["sid"], d["ip"], d["hostname"]
        port = in_range(d["port"], 1, 65535)
        if not (isinstance(ip, str) and isinstance(host, str) and sid == f"{ip}:{port}" and len(host) < 256):
            raise ValueError(sid)
        return Peer(rank, sid, ip, port, host, in_range(d["pad"], 1, (1 << 64) - 1),
                    in_range(d["data"], 1, (1 << 64) - 1), in_range(d["ctrl"], 1, (1 << 64) - 1), reserved)

    return parse_record(json.dumps(d).encode(), check, op="heap", rank=rank,
                        what="{sid, ip, port, hostname, pad, data, ctrl} of a Mooncake engine")
