"""Fault injection: SIGKILL, SIGSTOP and SIGINT against one rank, at a random moment inside a random op.

Usage: ``zbccl faults [--trials N] [--kinds kill,stop,int] [--where W,...] [--world N] [--parallel K] [--json]``

Each trial starts a world of local ranks (forkserver processes, a store on an OS-assigned port),
and every rank loops one workload: collectives, p2p send/recv, EP dispatch/combine, group creation,
heap growth, init or finalize (:mod:`zbccl.tools.faults_rank`). One rank, the victim, signals
itself once its main thread is inside that workload's op, after a random delay. A trial passes when
every survivor:

* raises a ``ZbcclError`` naming the victim, within the bound after the signal (``BOUNDS``: 3 s for
  SIGKILL and SIGINT, ``INIT_BOUND`` where the survivor waits in init's rendezvous; SIGSTOP: twice
  the ops' timeout, ``STOP_TIMEOUT``, short in these trials, plus 1 s);
* after ``finalize`` maps no heap segment and holds no more descriptors than before its ``init``;
* runs again: a fresh ``init`` of the same world with the victim (its replacement after SIGKILL,
  the interrupted or continued process otherwise), an all_reduce checked bit-exactly, ``finalize``;

and, once the trial's processes are gone, no process maps a segment of the trial's jobs.
Exit status: 0 when every trial passed, 1 otherwise.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import signal
import sys
import time
import traceback
from datetime import timedelta

__all__ = ["BOUNDS", "INIT_BOUND", "INIT_TIMEOUT", "KINDS", "STOP_TIMEOUT", "bound_of", "run_faults", "run_trial", "summarize"]

STOP_TIMEOUT = 3.0  # seconds: the ops' (and init's) timeout in SIGSTOP trials
INIT_TIMEOUT = 5.0  # seconds: init's timeout in the SIGKILL and SIGINT trials of init and finalize
#: Seconds from the signal to the survivors' error. SIGSTOP: twice the op's timeout, plus 1 s. A
#: survivor times out, then waits up to the timeout again for the stopped rank to leave the op (a
#: rank that is still inside may write into the survivor's tensors: chan.c ``leave_op``); in init the
#: segment handout and the agreement after it each wait up to the timeout. The 1 s covers a survivor
#: that entered its next op just after the signal (its timeout counts from there). Why the second wait
#: is kept: docs/reliability.md, "Why SIGSTOP costs up to two timeouts".
BOUNDS = {"kill": 3.0, "int": 3.0, "stop": 2 * STOP_TIMEOUT + 1.0}
#: Where a survivor can only wait for the init timeout: the victim left inside init or finalize, and the
#: survivor waits in a rendezvous (init) for a rank that will not come. Before a rank's hello there
#: is no process to watch (after it, init watches its pid and its "left init" record), and after a death in
#: finalize the survivors wait in the next init for a rank that never says hello (docs/reliability.md).
INIT_BOUND = INIT_TIMEOUT + 1.0


def bound_of(kind: str, where: str) -> float:
    if kind != "stop" and where in ("init", "finalize"):
        return INIT_BOUND
    return BOUNDS[kind]
KINDS = ("kill", "stop", "int")
_CTX = None


def _mp():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "zbccl", "zbccl.tools.faults_rank"])
    return _CTX


def _child(fn_name: str, kwargs: dict, conn) -> None:
    try:
        import torch

        from . import faults_rank

        torch.set_num_threads(1)
        conn.send(("ok", getattr(faults_rank, fn_name)(**kwargs)))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        conn.send(("err", traceback.format_exc()[-2000:]))
    finally:
        conn.close()


def _start(fn_name: str, kwargs: dict):
    recv, send = _mp().Pipe(duplex=False)
    p = _mp().Process(target=_child, args=(fn_name, kwargs, send), name=f"zbccl-fault-rank{kwargs['rank']}")
    p.start()
    send.close()
    return p, recv


def _mapping(jobs: set[str]) -> list[int]:
    """PIDs of any process that maps a segment of one of ``jobs``."""
    marks = [f"memfd:zbccl-{j}-" for j in jobs if j]
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/maps") as f:
                if any(m in line for line in f for m in marks):
                    found.append(int(name))
        except OSError:
            continue
    return found


def run_trial(*, kind: str, where: str, world: int = 2, victim: int = 1, delay: float = 0.0) -> dict:
    """One trial; returns its record: ``passed``, the survivors' delays (``elapsed``) and ``why`` not."""
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=120))
    timeout = STOP_TIMEOUT if kind == "stop" else INIT_TIMEOUT if where in ("init", "finalize") else 60.0
    procs = {r: _start("trial_rank", dict(rank=r, world=world, port=server.port, where=where, victim=victim,
                                          kind=kind, delay=delay, timeout=timeout)) for r in range(world)}
    results: dict[int, dict] = {}
    replacement = None
    continued = False
    why: list[str] = []
    survivors = [r for r in range(world) if r != victim]
    deadline = time.monotonic() + 120 + timeout
    try:
        while sum(r != "replacement" for r in results) < world or (kind == "kill" and "replacement" not in results):
            if time.monotonic() > deadline:
                late = sorted(r for r in range(world) if r not in results)
                why.append(f"hang: ranks {late} did not finish in time (their stacks: stderr)")
                for r in late:  # faulthandler in the rank prints every thread's stack
                    p = procs[r][0]
                    if p.is_alive():
                        if kind == "stop":
                            os.kill(p.pid, signal.SIGCONT)
                        os.kill(p.pid, signal.SIGUSR1)
                time.sleep(1.0)  # let them write it
                break
            vp = procs[victim][0]
            if kind == "kill" and replacement is None and vp.exitcode is not None:
                replacement = _start("rerun_rank", dict(rank=victim, world=world, port=server.port, victim=victim))
            if kind == "stop" and not continued and server.check([f"fault/done/{r}" for r in survivors]):
                os.kill(vp.pid, signal.SIGCONT)
                continued = True
            waiting = [(r, c) for r, (_, c) in procs.items() if r not in results]
            if replacement is not None and "replacement" not in results:
                waiting.append(("replacement", replacement[1]))
            ready = mp.connection.wait([c for _, c in waiting], timeout=0.05)
            for r, c in waiting:
                if c in ready:
                    try:
                        status, value = c.recv()
                    except EOFError:
                        status, value = "gone", None
                    if r == victim and kind == "kill":
                        status = "ok" if status == "gone" else status
                    if status == "err":
                        why.append(f"rank {r} raised: {value}")
                    results[r] = value if status == "ok" else {}
    finally:
        everyone = [p for p, _ in procs.values()] + ([replacement[0]] if replacement else [])
        for p in everyone:
            if p.is_alive() and not why:
                p.join(10)
            if p.is_alive():
                if kind == "stop":
                    os.kill(p.pid, signal.SIGCONT)
                p.kill()
            p.join(5)
    t_signal = float(server.get("fault/signal")) if server.check(["fault/signal"]) else None
    del server
    return _judge(kind, where, world, victim, delay, t_signal, results, why)


def _judge(kind, where, world, victim, delay, t_signal, results, why) -> dict:
    bound = bound_of(kind, where)
    elapsed = []
    jobs = set()
    if t_signal is None:
        why.append("the signal was never sent (the victim never reached the op)")
    for r in range(world):
        res = results.get(r) or {}
        jobs.add(res.get("job"))
        jobs.add((res.get("rerun") or {}).get("job"))
        if r == victim:
            continue
        if "t_error" not in res:
            why.append(f"rank {r}: no error ({res.get('error', 'no result')})")
            continue
        if t_signal is not None:
            e = res["t_error"] - t_signal
            elapsed.append(e)
            if e < 0:
                why.append(f"rank {r} raised {-e:.2f}s before the signal: {res['error']}")
            elif e > bound:
                why.append(f"rank {r} raised {e:.2f}s after the signal, bound {bound}s")
        if not res.get("named"):
            chain = [q for q in res.get("ranks", []) if q != victim and (results.get(q) or {}).get("named")]
            via = f" (it names rank {chain[0]}, which had named rank {victim}: a follower)" if chain else ""
            why.append(f"rank {r}: the error does not name rank {victim}{via}: {res['error']}")
        if res.get("finalize_error"):
            why.append(f"rank {r}: finalize raised {res['finalize_error']}")
        if res.get("segments_after_finalize"):
            why.append(f"rank {r} still maps {res['segments_after_finalize']} after finalize "
                       f"(alive then: {res.get('held_at_finalize')})")
        if res.get("fd_growth", 0) > 0:
            why.append(f"rank {r} holds {res['fd_growth']} more descriptors after finalize than before init")
    reruns = {r: (results.get(r) or {}).get("rerun") for r in range(world) if r != victim or kind != "kill"}
    if kind == "kill":
        reruns[victim] = results.get("replacement")
        jobs.add((results.get("replacement") or {}).get("job"))
    for r, rr in reruns.items():
        if not (rr or {}).get("ok"):
            why.append(f"rank {r} could not run again after finalize and init: {(rr or {}).get('error', 'no result')}")
    left = _mapping({j for j in jobs if j})
    if left:
        why.append(f"processes {left} still map segments of jobs {sorted(j for j in jobs if j)}")
    return {"kind": kind, "where": where, "victim": victim, "delay": round(delay, 3), "passed": not why,
            "elapsed": [round(e, 3) for e in elapsed], "bound": bound, "why": why[:6],
            "errors": [((results.get(r) or {}).get("error") or "")[:200] for r in range(world) if r != victim]}


def run_faults(*, trials: int = 10, kinds=KINDS, wheres=None, world: int = 2, seed: int = 0,
               as_json: bool = False, minutes: float | None = None, parallel: int = 1) -> int:
    """``trials`` per kind (or as many as fit in ``minutes``), interleaved, ``parallel`` trials at a
    time (each its own world and store: the others are load for it); prints the table; exit status."""
    from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

    from .faults_rank import WHERE

    wheres = list(wheres or WHERE)
    rng = random.Random(seed)
    plan = [(kind, rng.choice(wheres), rng.randrange(world), rng.uniform(0.0, 0.3))
            for _ in range(trials) for kind in kinds]
    stream = sys.stderr if as_json else sys.stdout
    records = []
    t0 = time.monotonic()
    print(f"zbccl faults: {trials} trials per kind of {','.join(kinds)}, world {world}, seed {seed}, "
          f"{parallel} at a time", file=stream, flush=True)
    with ThreadPoolExecutor(max_workers=parallel) as pool:
        running: set = set()
        todo = iter(plan)
        stopped = False
        while True:
            while not stopped and len(running) < parallel:
                if minutes is not None and time.monotonic() - t0 > minutes * 60:
                    print(f"stopped starting trials: --minutes {minutes:g} passed", file=stream, flush=True)
                    stopped = True
                    break
                nxt = next(todo, None)
                if nxt is None:
                    stopped = True
                    break
                kind, where, victim, delay = nxt
                running.add(pool.submit(run_trial, kind=kind, where=where, world=world, victim=victim, delay=delay))
            if not running:
                break
            done, running = wait(running, return_when=FIRST_COMPLETED)
            for fut in done:
                rec = fut.result()
                records.append(rec)
                worst = max(rec["elapsed"], default=float("nan"))
                print(f"[{time.monotonic() - t0:6.0f}s] {rec['kind']:>4} in {rec['where']:<10} victim {rec['victim']}: "
                      f"{'pass' if rec['passed'] else 'FAIL'}  {worst:.2f}s" +
                      ("" if rec["passed"] else "  " + "; ".join(rec["why"])[:400]), file=stream, flush=True)
    doc = summarize(records, seed=seed, world=world, seconds=time.monotonic() - t0)
    doc["parallel"] = parallel
    if as_json:
        print(json.dumps(doc, indent=1))
    else:
        _print(doc)
    return 0 if doc["trials"] and doc["passed"] == doc["trials"] else 1


def summarize(records: list[dict], *, seed: int, world: int, seconds: float) -> dict:
    kinds = {}
    for kind in KINDS:
        rs = [r for r in records if r["kind"] == kind]
        if not rs:
            continue
        by_where = {}
        for w in sorted({r["where"] for r in rs}):
            ws = [r for r in rs if r["where"] == w]
            by_where[w] = {"trials": len(ws), "passed": sum(r["passed"] for r in ws), "bound_s": bound_of(kind, w),
                           "worst_s": max((e for r in ws for e in r["elapsed"]), default=None)}
        in_ops = [e for r in rs if r["where"] not in ("init", "finalize") for e in r["elapsed"]]
        kinds[kind] = {"trials": len(rs), "passed": sum(r["passed"] for r in rs), "bound_s": BOUNDS[kind],
                       "worst_s": max((e for r in rs for e in r["elapsed"]), default=None),
                       "worst_in_ops_s": max(in_ops, default=None), "by_where": by_where}
    return {"seed": seed, "world": world, "seconds": round(seconds, 1), "trials": len(records),
            "passed": sum(r["passed"] for r in records), "kinds": kinds,
            "failures": [r for r in records if not r["passed"]][:20]}


def _print(doc: dict) -> None:
    print(f"\n{doc['trials']} trials in {doc['seconds']:.0f}s, world {doc['world']}, seed {doc['seed']}, "
          f"{doc.get('parallel', 1)} at a time")
    print(f"{'signal':>6} {'where':<10} {'trials':>6} {'passed':>6} {'bound_s':>7} {'worst_s':>7}")
    for kind, k in doc["kinds"].items():
        for w, v in k["by_where"].items():
            worst = "-" if v["worst_s"] is None else f"{v['worst_s']:.2f}"
            print(f"{kind:>6} {w:<10} {v['trials']:>6} {v['passed']:>6} {v['bound_s']:>7.1f} {worst:>7}")
        worst = "-" if k["worst_s"] is None else f"{k['worst_s']:.2f}"
        print(f"{kind:>6} {'(all)':<10} {k['trials']:>6} {k['passed']:>6} {'':>7} {worst:>7}")
    for f in doc["failures"]:
        print(f"  FAIL {f['kind']} in {f['where']} (victim {f['victim']}, delay {f['delay']}s): " + "; ".join(f["why"]))
    print("result:", "OK" if doc["trials"] and doc["passed"] == doc["trials"] else "FAILED")
