"""The segment handout under attack: theft, stall, squatting, stale descriptors, forged segments; and the
rendezvous store under attack: a forged pickle, mailbox offset, slot record and slot counter, written into the
job's TCPStore by uid 65534 (its wire protocol, standard library only), each refused naming the forged key.

The attacker of the theft and stall cases runs as uid/gid 65534 (``setpriv``;
CI runs as root) with the system ``/usr/bin/python3`` and the standard library
only, as an unprivileged local user would. It learns the job's socket names
the way anyone can: from ``/proc/net/unix``. The squatters run as the job's
own user, from the test's interpreter.

Ordering without sleeps: the tests wrap rank 1's first segment request;
inside rank 1's ``init``, once both servers serve, the wrapper runs the attacker,
which reads the job's listeners from ``/proc/net/unix`` (rank 0's is among them), and
rank 1 goes on only when the attacker has finished (or, for the stall, holds
its silent connections). Rank 0 meanwhile waits for rank 1 in ``init``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from tests.spawn import run_world

MiB = 1 << 20
NOBODY = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", "/usr/bin/python3"]
needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None or not os.path.exists("/usr/bin/python3"),
    reason="runs an attacker as uid 65534: needs root, setpriv and /usr/bin/python3")

# The unprivileged attacker: standard library only; argv = job id, mode.
ATTACKER = r"""
import json, os, socket, struct, sys, time
job, mode = sys.argv[1], sys.argv[2]
deadline, names = time.monotonic() + 30, []
while not names and time.monotonic() < deadline:
    with open("/proc/net/unix") as f:
        rows = [ln.split() for ln in list(f)[1:]]
    # Listening sockets (flag __SO_ACCEPTCON) of this job.
    names = sorted({r[7] for r in rows if len(r) >= 8 and r[3] == "00010000" and f"zbccl-{job}-" in r[7]})
    if not names:
        time.sleep(0.005)  # polling /proc, not synchronising
out = {"uid": os.geteuid(), "names": names, "fds": 0, "tries": []}
held = []
for name in names:
    for rank in range(4 if mode == "steal" else 1):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(3)
        try:
            s.connect("\0" + name[1:])
            if mode == "stall":
                held.append(s)
                continue
            s.sendall(struct.pack("<q", rank))
            msg, fds, _, _ = socket.recv_fds(s, 16, 4)
            out["fds"] += len(fds)
            out["tries"].append(f"rank {rank}: got {msg!r} with {len(fds)} descriptors")
        except OSError as exc:
            out["tries"].append(f"rank {rank}: {type(exc).__name__}: {exc}")
        if mode == "steal":
            s.close()
print(json.dumps(out), flush=True)
if mode == "stall":
    sys.stdin.read()  # hold the silent connections until the test closes our stdin
"""

# A same-user squatter: binds the exact name given (without its leading NUL)
# and hands its own memfd of the given size to whoever connects.
SQUATTER = r"""
import os, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind("\0" + sys.argv[1])
s.listen(8)
print("bound", flush=True)
fd = os.memfd_create("squatter")
os.ftruncate(fd, int(sys.argv[2]))
while True:
    conn, _ = s.accept()
    try:
        socket.send_fds(conn, [b"z"], [fd])
    except OSError:
        pass
    conn.close()
"""


def _listeners(fragment: str) -> list[str]:
    with open("/proc/net/unix") as f:
        rows = [ln.split() for ln in list(f)[1:]]
    return [r[7] for r in rows if len(r) >= 8 and r[3] == "00010000" and fragment in r[7]]


def _own_socket_names() -> list[str]:
    """Unix socket names bound by sockets this process holds."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            m = re.fullmatch(r"socket:\[(\d+)\]", os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
        if m:
            inodes.add(m.group(1))
    with open("/proc/net/unix") as f:
        rows = [ln.split() for ln in list(f)[1:]]
    return [r[7] for r in rows if len(r) >= 8 and r[6] in inodes]


def _check_all_reduce(comm) -> None:
    import zbccl

    t = zbccl.empty(1000, dtype=torch.float32)
    t.copy_(torch.arange(1000, dtype=torch.float32) * (comm.rank + 1))
    zbccl.all_reduce(t)
    want = torch.arange(1000, dtype=torch.float32) * sum(r + 1 for r in range(comm.world_size))
    assert torch.equal(t, want), (t[:4], want[:4])


def _attacked(ctx, mode):
    import zbccl
    from zbccl.heap.transports.shm import transport as shm

    attackers: list[subprocess.Popen] = []
    reports: list[dict] = []
    if ctx.rank == 1:
        real = shm.receive_fd

        def receive(job_id, peer, *, timeout):
            # Rank 0's server is serving now and waits for rank 1's request: attack every
            # listener of the job before rank 1 goes on (rank 1's own closes once rank 0 was served).
            if not attackers:
                p = subprocess.Popen(NOBODY + ["-c", ATTACKER, job_id, mode], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd="/")
                attackers.append(p)
                reports.append(json.loads(p.stdout.readline() or "{}"))
            return real(job_id, peer, timeout=timeout)

        shm.receive_fd = receive
    try:
        t0 = time.monotonic()
        comm = ctx.init(heap_size=MiB, timeout=60)  # a stalling attacker holds its connections throughout
        elapsed = time.monotonic() - t0
        _check_all_reduce(comm)
        live = [comm.heap.native.liveness_fd(r) for r in range(comm.world_size) if r != ctx.rank]
        assert all(fd >= 0 and not os.get_inheritable(fd) for fd in live), "liveness fds must be close-on-exec"
        zbccl.finalize()
    finally:
        for p in attackers:
            p.stdin.close()
            p.wait(10)
    return {"report": reports[0] if reports else None, "init_s": elapsed}


@needs_root
def test_unprivileged_user_gets_no_descriptor_and_the_job_runs():
    _, out = run_world(_attacked, 2, mode="steal", timeout=120)
    report = out["report"]
    assert report["uid"] == 65534, report
    assert any("-0-" in n for n in report["names"]), f"the attacker did not find rank 0's listener: {report}"
    assert report["fds"] == 0, f"an unprivileged process received a segment descriptor: {report['tries']}"


@needs_root
def test_silent_connection_does_not_delay_init():
    _, out = run_world(_attacked, 2, mode="stall", timeout=120)
    assert any("-0-" in n for n in out["report"]["names"]), out["report"]
    # The init timeout is 60 s: a server waiting on the silent client would take that long.
    assert out["init_s"] < 15, f"init took {out['init_s']:.1f}s with a silent connection open"


def _squatter(name: str, nbytes: int) -> subprocess.Popen:
    """Start a same-user process that binds ``name`` (leading NUL included) and serves its own memfd."""
    p = subprocess.Popen([sys.executable, "-c", SQUATTER, name[1:], str(nbytes)], stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline().strip() == "bound"
    return p


class _NoServer:
    """Stands in for rank 1's segment server when the test takes its name away."""

    error = None

    def serve(self, members) -> None:
        pass

    def stop(self) -> None:
        pass


def _squatted(ctx, how):
    import zbccl
    from zbccl.heap.transports import handout
    from zbccl.heap.transports.shm import transport as shm

    squatters: list[subprocess.Popen] = []
    seen: dict[str, str] = {}
    if ctx.rank == 1:
        real = shm.FdServer

        def server(job_id, rank, token, fd):
            seen["job"] = job_id
            squatters.append(_squatter(handout.sock_name(job_id, rank, token), os.fstat(fd).st_size))
            # "first": the squatter got there before us; "pid": it holds our published name instead of us.
            return real(job_id, rank, token, fd) if how == "first" else _NoServer()

        shm.FdServer = server
    try:
        t0 = time.monotonic()
        with pytest.raises(zbccl.ZbcclError) as info:
            ctx.init(heap_size=MiB, timeout=60)
        elapsed = time.monotonic() - t0
    finally:
        for p in squatters:
            p.kill()
            p.wait(10)
    held = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
            if os.path.exists(f"/proc/self/fd/{fd}")]
    with open("/proc/self/maps") as f:
        maps = f.read()
    assert "squatter" not in maps and not any("squatter" in h for h in held), "the squatter's memfd got in"
    assert not zbccl.is_initialized()
    return {"type": type(info.value).__name__, "msg": str(info.value), "ranks": info.value.ranks,
            "elapsed": elapsed}


def test_name_taken_first_fails_clearly_on_every_rank():
    r0, r1 = run_world(_squatted, 2, how="first", timeout=120)
    assert r1["type"] == "ZbcclSystemError" and "already bound" in r1["msg"], r1
    assert r0["type"] == "ZbcclRemoteError" and r0["ranks"] == (1,) and "already bound" in r0["msg"], r0
    assert r0["elapsed"] < 20 and r1["elapsed"] < 20, (r0, r1)


def test_name_held_by_another_process_is_refused_by_pid():
    r0, r1 = run_world(_squatted, 2, how="pid", timeout=120)
    assert r0["type"] == "ZbcclSystemError" and r0["ranks"] == (1,), r0
    assert "held by another process" in r0["msg"] and "expected pid" in r0["msg"], r0
    assert r1["type"] == "ZbcclRemoteError" and r1["ranks"] == (0,), r1
    assert r0["elapsed"] < 20 and r1["elapsed"] < 20, (r0, r1)


def _stale(ctx):
    import zbccl
    from zbccl.heap.transports.shm import transport as shm

    store = ctx.store()
    job: dict[str, str] = {}
    if ctx.rank == 1:
        def server(job_id, rank, token, fd):
            job["id"] = job_id
            return _NoServer()  # rank 1 never listens: rank 0 fails while its own server is up

        shm.FdServer = server
    with pytest.raises(zbccl.ZbcclError) as info:
        ctx.init(heap_size=MiB, timeout=60)
    if ctx.rank == 0:
        assert info.value.ranks == (1,) and "could not reach rank 1" in str(info.value), str(info.value)
        # The failed init stopped its server before closing the memfd.
        alive = [t.name for t in threading.enumerate() if t.name.startswith("zbccl-fdserver")]
        assert not alive, f"segment server threads outlived the failed init: {alive}"
        assert not [n for n in _own_socket_names() if "zbccl" in n], _own_socket_names()
        # Take the freed descriptor numbers, as the next sockets of a real program would.
        spare = [socket.socketpair() for _ in range(8)]
        store.set("sec/failed", b"1")
        store.get("sec/checked")
        for a, b in spare:
            a.close()
            b.close()
        return "failed"
    store.get("sec/failed")
    left = _listeners(f"zbccl-{job['id']}-0-")
    store.set("sec/checked", b"1")
    assert not left, f"rank 0 still serves its segment after a failed init: {left}"
    return "checked"


def test_failed_init_stops_the_server_before_closing_the_segment():
    assert run_world(_stale, 2, timeout=120) == ["failed", "checked"]


def _forged_cookie(ctx):
    import zbccl
    from zbccl.heap.transports.shm import transport as shm

    if ctx.rank == 1:
        real = shm._store_i64
        shm._store_i64 = lambda addr, value: real(addr, value ^ 0x5A5A)  # not the published value
    with pytest.raises(zbccl.ZbcclError) as info:
        ctx.init(heap_size=MiB, timeout=60)
    with open("/proc/self/maps") as f:
        assert "/memfd:zbccl-" not in f.read(), "a refused segment is still mapped"
    return type(info.value).__name__, str(info.value), info.value.ranks


def test_segment_with_wrong_cookie_is_refused_and_unmapped():
    (t0, m0, ranks0), (t1, _, ranks1) = run_world(_forged_cookie, 2, timeout=120)
    assert t0 == "ZbcclRemoteError" and ranks0 == (1,) and "cookie" in m0, m0
    assert t1 == "ZbcclRemoteError" and ranks1 == (0,)


def _fetch(job: str, token: str, *, timeout: float = 5.0) -> tuple[bytes, list[int]]:
    """Connect to rank 0's server of ``job`` from this process; what it sends back."""
    from zbccl.heap.transports.handout import sock_name

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(sock_name(job, 0, token))
        msg, fds, _, _ = socket.recv_fds(s, 16, 4)
        return msg, fds
    finally:
        s.close()


def test_server_answers_only_members_and_vanishes_when_stopped():
    # In one process: SO_PEERCRED of our own connections is our pid, so a
    # member list without it must get nothing, and one with it the descriptor.
    from zbccl.heap.transports.handout import FdServer, Member

    fd = os.memfd_create("zbccl-test-handout", os.MFD_CLOEXEC)
    try:
        stranger = FdServer("unit", 0, "t1", fd)
        stranger.serve([Member(1, os.getpid() + 1_000_000, os.geteuid(), "x", 1)])
        msg, fds = _fetch("unit", "t1")
        assert (msg, fds) == (b"", []), "a non-member got an answer"
        stranger.stop()
        assert not stranger.is_alive() and not _listeners("zbccl-unit-0-t1")

        member = FdServer("unit", 0, "t2", fd)
        member.serve([Member(1, os.getpid(), os.geteuid(), "x", 1)])
        msg, fds = _fetch("unit", "t2")
        try:
            assert msg == b"z" and len(fds) == 1
            assert os.fstat(fds[0]).st_ino == os.fstat(fd).st_ino
        finally:
            for f in fds:
                os.close(f)
        member.join(10)
        assert not member.is_alive(), "the server did not finish once every member was served"
        assert not _listeners("zbccl-unit-0-t2"), "the name outlived the last handout"
        member.stop()
    finally:
        os.close(fd)


def test_local_ranks_must_share_one_uid():
    from zbccl.heap.transports.handout import Member
    from zbccl.heap.transports.handout import check_uids as _check_uids

    me = Member(0, 1, 1000, "a", 1)
    assert _check_uids(me, {1: Member(1, 2, 1000, "b", 2)}) is None
    err = _check_uids(me, {1: Member(1, 2, 65534, "b", 2)})
    assert err is not None and err.ranks == (1,) and "expected uid 1000" in str(err), err


# ---------------------------------------------------------------- the rendezvous store
# An unprivileged writer of the job's TCPStore: standard library only, speaking the store's
# wire protocol (VALIDATE, then SET per key, then CHECK to know the value landed).
# argv = port, then key/hex-value pairs (keys as the store holds them, with their leading '/').
STORE_WRITER = r"""
import json, os, socket, struct, sys
port, pairs = int(sys.argv[1]), sys.argv[2:]
def string(b):
    return struct.pack("<Q", len(b)) + b
s = socket.create_connection(("127.0.0.1", port), timeout=10)
s.sendall(bytes([0]) + struct.pack("<I", 0x3C85F7CE))
for key, value in zip(pairs[::2], pairs[1::2]):
    s.sendall(bytes([1]) + string(key.encode()) + string(bytes.fromhex(value)))
    s.sendall(bytes([5]) + struct.pack("<Q", 1) + string(key.encode()))
    assert s.recv(1) == b"\x00", "the forged key did not land"
print(json.dumps({"uid": os.geteuid(), "written": pairs[::2]}), flush=True)
"""


def _nobody_writes(port: int, values: dict[str, bytes]) -> None:
    """Write ``values`` into the store at ``port`` as uid 65534 (keys relative to the store, no leading '/')."""
    args = [x for k, v in values.items() for x in ("/" + k, v.hex())]
    out = subprocess.run(NOBODY + ["-c", STORE_WRITER, str(port)] + args, capture_output=True, text=True,
                         timeout=60, cwd="/")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["uid"] == 65534 and len(report["written"]) == len(values), report


class _Plant:
    """Unpickling this runs ``os.mkdir(path)``: what an attacker's pickle would do as the job's user."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def _forged_object(ctx, marker):
    import pickle

    import zbccl

    comm = ctx.init(heap_size=MiB, timeout=60)
    store = ctx.store()
    key = comm.bootstrap._key("object/0/1")
    if ctx.rank == 0:
        # Rank 1 is late (it waits for sec/raised): the attacker's pickle sits under its key.
        _nobody_writes(ctx.port, {key: pickle.dumps(_Plant(marker))})
        with pytest.raises(zbccl.ZbcclError) as info:
            comm.all_gather_object({"rank": 0})
        store.set("sec/raised", b"1")
        out = ("raised", type(info.value).__name__, str(info.value), info.value.ranks)
    else:
        store.get("sec/raised")
        out = ("got", comm.all_gather_object({"rank": 1}))  # its own set replaced the forgery
    assert not os.path.exists(marker), "the job unpickled a value an unprivileged user wrote to the store"
    zbccl.finalize()
    return out, key


@needs_root
def test_forged_pickle_in_the_store_is_never_unpickled(tmp_path):
    os.chmod(tmp_path, 0o777)  # the marker could be made by anyone: its absence shows nothing ran as us
    (r0, key), (r1, _) = run_world(_forged_object, 2, marker=str(tmp_path / "planted"), timeout=120)
    kind, name, msg, ranks = r0
    assert kind == "raised" and name == "ZbcclRemoteError" and ranks == (1,), r0
    assert f"'{key}'" in msg and "forged" in msg and msg.startswith("all_gather_object:"), msg
    assert r1 == ("got", [{"rank": 0}, {"rank": 1}]), r1


def _forged_mailbox(ctx):
    import zbccl
    from zbccl.adapters import p2p

    comm = ctx.init(heap_size=MiB, timeout=60)
    store = ctx.store()
    pp = p2p.PointToPoint(comm)
    key = comm.bootstrap._key(pp._key(0))
    n = 256
    if ctx.rank == 0:
        pp.send([torch.arange(n, dtype=torch.float32)], 1, 0)  # staged: completes at once
        # A decoy mailbox the attacker aims rank 1's reads at: it "posts" one message whose payload is
        # another heap block of wrong values (what a store writer could point at in rank 0's heap).
        words = comm.world_size * p2p._PEER_WORDS
        decoy = zbccl.zeros(words, dtype=torch.int64)
        wrong = zbccl.empty(n, dtype=torch.float32).fill_(-1.0)
        base = 1 * p2p._PEER_WORDS + p2p._WORDS
        decoy[base + p2p.SEQ], decoy[base + p2p.TAG] = 1, 0
        decoy[base + p2p.OFFSET] = wrong.data_ptr() - comm.heap_base
        decoy[base + p2p.NBYTES] = n * 4
        decoy[1 * p2p._PEER_WORDS] = 1
        _nobody_writes(ctx.port, {key: str(decoy.data_ptr() - comm.heap_base).encode()})
        store.set("sec/forged", b"1")
        store.get("sec/done")
        out = None
    else:
        store.get("sec/forged")
        got = torch.zeros(n, dtype=torch.float32)
        with pytest.raises(zbccl.ZbcclError) as info:
            pp.recv([got], 0, 0).wait(timeout=30)
        store.set("sec/done", b"1")
        assert not torch.equal(got, torch.full((n,), -1.0)), "the receiver read the attacker's decoy"
        out = (type(info.value).__name__, str(info.value), info.value.ranks)
    pp.close()
    zbccl.finalize()
    return out, key


@needs_root
def test_forged_mailbox_offset_is_refused():
    _, ((name, msg, ranks), key) = run_world(_forged_mailbox, 2, timeout=120)
    assert name == "ZbcclRemoteError" and ranks == (0,), msg
    assert f"'{key}'" in msg and "forged" in msg, msg


def _forged_slot(ctx, how):
    import zbccl

    comm = ctx.init(heap_size=MiB, timeout=60)
    store = ctx.store()
    if how == "record":
        # Rank 1 is late: once the leader published group [0, 1]'s slot, the attacker replaces it with the
        # world's slot 0 (the two would share their flag lines).
        key = comm.bootstrap._key("group/0-1/0")
        if ctx.rank == 1:
            store.wait([key])
            _nobody_writes(ctx.port, {key: b"0:1:" + b"0" * 16})
            with pytest.raises(zbccl.ZbcclError) as info:
                comm.new_group([0, 1])
            store.set("sec/refused", b"1")
        else:
            with pytest.raises(zbccl.ZbcclError) as info:
                comm.new_group([0, 1], timeout=5)  # rank 1 refused the slot: it never reaches the group barrier
            store.get("sec/refused")
    else:
        # The attacker frees the slot a live group holds: the next group is handed the same slot.
        first = comm.new_group([0, 1])
        held = comm.bootstrap._key(f"slot/{first.slot}/held")
        if ctx.rank == 0:
            _nobody_writes(ctx.port, {held: b"0"})
        comm.barrier()
        key = comm.bootstrap._key("group/0-1/1")
        with pytest.raises(zbccl.ZbcclError) as info:
            comm.new_group([0, 1])
        # Refusing the slot is a remote error (the store lied): each rank marks its ABORT line as it leaves
        # new_group, so `first` is broken too (its destroy's barrier may name the peer that left, whichever
        # rank gets there second): finalize, as the error says.
        del first
    zbccl.finalize()
    return type(info.value).__name__, str(info.value), info.value.ranks, key


@needs_root
def test_forged_slot_record_is_refused():
    (n0, m0, r0, _), (n1, m1, r1, key) = run_world(_forged_slot, 2, how="record", timeout=120)
    assert n1 == "ZbcclRemoteError" and r1 == (0,) and f"'{key}'" in m1 and "forged" in m1, m1
    # Rank 0 waits in the group's barrier for rank 1, which refused the slot: it names rank 1, either as
    # gone (the liveness rule sees rank 1 leave or finalize) or, if its 5 s ran out first, as late.
    assert n0 in ("ZbcclRemoteError", "ZbcclTimeoutError") and r0 == (1,), m0


@needs_root
def test_slot_freed_in_the_store_is_not_shared():
    for name, msg, _, key in run_world(_forged_slot, 2, how="counter", timeout=120):
        assert name == "ZbcclRemoteError" and "in use on this rank" in msg and f"'{key}'" in msg, msg


def _forged_init_record(ctx):
    import zbccl
    from zbccl.runtime import state

    store = ctx.store()
    if ctx.rank == 1:  # late: rank 0 has published its capacity verdict and waits for ours
        real = state.check_capacity

        def late(*args, **kwargs):
            key = "zbccl/1/capacity/0/0"  # the first init on this store: generation 1
            store.wait([key])
            _nobody_writes(ctx.port, {key: b"null "})  # still "no error" as JSON, but not rank 0's bytes
            return real(*args, **kwargs)

        state.check_capacity = late
    with pytest.raises(zbccl.ZbcclError) as info:
        ctx.init(heap_size=MiB, timeout=60)
    assert not zbccl.is_initialized()
    with open("/proc/self/maps") as f:
        assert "/memfd:zbccl-" not in f.read(), "a failed init left its segments mapped"
    return type(info.value).__name__, str(info.value), info.value.ranks


@needs_root
def test_forged_init_record_fails_init_on_every_rank():
    for name, msg, ranks in run_world(_forged_init_record, 2, timeout=120):
        assert name == "ZbcclRemoteError" and ranks == (0,), msg
        assert "forged store value under key 'zbccl/1/capacity/0/0'" in msg, msg
