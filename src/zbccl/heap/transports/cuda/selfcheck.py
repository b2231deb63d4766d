"""``python -m zbccl.heap.transports.cuda.selfcheck``: can two processes on GPU 0 share VMM memory?

Standalone (no zbccl runtime, no store): two spawned processes on device 0
each create a VMM segment, hand each other its descriptor over an abstract
Unix socket (``SCM_RIGHTS``), import and map the peer's, and then check, each
on its own line ``CHECK <name> PASS|FAIL <detail>``:

* ``torch_peer_read``: the peer's values (``f(rank, i)``) read through the mapping by a torch op;
* ``triton_peer_read``: the same through a Triton kernel loading from an int64 table of base pointers;
* ``dlpack_peer_read``: the same through a DLPack view (the way a peer GPU's memory is wrapped);
* ``peer_write``: values written into the peer's memory are seen by the peer in its own;
* ``stream_write_value64``: a ``cuStreamWriteValue64`` into the peer's memory is seen there;
* ``triton_atomic``: system-scope atomic adds from both processes onto one word sum exactly;
* ``growth``: a second chunk mapped after the first (and imported by the peer) is read and written;
* ``unmap``: every mapping, handle and range released.

It prints the environment first (torch, triton, cuda-bindings, GPU, MPS) and
some ``INFO`` timings (a peer word's host read, a cross-process signal round
trip through host polling). Every wait has a timeout; the whole run ends in
well under 60 s, and a rank that hangs is killed and reported. Exit status 0
when every check passed.

Usage: ``python -m zbccl.heap.transports.cuda.selfcheck [--timeout 50] [--device 0]``
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import secrets
import socket
import sys
import time
import traceback

__all__ = ["main"]

N = 1 << 16  # int64 values per rank in the first chunk's check


def _f(rank: int, i, salt: int = 0):
    return i + rank * 1_000_000 + salt * 100_000_000


def _versions() -> dict:
    out = {"python": sys.version.split()[0]}
    for mod in ("torch", "triton", "cuda.bindings"):
        try:
            m = __import__(mod, fromlist=["__version__"])
            out[mod] = getattr(m, "__version__", "?")
        except Exception as exc:  # noqa: BLE001 - reported, not fatal
            out[mod] = f"missing ({type(exc).__name__})"
    return out


def _mps() -> str:
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
    return f"on ({pipe})" if os.path.exists(os.path.join(pipe, "control")) else f"off (no {pipe}/control)"


class _Peer:
    """This rank's connection to the other: fds and small messages, every call under a timeout."""

    def __init__(self, rank: int, name: str, timeout: float) -> None:
        self.timeout = timeout
        deadline = time.monotonic() + timeout
        if rank == 0:
            lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            lsock.bind(name)
            lsock.listen(1)
            lsock.settimeout(timeout)
            self.sock, _ = lsock.accept()
            lsock.close()
        else:
            while True:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    s.connect(name)
                    break
                except OSError:
                    s.close()
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"rank 1 could not connect to rank 0 within {timeout}s") from None
                    time.sleep(0.05)
            self.sock = s
        self.sock.settimeout(timeout)

    def send(self, obj, fds=()) -> None:
        data = json.dumps(obj).encode()
        socket.send_fds(self.sock, [len(data).to_bytes(4, "little") + data], list(fds))

    def recv(self, maxfds: int = 4):
        # The descriptors ride on the first byte: read the 4-byte length with them, then exactly the body
        # (a stream socket may hold the peer's next message right behind this one).
        head, fds, _, _ = socket.recv_fds(self.sock, 4, maxfds)
        while 0 < len(head) < 4:
            head += self.sock.recv(4 - len(head))
        if not head:
            raise ConnectionError("the peer closed the connection")
        size = int.from_bytes(head, "little")
        body = b""
        while len(body) < size:
            more = self.sock.recv(size - len(body))
            if not more:
                raise ConnectionError("the peer closed the connection mid-message")
            body += more
        return json.loads(body), fds

    def barrier(self, tag: str) -> None:
        self.send({"barrier": tag})
        got, _ = self.recv()
        if got != {"barrier": tag}:
            raise RuntimeError(f"barrier {tag}: the peer is at {got}")


def _check(rank: int, name: str, fn) -> bool:
    t0 = time.monotonic()
    try:
        detail = fn() or ""
        ok = True
    except Exception as exc:  # noqa: BLE001 - every check reports and the next one runs
        detail = f"{type(exc).__name__}: {exc}".replace("\n", " | ")[:400]
        traceback.print_exc(file=sys.stderr)
        ok = False
    print(f"CHECK {name} {'PASS' if ok else 'FAIL'} rank={rank} {time.monotonic() - t0:.3f}s {detail}", flush=True)
    return ok


def _rank_main(rank: int, name: str, device: int, timeout: float) -> None:  # noqa: C901 - one linear script
    import torch

    from zbccl.heap.transports.cuda import kernels, vmm
    from zbccl.heap.transports.cuda.tensors import device_tensor

    torch.cuda.set_device(device)
    dev = torch.device("cuda", device)
    torch.empty(1, device=dev)  # the primary context, as torch uses it
    vmm.ensure_context(device)
    peer = _Peer(rank, name, timeout)
    other = 1 - rank
    gran = vmm.granularity(device)
    chunk = vmm.round_up(max(8 * N * 2, 2 << 20), gran)
    mine = vmm.Mapping.reserve(device, 4 * chunk)
    theirs = vmm.Mapping.reserve(device, 4 * chunk)
    fds: list[int] = []
    ok = True
    state: dict = {}

    def setup():
        h = vmm.create(chunk, device)
        fd = vmm.export_fd(h)
        fds.append(fd)
        mine.add(h, chunk)
        peer.send({"chunk": chunk}, [fd])
        got, rfds = peer.recv()
        if len(rfds) != 1:
            raise RuntimeError(f"expected 1 descriptor from the peer, got {len(rfds)}")
        try:
            theirs.add(vmm.import_fd(rfds[0]), got["chunk"])
        finally:
            os.close(rfds[0])
        state["local"] = device_tensor(mine.va, chunk, dev).view(torch.int64)
        state["remote"] = device_tensor(theirs.va, chunk, dev).view(torch.int64)
        idx = torch.arange(N, dtype=torch.int64, device=dev)
        state["local"][:N].copy_(_f(rank, idx))
        torch.cuda.synchronize()
        peer.barrier("written")
        return f"granularity={gran} chunk={chunk} va={mine.va:#x} peer_va={theirs.va:#x}"

    if not _check(rank, "vmm_share", setup):
        sys.exit(1)

    def torch_read():
        idx = torch.arange(N, dtype=torch.int64, device=dev)
        got = state["remote"][:N].clone()
        bad = int((got != _f(other, idx)).sum())
        if bad:
            raise AssertionError(f"{bad} of {N} values wrong, first {got[:4].tolist()}")
        return f"{N} int64 of rank {other} match"

    ok &= _check(rank, "torch_peer_read", torch_read)

    def triton_read():
        ptrs = torch.tensor([mine.va, theirs.va], dtype=torch.int64, device=dev)
        rows = kernels.gather_rows(ptrs, N)
        idx = torch.arange(N, dtype=torch.int64, device=dev)
        for row, src in ((0, rank), (1, other)):
            bad = int((rows[row] != _f(src, idx)).sum())
            if bad:
                raise AssertionError(f"row {row} (rank {src}): {bad} of {N} wrong, first {rows[row][:4].tolist()}")
        return "own and peer rows match"

    ok &= _check(rank, "triton_peer_read", triton_read)

    def dlpack_read():
        from zbccl.heap.transports.cuda.tensors import KDLCUDA, dlpack_tensor

        t = dlpack_tensor(theirs.va, 8 * N, KDLCUDA, device).view(torch.int64)
        if t.device != dev or t.data_ptr() != theirs.va:
            raise AssertionError(f"expected a view on {dev} at {theirs.va:#x}, got {t.device} at {t.data_ptr():#x}")
        idx = torch.arange(N, dtype=torch.int64, device=dev)
        bad = int((t != _f(other, idx)).sum())
        if bad:
            raise AssertionError(f"{bad} of {N} wrong, first {t[:4].tolist()}")
        cai = state["remote"]
        return f"DLPack view matches; the __cuda_array_interface__ view is on {cai.device} at {cai.data_ptr():#x}"

    ok &= _check(rank, "dlpack_peer_read", dlpack_read)

    def peer_write():
        idx = torch.arange(N, dtype=torch.int64, device=dev)
        state["remote"][N:2 * N].copy_(_f(rank, idx, 1))  # into the peer's second half
        torch.cuda.synchronize()
        peer.barrier("peer-write")
        got = state["local"][N:2 * N]
        bad = int((got != _f(other, idx, 1)).sum())
        if bad:
            raise AssertionError(f"{bad} of {N} wrong, first {got[:4].tolist()}")
        return f"rank {other}'s writes seen here"

    ok &= _check(rank, "peer_write", peer_write)

    def stream_write():
        s = torch.cuda.Stream(dev)
        word = theirs.va + 8 * (2 * N)  # the peer's word 2N
        vmm.write_value64(s.cuda_stream, word, 7_000 + rank)
        vmm.stream_sync(s.cuda_stream)
        peer.barrier("write-value")
        got = int(state["local"][2 * N].item())
        if got != 7_000 + other:
            raise AssertionError(f"expected {7_000 + other}, got {got}")
        # the host read of a peer word (what Transport.load costs here)
        pinned = torch.zeros(1, dtype=torch.int64, pin_memory=True)
        reps = 200
        t0 = time.perf_counter()
        for _ in range(reps):
            vmm.copy_dtoh(pinned.data_ptr(), theirs.va + 8 * (2 * N), 8, s.cuda_stream)
            vmm.stream_sync(s.cuda_stream)
        read_us = (time.perf_counter() - t0) / reps * 1e6
        if int(pinned[0]) != 7_000 + rank:
            raise AssertionError(f"host read of the peer word: expected {7_000 + rank}, got {int(pinned[0])}")
        return f"host read of a peer word {read_us:.1f} us"

    ok &= _check(rank, "stream_write_value64", stream_write)

    def atomic():
        word = (mine.va if rank == 0 else theirs.va) + 8 * (2 * N + 8)  # rank 0's word 2N+8
        if rank == 0:
            state["local"][2 * N + 8].zero_()
            torch.cuda.synchronize()
        peer.barrier("atomic-zeroed")
        out = torch.zeros(1, dtype=torch.int64, device=dev)
        reps = 500
        for _ in range(reps):
            kernels.fetch_add(word, rank + 1, out)
        torch.cuda.synchronize()
        peer.barrier("atomic-done")
        total = int(device_tensor(word, 8, dev).view(torch.int64).item())
        want = reps * (1 + 2)
        if total != want:
            raise AssertionError(f"expected {want}, got {total}")
        return f"{2 * reps} atomic adds from 2 processes sum to {total}"

    ok &= _check(rank, "triton_atomic", atomic)

    def roundtrip():
        # rank 0 signals a word in rank 1's memory, rank 1 answers in rank 0's: host polling both ways
        s = torch.cuda.Stream(dev)
        pinned = torch.zeros(1, dtype=torch.int64, pin_memory=True)
        flag_mine, flag_theirs = mine.va + 8 * (2 * N + 16), theirs.va + 8 * (2 * N + 16)
        state["local"][2 * N + 16].zero_()
        torch.cuda.synchronize()
        peer.barrier("pingpong")
        reps = 100
        deadline = time.monotonic() + min(10.0, timeout)
        t0 = time.perf_counter()
        for i in range(1, reps + 1):
            if rank == 0:
                vmm.write_value64(s.cuda_stream, flag_theirs, i)
            while True:
                vmm.copy_dtoh(pinned.data_ptr(), flag_mine, 8, s.cuda_stream)
                vmm.stream_sync(s.cuda_stream)
                if int(pinned[0]) >= i:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"round trip {i}: the peer's signal never came")
            if rank == 1:
                vmm.write_value64(s.cuda_stream, flag_theirs, i)
        vmm.stream_sync(s.cuda_stream)
        rt_us = (time.perf_counter() - t0) / reps * 1e6
        return f"signal round trip through host polling {rt_us:.1f} us"

    ok &= _check(rank, "signal_roundtrip", roundtrip)

    def growth():
        h = vmm.create(chunk, device)
        fd = vmm.export_fd(h)
        fds.append(fd)
        off = mine.add(h, chunk)
        peer.send({"chunk": chunk, "offset": off}, [fd])
        got, rfds = peer.recv()
        try:
            theirs.add(vmm.import_fd(rfds[0]), got["chunk"])
        finally:
            os.close(rfds[0])
        whole_mine = device_tensor(mine.va, mine.mapped, dev).view(torch.int64)
        whole_theirs = device_tensor(theirs.va, theirs.mapped, dev).view(torch.int64)
        base = chunk // 8  # first int64 of the second chunk
        idx = torch.arange(N, dtype=torch.int64, device=dev)
        whole_mine[base:base + N].copy_(_f(rank, idx, 2))
        whole_theirs[base + N:base + 2 * N].copy_(_f(rank, idx, 3))
        torch.cuda.synchronize()
        peer.barrier("grown")
        bad_r = int((whole_theirs[base:base + N] != _f(other, idx, 2)).sum())
        bad_w = int((whole_mine[base + N:base + 2 * N] != _f(other, idx, 3)).sum())
        bad_old = int((whole_theirs[:N] != _f(other, idx)).sum())
        ptrs = torch.tensor([theirs.va + chunk], dtype=torch.int64, device=dev)
        bad_t = int((kernels.gather_rows(ptrs, N)[0] != _f(other, idx, 2)).sum())
        if bad_r or bad_w or bad_old or bad_t:
            raise AssertionError(f"wrong values: read {bad_r}, written {bad_w}, first chunk {bad_old}, triton {bad_t}")
        peer.barrier("grown-read")
        return f"2 chunks of {chunk} bytes each side, mapped {mine.mapped}"

    ok &= _check(rank, "growth", growth)

    def teardown():
        state.clear()
        torch.cuda.synchronize()
        peer.barrier("teardown")  # nobody reads the other's memory any more
        theirs.close()
        mine.close()
        for fd in fds:
            os.close(fd)
        fds.clear()
        return "released"

    ok &= _check(rank, "unmap", teardown)
    sys.exit(0 if ok else 1)


def _child(rank: int, name: str, device: int, timeout: float) -> None:
    try:
        _rank_main(rank, name, device, timeout)
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001
        print(f"CHECK rank{rank}_setup FAIL {type(exc).__name__}: {exc}", flush=True)
        traceback.print_exc()
        sys.exit(2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zbccl.heap.transports.cuda.selfcheck",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--timeout", type=float, default=50.0, help="whole-run limit in seconds (default 50)")
    ap.add_argument("--device", type=int, default=0, help="CUDA device both processes use (default 0)")
    args = ap.parse_args(argv)
    if args.timeout <= 0:
        ap.error(f"--timeout must be positive, got {args.timeout}")
    if args.device < 0:
        ap.error(f"--device must be >= 0, got {args.device}")
    env = _versions()
    print("ENV " + " ".join(f"{k}={v}" for k, v in env.items()), flush=True)
    try:
        import torch

        if not torch.cuda.is_available():
            print("CHECK cuda_available FAIL torch sees no CUDA device (torch.cuda.is_available() is False)",
                  flush=True)
            return 1
        if args.device >= torch.cuda.device_count():
            print(f"CHECK cuda_available FAIL --device {args.device}, expected < {torch.cuda.device_count()}",
                  flush=True)
            return 1
        print(f"ENV gpu={torch.cuda.get_device_name(args.device)!r} torch_cuda={torch.version.cuda} "
              f"mps={_mps()} CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')!r}", flush=True)
    except Exception as exc:  # noqa: BLE001
        print(f"CHECK cuda_available FAIL {type(exc).__name__}: {exc}", flush=True)
        return 1
    name = f"\0zbccl-selfcheck-{os.getpid()}-{secrets.token_hex(8)}"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_child, args=(r, name, args.device, args.timeout * 0.8), daemon=True)
             for r in range(2)]
    t0 = time.monotonic()
    for p in procs:
        p.start()
    deadline = t0 + args.timeout
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:
        procs[r].kill()
        procs[r].join(5)
    codes = [p.exitcode for p in procs]
    if hung:
        print(f"CHECK no_hang FAIL ranks {hung} still ran after {args.timeout:.0f}s and were killed", flush=True)
    else:
        print(f"CHECK no_hang PASS both ranks exited in {time.monotonic() - t0:.1f}s", flush=True)
    print(f"RESULT exit codes {codes}", flush=True)
    return 0 if codes == [0, 0] else 1


if __name__ == "__main__":
    sys.exit(main())
