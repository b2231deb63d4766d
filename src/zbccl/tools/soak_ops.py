"""The soak's op catalogue: one random op, run through zbccl and checked bit-exactly.

Every rank draws the same op from the same seeded ``random.Random`` (kind, API, sizes, dtype,
group, sync/async, heap or private tensors), so every rank issues the same sequence. Payloads
encode their source (``value = f(rank, index, op number)``); every rank can rebuild every rank's
input, so it computes the whole expected result with the plain-torch reference
(:mod:`zbccl.ops.reference`: fp32 accumulation in group-rank order, one rounding) and compares
bytes. A mismatch returns a short description; an exception propagates (the soak counts it).
"""

from __future__ import annotations

import random

import torch
import torch.distributed as dist

import zbccl
from zbccl.ops import reference as ref
from zbccl.ops.dtypes import AVG, MAX, MIN, PROD, SUM
from zbccl.ops.hosts import reduction_order

__all__ = ["Soaker", "KINDS"]

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.int64]
RED = {"sum": (SUM, dist.ReduceOp.SUM), "avg": (AVG, dist.ReduceOp.AVG), "max": (MAX, dist.ReduceOp.MAX),
       "min": (MIN, dist.ReduceOp.MIN), "product": (PROD, dist.ReduceOp.PRODUCT)}
#: Op kinds and their weights in the draw.
KINDS = {"all_reduce": 6, "all_gather": 3, "all_gather_v": 2, "reduce_scatter": 3, "reduce_scatter_v": 2,
         "all_to_all": 3, "broadcast": 2, "barrier": 1, "p2p": 2, "ep": 2, "regroup": 0.4, "object": 0.5,
         "rooted": 1.5}
_SIZES = [0, 1, 2, 3, 7, 31, 64, 127, 256, 1000, 4097, 16411, 65537, 262147]


def payload(rank: int, shape, dtype: torch.dtype, salt: int) -> torch.Tensor:
    """``f(rank, index, salt)``: small values exact in every dtype (steps of 1/4 in [-7.5, 7.5])."""
    n = 1
    for s in shape:
        n *= s
    i = torch.arange(n, dtype=torch.int64)
    v = (i * 7 + rank * 13 + salt) % 61 - 30
    out = v.to(torch.float64) / 4 if dtype.is_floating_point else v
    return out.to(dtype).view(*shape)


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.shape == want.shape and got.dtype == want.dtype and torch.equal(
        got.contiguous().view(torch.uint8) if got.numel() else got, want.contiguous().view(torch.uint8)
        if want.numel() else want)


class Soaker:
    """One rank's side of the soak: ``step(i)`` draws op ``i`` and returns ``(kind, wrong)``."""

    def __init__(self, comm, seed: int, *, ep: bool = True) -> None:
        self.comm, self.rank, self.world = comm, comm.rank, comm.world_size
        self.rng = random.Random(seed)
        self.kind = ""  # the op being drawn or run (for error messages)
        self.group = None  # (global ranks, torch group, its zbccl communicator) or None
        self.buffer = None
        if ep:
            import zbccl.ep as deep_ep

            self.buffer = deep_ep.Buffer(comm, explicitly_destroy=True)
        self.kinds = [k for k in KINDS if ep or k != "ep"]
        self.weights = [KINDS[k] for k in self.kinds]

    def close(self) -> None:
        if self.buffer is not None:
            self.buffer.destroy()
        self.drop_group()

    def drop_group(self) -> None:
        if self.group is not None:
            ranks, pg, _ = self.group
            if self.rank in ranks:
                dist.destroy_process_group(pg)
            self.group = None

    # ------------------------------------------------------------------ the draw
    def step(self, i: int) -> tuple[str, str | None]:
        g = self.rng
        kind = self.kind = g.choices(self.kinds, self.weights)[0]
        if kind == "regroup":
            return kind, self._regroup(g)
        if kind == "ep":
            return kind, self._ep(g, i)
        if kind == "object":
            got = self.comm.all_gather_object((self.rank, i, "x" * g.randint(0, 300)))
            want = [(r, i, got[r][2]) for r in range(self.world)]
            return kind, None if got == want and len({len(x[2]) for x in got}) == 1 else f"object #{i}: {got!r:.80}"
        # the group: the world or the current sub-group (non-members skip the op, in step)
        ranks, pg, comm = list(range(self.world)), dist.group.WORLD, self.comm
        if self.group is not None and g.random() < 0.35:
            ranks, pg, comm = self.group
        api = g.choice(["zbccl", "torch", "torch_async"])
        dtype = g.choice(DTYPES)
        n = g.choice(_SIZES) if g.random() < 0.85 else g.randint(0, 300_000)
        heap = g.random() < 0.6
        args = dict(ranks=ranks, pg=pg, comm=comm, api=api, dtype=dtype, n=n, heap=heap, salt=i % 1000)
        # the op's own draws come from a generator of its own: non-members skip them and stay in step
        sub = random.Random(g.getrandbits(64))
        wrong = getattr(self, "_" + kind)(sub, **args) if self.rank in ranks else None
        return kind, None if wrong is None else f"{kind} #{i} ({api}, {dtype}, n={n}, group {ranks}): {wrong}"

    # ------------------------------------------------------------------ helpers
    def _new(self, shape, dtype, heap: bool) -> torch.Tensor:
        return zbccl.empty(*shape, dtype=dtype) if heap else torch.empty(*shape, dtype=dtype)

    def _input(self, rank_in_group: int, shape, dtype, heap: bool, salt: int, ranks) -> torch.Tensor:
        t = self._new(shape, dtype, heap)
        t.copy_(payload(ranks[rank_in_group], shape, dtype, salt))
        return t

    @staticmethod
    def _call(api: str, fn, *args, **kwargs) -> None:
        work = fn(*args, async_op=api == "torch_async", **kwargs)
        if api == "torch_async":
            work.wait()
            if not work.is_success():
                raise RuntimeError(f"Work of {fn.__name__} completed without success")

    # ------------------------------------------------------------------ the ops
    def _all_reduce(self, g, *, ranks, pg, comm, api, dtype, n, heap, salt):
        name = g.choice([k for k in RED if dtype.is_floating_point or k != "avg"])
        me = ranks.index(self.rank)
        t = self._input(me, (n,), dtype, heap, salt, ranks)
        if api == "zbccl":
            zbccl.all_reduce(t, name, comm=comm)
        else:
            self._call(api, dist.all_reduce, t, op=RED[name][1], group=pg)
        inputs = [payload(r, (n,), dtype, salt) for r in ranks]
        order = reduction_order(comm, n * t.element_size())  # across hosts: maybe per host, then across
        want = (ref.all_reduce_ref(inputs, RED[name][0]) if order is None
                else ref.hierarchical_all_reduce_ref(inputs, RED[name][0], order))
        return None if _same(t, want) else f"{name} differs"

    def _all_gather(self, g, *, ranks, pg, comm, api, dtype, n, heap, salt):
        W, me = len(ranks), ranks.index(self.rank)
        rows, cols = max(1, n // 8) if n else 0, g.choice([1, 3, 8])
        dim = g.choice([0, 1]) if api == "zbccl" else 0
        x = self._input(me, (rows, cols), dtype, heap, salt, ranks)
        ins = [payload(r, (rows, cols), dtype, salt) for r in ranks]
        want = torch.cat(ins, dim)
        if api == "torch" and g.random() < 0.4:  # the list form
            outs = [self._new((rows, cols), dtype, heap) for _ in range(W)]
            dist.all_gather(outs, x, group=pg)
            return None if all(_same(o, w) for o, w in zip(outs, ins)) else "list form differs"
        out = self._new(tuple(want.shape), dtype, heap)
        if api == "zbccl":
            zbccl.all_gather_into_tensor(out, x, dim=dim, comm=comm)
        else:
            self._call(api, dist.all_gather_into_tensor, out, x, group=pg)
        return None if _same(out, want) else f"dim {dim} differs"

    def _all_gather_v(self, g, *, ranks, pg, comm, api, dtype, n, heap, salt):
        sizes = [g.choice([0, 1, 5, n // 4, n // 2]) for _ in ranks]
        me, cols, dim = ranks.index(self.rank), g.choice([1, 4]), g.choice([0, 1])
        shape = (lambda s: (s, cols)) if dim == 0 else (lambda s: (cols, s))  # sizes run along dim
        x = self._input(me, shape(sizes[me]), dtype, heap, salt, ranks)
        want = torch.cat([payload(r, shape(s), dtype, salt) for r, s in zip(ranks, sizes)], dim)
        out = self._new(tuple(want.shape), dtype, heap)
        zbccl.all_gather_v(out, x, sizes, dim=dim, comm=comm)
        return None if _same(out, want) else f"sizes {sizes}, dim {dim} differ"

    def _reduce_scatter(self, g, *, ranks, pg, comm, api, dtype, n, heap, salt):
        W, me = len(ranks), ranks.index(self.rank)
        name = g.choice([k for k in RED if dtype.is_floating_point or k != "avg"])
        per = n // W if g.random() < 0.8 else n
        if api == "zbccl" and g.random() < 0.3:  # along dim 1 of [rows, per * W]
            rows, per = g.choice([1, 3]), max(1, per // 3)
            x = self._input(me, (rows, per * W), dtype, heap, salt, ranks)
            out = self._new((rows, per), dtype, heap)
            zbccl.reduce_scatter_tensor(out, x, name, dim=1, comm=comm)
            parts = [payload(r, (rows, per * W), dtype, salt)[:, me * per:(me + 1) * per] for r in ranks]
            want = ref.reduce_ref([p.reshape(-1) for p in parts], RED[name][0]).view(rows, per)
            return None if _same(out, want) else f"{name}, dim 1 differs"
        x = self._input(me, (per * W,), dtype, heap, salt, ranks)
        out = self._new((per,), dtype, heap)
        if api == "zbccl":
            zbccl.reduce_scatter_tensor(out, x, name, comm=comm)
        else:
            self._call(api, dist.reduce_scatter_tensor, out, x, op=RED[name][1], group=pg)
        want = ref.reduce_scatter_ref([payload(r, (per * W,), dtype, salt) for r in ranks], RED[name][0],
                                      [per] * W, me)
        return None if _same(out, want) else f"{name} differs"

    def _reduce_scatter_v(self, g, *, ranks, pg, comm, api, dtype, n, heap, salt):
        me = ranks.index(self.rank)
        name = g.choice([k for k in RED if dtype.is_floating_point or k != "avg"])
        sizes = [g.choice([0, 1, 3, n // 3]) for _ in ranks]
        x = self._input(me, (sum(sizes),), dtype, heap, salt, ranks)
        out = self._new((sizes[me],), dtype, heap)
        zbccl.reduce_scatter_v(out, x, sizes, name, comm=comm)
        want = ref.reduce_scatter_ref([payload(r, (sum(sizes),), dtype, salt) for r in ranks], RED[name][0],
                                      sizes, me)
        return None if _same(out, want) else f"{name}, sizes {sizes} differ"

    def _all_to_all(self, g, *, ranks, pg, comm, api, dtype, n, heap, salt):
        W, me = len(ranks), ranks.index(self.rank)
        cols = g.choice([1, 2, 5])
        if g.random() < 0.5:  # even
            even = max(0, n // (8 * W))
            splits = [[even] * W for _ in ranks]
        else:  # uneven, 0 included: splits[q][r] rows from q to r
            splits = [[g.choice([0, 1, 3, n // 16]) for _ in ranks] for _ in ranks]
        ins = [payload(r, (sum(splits[q]), cols), dtype, salt) for q, r in enumerate(ranks)]
        x = self._input(me, (sum(splits[me]), cols), dtype, heap, salt, ranks)
        out_splits = [splits[q][me] for q in range(W)]
        out = self._new((sum(out_splits), cols), dtype, heap)
        even_form = all(s == splits[0][0] for row in splits for s in row)
        osz, isz = (None, None) if even_form and g.random() < 0.5 else (out_splits, splits[me])
        if api == "zbccl":
            zbccl.all_to_all_single(out, x, osz, isz, comm=comm)
        else:
            self._call(api, dist.all_to_all_single, out, x, osz, isz, group=pg)
        want = ref.all_to_all_ref(ins, splits, me)
        return None if _same(out, want) else f"splits {splits} differ"

    def _broadcast(self, g, *, ranks, pg, comm, api, dtype, n, heap, salt):
        me, src = ranks.index(self.rank), g.randrange(len(ranks))
        t = self._input(me, (n,), dtype, heap, salt, ranks)
        if api == "zbccl":
            zbccl.broadcast(t, src, comm=comm)
        else:
            self._call(api, dist.broadcast, t, ranks[src], group=pg)
        return None if _same(t, payload(ranks[src], (n,), dtype, salt)) else f"root {src} differs"

    def _rooted(self, g, *, ranks, pg, comm, api, dtype, n, heap, salt):
        """torch.distributed's other forms: reduce, gather and scatter to or from a random root, and the
        list forms of reduce_scatter and all_to_all."""
        W, me = len(ranks), ranks.index(self.rank)
        root, form = g.randrange(W), g.choice(["reduce", "gather", "scatter", "reduce_scatter", "all_to_all"])
        a = "torch" if api == "zbccl" else api
        ins = [payload(r, (n,), dtype, salt) for r in ranks]
        if form == "reduce":
            name = g.choice(["sum", "max", "min", "product"])
            t = self._input(me, (n,), dtype, heap, salt, ranks)
            self._call(a, dist.reduce, t, ranks[root], op=RED[name][1], group=pg)
            ok = me != root or _same(t, ref.all_reduce_ref(ins, RED[name][0]))
            return None if ok else f"reduce {name} to {root} differs"
        if form == "gather":
            outs = [self._new((n,), dtype, heap) for _ in ranks] if me == root else None
            self._call(a, dist.gather, self._input(me, (n,), dtype, heap, salt, ranks), outs, dst=ranks[root],
                       group=pg)
            return None if me != root or all(_same(o, w) for o, w in zip(outs, ins)) else f"gather to {root} differs"
        if form == "scatter":
            got = self._new((n,), dtype, heap)
            parts = [payload(ranks[root], (n,), dtype, salt + q) for q in range(W)]
            self._call(a, dist.scatter, got, parts if me == root else None, src=ranks[root], group=pg)
            return None if _same(got, parts[me]) else f"scatter from {root} differs"
        if form == "reduce_scatter":
            chunks = [self._input(me, (n,), dtype, heap, salt + q, ranks) for q in range(W)]
            got = self._new((n,), dtype, heap)
            self._call(a, dist.reduce_scatter, got, chunks, op=dist.ReduceOp.SUM, group=pg)
            want = ref.all_reduce_ref([payload(r, (n,), dtype, salt + me) for r in ranks], SUM)
            return None if _same(got, want) else "reduce_scatter (list) differs"
        chunks = [self._input(me, (n,), dtype, heap, salt + q, ranks) for q in range(W)]
        outs = [self._new((n,), dtype, heap) for _ in ranks]
        self._call(a, dist.all_to_all, outs, chunks, group=pg)
        want = [payload(r, (n,), dtype, salt + me) for r in ranks]
        return None if all(_same(o, w) for o, w in zip(outs, want)) else "all_to_all (list) differs"

    def _barrier(self, g, *, ranks, pg, comm, api, **_):
        if api == "zbccl":
            zbccl.barrier(comm=comm)
        else:
            self._call(api, dist.barrier, group=pg)
        return None

    def _p2p(self, g, *, ranks, pg, comm, api, dtype, n, heap, salt):
        """A ring (isend/irecv, every member) or one pair (blocking send/recv)."""
        W, me = len(ranks), ranks.index(self.rank)
        if W == 1:
            return None
        if g.random() < 0.5:
            dst, src = ranks[(me + 1) % W], ranks[(me - 1) % W]
            t = self._input(me, (n,), dtype, heap, salt, ranks)
            got = self._new((n,), dtype, g.random() < 0.5)
            works = [dist.isend(t, dst, group=pg), dist.irecv(got, src, group=pg)]
            for w in works:
                w.wait()
            return None if _same(got, payload(src, (n,), dtype, salt)) else f"ring from {src} differs"
        a, b = g.sample(range(W), 2)
        if me == a:
            dist.send(self._input(me, (n,), dtype, heap, salt, ranks), ranks[b], group=pg)
        elif me == b:
            got = self._new((n,), dtype, heap)
            dist.recv(got, ranks[a], group=pg)
            return None if _same(got, payload(ranks[a], (n,), dtype, salt)) else f"pair {a}->{b} differs"
        return None

    def _regroup(self, g) -> str | None:
        """Destroy the current sub-group and create another (every rank calls new_group, as torch needs)."""
        self.drop_group()
        k = g.randint(1, self.world)
        ranks = sorted(g.sample(range(self.world), k))
        pg = dist.new_group(ranks)
        comm = None
        if self.rank in ranks:
            comm = getattr(pg, "comm", None)  # the ProcessGroupZbccl's communicator
            if comm is None:
                return f"new_group {ranks}: the group runs without zbccl ({pg})"
        self.group = (ranks, pg, comm)
        return None

    def _ep(self, g, i: int) -> str | None:
        """Normal-mode dispatch and combine of a random case, checked against the reference."""
        from .soak_ep import check_case

        return check_case(self.buffer, self.comm, g, salt=i)
