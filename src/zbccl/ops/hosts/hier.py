"""The hierarchical algorithms across hosts, for a regular topology (H hosts of L >= 2 members each).

all_reduce of N elements, after the agreement step (header only, on the world mesh), up to ``column_max``
bytes (``HostOps.tune``; ``tuner.HOSTS_COLUMN_MAX``): the host's all_reduce (the shm op, in place), then
one column step of the whole tensor, each rank reducing the H hosts' results in host order (each rank
sends ``(H-1) N`` across). Above, segment by segment:

1. intra-host ``reduce_scatter_v`` over the host group (the zero-buffer shm op): local index l gets the
   host's reduction of slice l (``N/L`` elements, the first ``N % L`` slices one longer);
2. inter-host all_reduce of that slice among the H members of local index l (the column mesh: one
   stamped step per chunk, reduced in host order);
3. intra-host ``all_gather_v`` of the slices into the tensor.

Inter-host bytes: each rank sends ``(H-1) N/L``, a host ``(H-1) N`` (the flat exchange: ``L (n-L) N``
per host; a flat ring ``2 (n-1)/n N`` per rank, ``2 L (n-1)/n N`` per host).

all_gather of N_in per rank: each rank's piece crosses to its column peers (``(H-1) N_in`` per rank: once
per host pair). When every member's output lies in its heap, the piece is put straight into the column
peers' outputs, then each rank puts its column's H pieces into the outputs of its host's ranks (shm) and
the host's ranks meet in a barrier (:func:`_direct_gather`); otherwise the pieces go through the column
mesh's slots into a heap block, an intra-host all_gather of the L blocks of H pieces follows, reordered
into member order.

broadcast (:func:`broadcast`): the root's column gets the tensor through the column mesh, then each host
broadcasts it (shm): the root sends ``(H-1) N`` across instead of ``(n-L) N``. The even reduce_scatter
(:func:`reduce_scatter`): each host reduces its ranks' inputs for every column's slices (shm), then each
rank gets its slice's host partials from its column peers: ``(H-1) N/n`` per rank instead of ``(n-L) N/n``;
its result is the hierarchical all_reduce's slice, bit for bit.

Reduction order: within a host in local order (fp32 accumulation for bf16/fp16, rounded once), then
across hosts in host order (rounded again): integers and exactly representable values are bit-equal to
the reference, bf16/fp16 may differ from it by one rounding per phase, and every result is bit-equal to
``reference.hierarchical_all_reduce_ref`` (``hosts.reduction_order`` gives its groups); every rank gets the same bits
(each slice is reduced once per column, identically, then copied; in two phases, every rank reduces the same
hosts' results in the same order). ``avg`` sums through both phases and
divides once at the end.
"""

from __future__ import annotations

import math

import torch

from ...errors import ZbcclError
from ..dtypes import AVG, MAX, MIN, PROD, SUM
from . import flat as flat_ops
from .state import F, HostOps

__all__ = ["all_reduce", "all_gather", "broadcast", "reduce_scatter", "on_host"]

_NAMES = {SUM: "sum", AVG: "sum", PROD: "product", MAX: "max", MIN: "min"}
#: Chunks per segment of the hierarchical ops: the shm phases (which stage a tensor outside the heap) see at
#: most this many chunks at once, so a large tensor needs no heap room of its size.
SEGMENT_CHUNKS = 4


def _column_all_reduce(h: HostOps, op: str, part: torch.Tensor, red: int, secs: float) -> None:
    """Step 2: ``part`` (contiguous, 1-d) reduced in place among the column, chunk by chunk, in host order."""
    col, chunk = h.col, h.chunk
    raw = part.view(torch.uint8) if part.numel() else torch.empty(0, dtype=torch.uint8)
    ce = chunk // part.element_size()
    for k in range(max(1, math.ceil(raw.numel() / chunk))):
        piece = raw[k * chunk:(k + 1) * chunk]
        parity = col.step([None if i == col.index else piece for i in range(col.n)], op=op, timeout=secs)
        if not piece.numel():
            continue
        parts = [piece if i == col.index else col.view(parity, i, piece.numel()) for i in range(col.n)]
        typed = [p.view(part.dtype) for p in parts]
        flat_ops.reduce_into(part[k * ce:k * ce + typed[0].numel()], typed, red)


def _column_gather(h: HostOps, op: str, piece: torch.Tensor, out: torch.Tensor, secs: float) -> None:
    """The column's pieces (equal sizes, flat uint8) into ``out`` ``[H, nbytes]`` (uint8), in host order."""
    col, chunk, nbytes = h.col, h.chunk, piece.numel()
    for k in range(max(1, math.ceil(nbytes / chunk))):
        part = piece[k * chunk:(k + 1) * chunk]
        parity = col.step([None if i == col.index else part for i in range(col.n)], op=op, timeout=secs)
        m = part.numel()
        for i in range(col.n):
            if m:
                flat_ops.copy(out[i, k * chunk:k * chunk + m], part if i == col.index else col.view(parity, i, m))


def all_reduce(h: HostOps, op: str, tensor: torch.Tensor, dt: int, red: int, secs: float) -> None:
    """In place: up to ``column_max`` bytes (``HostOps.tune``) the host's all_reduce and one column step of the whole tensor
    (:func:`_host_then_column`), above segment by segment (:func:`_segments`)."""
    work = flat_ops.all_reduce(h, op, tensor, dt, red, None, secs, data=False)
    flat = work.view(-1)
    inner = SUM if red == AVG else red
    two = flat.numel() * tensor.element_size() <= min(h.tune["column_max"], h.chunk)
    (_host_then_column if two else _segments)(h, op, flat, red, inner, secs)
    if red == AVG:
        flat.div_(h.n)
    if work is not tensor:
        flat_ops.copy(tensor, work)


def _segments(h: HostOps, op: str, flat: torch.Tensor, red: int, inner: int, secs: float) -> None:
    """``flat`` (contiguous, 1-d; agreed) segment by segment (``SEGMENT_CHUNKS`` chunks each: the shm phases stage
    at most that much): reduce_scatter_v within the host, the column's all_reduce of this rank's slice,
    all_gather_v within the host."""
    from ..exchange import all_gather_v
    from ..reduce_scatter import reduce_scatter_v

    N, L = flat.numel(), h.L
    seg = max(L, SEGMENT_CHUNKS * h.chunk // flat.element_size() // L * L)
    for lo in range(0, N, seg):
        part = flat[lo:lo + seg]
        n = part.numel()
        counts = [n // L + (1 if i < n % L else 0) for i in range(L)]
        mine = torch.empty(counts[h.local_index], dtype=flat.dtype)
        on_host(h, op, reduce_scatter_v, mine, part, counts, _NAMES[red], timeout=secs)  # 1.
        _column_all_reduce(h, op, mine, inner, secs)  # 2.
        on_host(h, op, all_gather_v, part, mine, counts, timeout=secs)  # 3.


def _host_then_column(h: HostOps, op: str, flat: torch.Tensor, red: int, inner: int, secs: float) -> None:
    """``flat`` (contiguous, 1-d; agreed by the world step) all-reduced within this host (the shm op, in place),
    then among the column in one step of the whole tensor, each rank reducing the hosts' results in host order:
    two phases instead of three, each rank sending ``(H-1) N`` across instead of ``(H-1) N/L``."""
    from ..allreduce import all_reduce as host_all_reduce

    col = h.col
    on_host(h, op, host_all_reduce, flat, _NAMES[red], timeout=secs)  # 1.
    raw = flat_ops._bytes(flat)
    parity = col.step([None if i == col.index else raw for i in range(col.n)], op=op, timeout=secs)  # 2.
    parts = [flat if i == col.index else col.view(parity, i, raw.numel()).view(flat.dtype) for i in range(col.n)]
    flat_ops.reduce_into(flat, parts, inner)  # (into this host's own part: reduce_into keeps the order)


def _scratch(h: HostOps, shape: tuple) -> torch.Tensor:
    """A uint8 scratch tensor in this rank's heap, freed when it dies, so that the shm phase runs zero-copy on
    it; ordinary memory when the heap is full (that phase then stages it, counted in ``staged_bytes``)."""
    t = flat_ops.scratch(h, math.prod(shape))
    return torch.empty(shape, dtype=torch.uint8) if t is None else t.view(shape)


def on_host(h: HostOps, op: str, phase, *args, **kwargs):
    """``phase(*args, comm=h.local, **kwargs)``: a phase of ``op`` among this host's ranks (the shm op of the host
    group, which numbers them 0..L-1). Its error says so and names them in this communicator's numbering (its
    class and ``via`` kept: what a leave records), so a user of ``op`` meets no other op's name or numbering."""
    try:
        return phase(*args, comm=h.local, **kwargs)
    except ZbcclError as exc:
        mine = h.hosts[h.host_of[h.me]]  # this host's members: group rank l is this communicator's mine[l]
        err = type(exc)(f"{op}: in its phase among this host's ranks {mine} (numbered 0-{len(mine) - 1} there): "
                        f"{exc}", ranks=tuple(mine[r] if type(r) is int and 0 <= r < len(mine) else r
                                              for r in exc.ranks))
        err.via = getattr(exc, "via", None)
        raise err from None


def all_gather(h: HostOps, op: str, output: torch.Tensor, input: torch.Tensor, dt: int, counts: list[int],
               secs: float) -> None:
    """Even all_gather along dim 0 (``counts`` all equal) on a regular topology, segment by segment of the
    pieces (the shm phase stages at most ``SEGMENT_CHUNKS`` chunks)."""
    from ..exchange import all_gather_v

    heads = flat_ops.gather(h, op, output, input, dt, counts, 0, [], None, secs, data=False)
    src = flat_ops._bytes(input.contiguous())
    if all(int(x[F.READY]) for x in heads):  # every output in its owner's heap: no slot, no scratch, no reorder
        _direct_gather(h, op, output, src, heads, secs)
        return
    nbytes, H, L = src.numel(), h.H, h.L
    out = output if output.is_contiguous() else torch.empty_like(output, memory_format=torch.contiguous_format)
    outb = flat_ops._bytes(out).view(h.n, nbytes)
    seg = max(64, SEGMENT_CHUNKS * h.chunk // H // 64 * 64)
    for lo in range(0, nbytes, seg):
        piece = src[lo:lo + seg]
        m = piece.numel()
        block = _scratch(h, (H, m))  # in the heap: the shm all_gather_v below reads and writes them in place
        _column_gather(h, op, piece, block, secs)
        blocks = _scratch(h, (L, H, m))
        on_host(h, op, all_gather_v, blocks.view(-1), block.view(-1), [H * m] * L, timeout=secs)
        for hi, members in enumerate(h.hosts):  # block [l, hi] is member hosts[hi][l]'s piece
            for li, i in enumerate(members):
                flat_ops.copy(outb[i, lo:lo + m], blocks[li, hi])
    if out is not output:
        flat_ops.copy(output, out)


def _direct_gather(h: HostOps, op: str, output: torch.Tensor, src: torch.Tensor, heads: list, secs: float) -> None:
    """The hierarchical all_gather when every member's output lies in its heap (``heads``: the agreement's, each
    member's header offering the place of this rank's piece in its output): this rank's piece is put straight
    into the output of each column peer (one put per other host, all in flight at once; a step publishes them);
    then the column's H pieces, now in this rank's output, are put into the output of each rank of this host
    (copies in shared memory) at their places, and a barrier of the host's ranks ends the op. Inter-host bytes
    as the other hierarchical all_gather: this rank's piece once to each other host."""
    col, me, m = h.col, h.me, src.numel()
    outb = flat_ops._bytes(output)
    flat_ops.copy(outb[me * m:(me + 1) * m], src)  # (in place: the same memory, nothing copied)
    for j, i in enumerate(h.column):
        if i != me and m:
            col.track(j, h.t.put_async(h.comm.ranks[i], int(heads[i][F.DEST]), src, op=op))
    col.wait([], op=op, timeout=secs, sent=True)
    col.step([None] * col.n, op=op, timeout=secs)  # every column peer's piece is in this rank's output
    for peer in h.hosts[h.host_of[me]]:
        if peer == me or not m:
            continue
        base = int(heads[peer][F.DEST]) - me * m  # that rank's output
        for i in h.column:
            h.t.put(h.comm.ranks[peer], base + i * m, outb[i * m:(i + 1) * m], op=op)
    on_host(h, op, lambda *, comm, timeout: comm.barrier(timeout=timeout), timeout=secs)  # every rank of this host
    # put its column's pieces here


def broadcast(h: HostOps, op: str, tensor: torch.Tensor, dt: int, src: int, secs: float) -> None:
    """In place, after the agreement step: the root's column (the rank of each host with the root's local index)
    gets the tensor from the root through the column mesh, chunk by chunk, then each host broadcasts it from
    that rank (the shm op), segment by segment (``SEGMENT_CHUNKS`` chunks: the shm phase stages at most that
    much of a tensor outside the heap). The root sends ``(H-1) N`` across instead of the flat ``(n-L) N``."""
    from ..broadcast import broadcast as host_broadcast

    flat_ops.broadcast(h, op, tensor, dt, src, None, secs, data=False)
    work = tensor if tensor.is_contiguous() else tensor.contiguous()
    raw = flat_ops._bytes(work)
    li = h.hosts[h.host_of[src]].index(src)  # the root's local index: its column carries the tensor across
    col, chunk = h.col, h.chunk
    seg = SEGMENT_CHUNKS * chunk
    for lo in range(0, raw.numel(), seg):
        part = raw[lo:lo + seg]
        if h.local_index == li:
            ci = h.column.index(src)
            for k in range(0, part.numel(), chunk):
                piece = part[k:k + chunk]
                parity = col.step([piece if col.index == ci and i != ci else None for i in range(col.n)], op=op,
                                  timeout=secs)
                if col.index != ci:
                    flat_ops.copy(piece, col.view(parity, ci, piece.numel()))
        on_host(h, op, host_broadcast, part, li, timeout=secs)
    if work is not tensor:
        flat_ops.copy(tensor, work)


def reduce_scatter(h: HostOps, op: str, output: torch.Tensor, input: torch.Tensor, dt: int, red: int,
                   counts: list[int], secs: float) -> None:
    """Even reduce_scatter along dim 0 (``counts`` all equal, ``c`` elements each), after the agreement step,
    segment by segment of the slices (``SEGMENT_CHUNKS`` chunks of the input at once):

    1. the input's slices regrouped into a heap scratch, block ``l`` holding the slices of the ranks of local
       index ``l`` in host order, and an intra-host ``reduce_scatter_v`` of the blocks (the shm op): this rank
       gets its host's partial of the slice of every rank of its column;
    2. the column exchange: each host's partial of a rank's slice goes to that rank (one piece per column
       peer), which reduces the hosts' partials in host order.

    Each rank sends ``(H-1) c`` across instead of the flat ``(n-L) c``; the reduction order is the
    hierarchical all_reduce's (within each host, then across hosts in host order)."""
    from ..reduce_scatter import reduce_scatter_v

    n, H, L = h.n, h.H, h.L
    flat_ops.reduce_scatter(h, op, output, input, dt, red, counts, counts, 0, None, secs, data=False)
    c, isz = counts[0], input.element_size()
    if not c:
        return
    src = input.contiguous().view(-1)
    out = output.view(-1) if output.is_contiguous() else torch.empty(c, dtype=output.dtype)
    inner = SUM if red == AVG else red
    col, chunk = h.col, h.chunk
    k_me = h.host_of[h.me]
    seg = max(1, SEGMENT_CHUNKS * chunk // isz // n)  # elements of each slice per segment
    for lo in range(0, c, seg):
        m = min(seg, c - lo)
        arr = _scratch(h, (L, H, m * isz)).view(L, H, m * isz)  # block l: the slices of local index l
        for k, members in enumerate(h.hosts):
            for j, r in enumerate(members):
                flat_ops.copy(arr[j, k], flat_ops._bytes(src[r * c + lo:r * c + lo + m]))
        mine = _scratch(h, (H * m * isz,)).view(input.dtype)  # (in the heap too: the shm op runs zero-copy)
        on_host(h, op, reduce_scatter_v, mine, arr.view(-1).view(input.dtype), [H * m] * L, _NAMES[red],
                timeout=secs)  # 1.
        raw = flat_ops._bytes(mine).view(H, m * isz)
        step = max(1, chunk // isz) * isz
        for b in range(0, m * isz, step):  # 2.
            e = min(b + step, m * isz)
            parity = col.step([None if k == k_me else raw[k, b:e] for k in range(H)], op=op, timeout=secs)
            parts = [raw[k_me, b:e] if k == k_me else col.view(parity, k, e - b) for k in range(H)]
            flat_ops.reduce_into(out[lo + b // isz:lo + e // isz], [p.view(input.dtype) for p in parts], inner)
        del arr, mine, raw
    if red == AVG:
        out.div_(n)
    if out.data_ptr() != output.data_ptr():
        flat_ops.copy(output, out)

