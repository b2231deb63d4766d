"""The job secret and the sealed store: nothing read from the store is believed without the job's MAC."""

from __future__ import annotations

import threading

import pytest
import torch.distributed as dist

from zbccl.bootstrap.secret import JobSecret, SealError
from zbccl.bootstrap.store import StoreBootstrap
from zbccl.errors import ZbcclRemoteError

SECRET = JobSecret.from_shares([b"a" * 32, b"b" * 32], "job1")


def test_seal_opens_only_under_the_same_key_job_and_secret():
    blob = SECRET.seal("zbccl/1/object/0/1", b"payload")
    assert SECRET.open("zbccl/1/object/0/1", blob) == b"payload"
    for key, secret in (("zbccl/1/object/1/1", SECRET),  # moved to another key
                        ("zbccl/1/object/0/1", JobSecret.from_shares([b"a" * 32, b"c" * 32], "job1")),
                        ("zbccl/1/object/0/1", JobSecret.from_shares([b"a" * 32, b"b" * 32], "job2"))):
        with pytest.raises(SealError):
            secret.open(key, blob)
    flipped = bytearray(blob)
    flipped[-1] ^= 1
    for bad in (bytes(flipped), b"payload", b"", blob[:20]):
        with pytest.raises(SealError):
            SECRET.open("zbccl/1/object/0/1", bad)
    assert "a" * 8 not in repr(SECRET)


def _pair(store, **kw) -> list[StoreBootstrap]:
    return [StoreBootstrap(store, r, 2, prefix="t/1", **kw) for r in range(2)]


def _both(fn0, fn1) -> list:
    out: list = [None, None]

    def run(i, fn):
        try:
            out[i] = fn()
        except BaseException as exc:  # noqa: BLE001 - inspected by the test
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate((fn0, fn1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_sealed_values_round_trip_and_a_forgery_names_its_key():
    store = dist.HashStore()
    b0, b1 = _pair(store, secret=SECRET)
    assert _both(lambda: b0.all_gather(b"x0", timeout=10), lambda: b1.all_gather(b"x1", timeout=10)) == \
        [[b"x0", b"x1"]] * 2
    b0.set("box", b"128")
    assert b1.get("box", timeout=5, owner=0) == b"128"
    store.set("t/1/box", b"4096")  # a store writer's value
    with pytest.raises(ZbcclRemoteError) as info:
        b1.get("box", timeout=5, owner=0)
    assert "'t/1/box'" in str(info.value) and info.value.ranks == (0,)


def test_init_records_forged_before_the_secret_are_caught_on_every_rank():
    store = dist.HashStore()
    b0, b1 = _pair(store, record=True)
    t0 = threading.Thread(target=lambda: b0.all_gather(b"hello0", timeout=10, tag="hello"))
    t0.start()
    store.wait(["t/1/hello/0/0"])
    store.set("t/1/hello/0/0", b"forged")  # while rank 1 is late; rank 0 reads it back too
    got1 = b1.all_gather(b"hello1", timeout=10, tag="hello")
    t0.join(10)
    assert got1 == [b"forged", b"hello1"]
    errors = _both(lambda: b0.adopt_secret(SECRET, timeout=10), lambda: b1.adopt_secret(SECRET, timeout=10))
    for err in errors:
        assert isinstance(err, ZbcclRemoteError) and "'t/1/hello/0/0'" in str(err) and err.ranks == (0,), err


def test_untouched_init_records_pass_and_sealing_starts():
    store = dist.HashStore()
    b0, b1 = _pair(store, record=True)
    _both(lambda: b0.all_gather(b"h0", timeout=10, tag="hello"), lambda: b1.all_gather(b"h1", timeout=10, tag="hello"))
    assert _both(lambda: b0.adopt_secret(SECRET, timeout=10), lambda: b1.adopt_secret(SECRET, timeout=10)) == \
        [None, None]
    b0.set("k", b"v")
    assert store.get("t/1/k") != b"v" and SECRET.open("t/1/k", store.get("t/1/k")) == b"v"


class _ForgesBeforeRead:
    """Rank 1's view of the store: once rank 0 has read its round, a store writer replaces rank 0's value."""

    def __init__(self, store, key: str, rank0_done: threading.Event) -> None:
        self._store, self._key, self._done = store, key, rank0_done

    def multi_get(self, keys):
        self._done.wait(10)
        self._store.set(self._key, b"forged")
        return self._store.multi_get(keys)

    def __getattr__(self, name):
        return getattr(self._store, name)


def test_a_forgery_only_one_rank_read_fails_every_rank():
    store, done = dist.HashStore(), threading.Event()
    b0 = StoreBootstrap(store, 0, 2, prefix="t/1", record=True)
    b1 = StoreBootstrap(_ForgesBeforeRead(store, "t/1/hello/0/0", done), 1, 2, prefix="t/1", record=True)

    def rank0():
        try:
            return b0.all_gather(b"hello0", timeout=10, tag="hello")
        finally:
            done.set()

    got = _both(rank0, lambda: b1.all_gather(b"hello1", timeout=10, tag="hello"))
    assert got == [[b"hello0", b"hello1"], [b"forged", b"hello1"]]
    errors = _both(lambda: b0.adopt_secret(SECRET, timeout=10), lambda: b1.adopt_secret(SECRET, timeout=10))
    for err in errors:
        assert isinstance(err, ZbcclRemoteError) and "'t/1/hello/0/0'" in str(err) and err.ranks == (0,), err
    assert "read by rank 1" in str(errors[0]) and "read by this rank" in str(errors[1])


@pytest.mark.parametrize("raw", [b"not json", b"[]", b'{"pid": 5}', b'{"pid": "5", "uid": 0, "token": "' + b"a" * 32
                                 + b'", "cookie": 1}', b'{"pid": 5, "uid": 0, "token": "zz", "cookie": 1}',
                                 b'{"pid": 5, "uid": 0, "token": "' + b"a" * 32 + b'", "cookie": 1e300}',
                                 b'{"pid": true, "uid": 0, "token": "' + b"a" * 32 + b'", "cookie": 1}'])
def test_init_records_are_parsed_strictly(raw):
    from zbccl.heap.transports.handout import member_of as _member_of

    with pytest.raises(ZbcclRemoteError) as info:
        _member_of(3, raw)
    assert info.value.ranks == (3,) and "malformed record of rank 3" in str(info.value)
    good = b'{"pid": 5, "uid": 0, "token": "' + b"a" * 32 + b'", "cookie": 7}'
    assert _member_of(3, good).cookie == 7


def test_hello_records_are_parsed_strictly():
    import json

    from zbccl.bootstrap.store import parse_record
    from zbccl.bootstrap.topology import local_host_info
    from zbccl.runtime.state import _hello_of

    good = {"version": "1", "host": local_host_info().to_dict(), "heap": 1 << 20, "heap_max": None, "job": None}
    assert parse_record(json.dumps(good).encode(), _hello_of, op="init", rank=1, what="x")["heap"] == 1 << 20
    for change in ({"heap": -1}, {"heap": 1 << 70}, {"heap": "1M"}, {"heap_max": 2.5}, {"host": {}},
                   {"version": 3}, {"host": dict(good["host"], pid=-4)}):
        with pytest.raises(ZbcclRemoteError, match="malformed record of rank 1"):
            parse_record(json.dumps(dict(good, **change)).encode(), _hello_of, op="init", rank=1, what="x")
