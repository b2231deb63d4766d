"""``ProcessGroupZbccl``: torch.distributed's process-group interface over a zbccl communicator.

This is the edge where torch's conventions meet zbccl's: the options structs,
``ReduceOp`` values, list forms, ``Work`` handles and ``async_op`` are
translated here and nowhere else. Root and peer ranks arrive as *group*
ranks (torch translates global ranks before it calls a process group), and a
zbccl communicator numbers its members in the same sorted order, so they pass
through unchanged.

Host semantics: every CPU collective blocks the calling thread until it is
complete on this rank (see :mod:`.work`). ``async_op=True`` is accepted; the
op still completes inside the call and its Work is already complete; an
error then travels in the Work (``wait()``, ``exception()``, the future)
instead of raising at the call.

CUDA tensors follow NCCL's semantics (``docs/cuda-ops.md``): the op is
enqueued on the current stream and the host does not wait; with
``async_op=True`` it runs on this group's side stream after the current
stream's work, and its :class:`~.work.DeviceWork` (a CUDA event) makes the
current stream wait in ``wait()``.

Ops zbccl does not run (``ZBCCL_FALLBACK_OPS``, bitwise reduce ops, all of
them after an initialisation fallback) run on the group's inner gloo group
through :mod:`.gloo_route`. That gloo group is also the group's registered
CPU backend, for torch's C++ paths that cannot reach a Python process group.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch._C._distributed_c10d as _c10d
import torch.distributed as dist

from ..errors import ZbcclInvalidUsageError
from ..ops import (
    all_gather_into_tensor,
    all_reduce,
    all_to_all_single,
    barrier,
    broadcast,
    reduce_scatter_tensor,
)
from ..ops.dtypes import REDUCE_OPS, op_name
from . import gloo_route
from .device_work import cuda_barrier, launch
from .list_forms import (
    allgather_list,
    alltoall_list,
    as_bytes,
    as_bytes_rows,
    as_real,
    gather_list,
    reduce_scatter_list,
    reduce_to,
    scatter_list,
)
from .work import CompletedWork, timeout_seconds

__all__ = ["ProcessGroupZbccl", "reduce_op_name"]

_log = logging.getLogger("zbccl")
#: torch's ReduceOp names zbccl runs -> zbccl's name (from the one table, ``abi.REDUCE_ALIASES``).
_REDUCE = {n.upper(): op_name(c) for n, c in REDUCE_OPS.items() if hasattr(dist.ReduceOp, n.upper())}
_BITWISE = ("BAND", "BOR", "BXOR")
_RS = "reduce_scatter"
# How long destroying a sub-group waits for its other members.
_DESTROY_TIMEOUT_S = 30.0


# Keyed by the RedOpType's int value: hashing the enum itself costs ~4x more per op.
_BY_KIND = {int(getattr(dist.ReduceOp, n)): v for n, v in _REDUCE.items()}
_BY_KIND.update({int(getattr(dist.ReduceOp, n)): "gloo" for n in _BITWISE})


def reduce_op_name(red, *, op: str) -> str:
    """torch ``ReduceOp`` -> zbccl's name; ``"gloo"`` for the bitwise ops zbccl leaves to gloo."""
    kind = getattr(red, "op", red)
    name = _BY_KIND.get(kind.value) if isinstance(kind, dist.ReduceOp.RedOpType) else None
    if name is not None:  # the hot path: one dict lookup
        return name
    name = getattr(kind, "name", str(kind).rsplit(".", 1)[-1])
    if name in _REDUCE:
        return _REDUCE[name]
    if name in _BITWISE:
        return "gloo"
    raise ZbcclInvalidUsageError(
        f"{op}: unsupported reduce op, expected SUM, AVG, PRODUCT, MIN, MAX (or BAND/BOR/BXOR, run by gloo), "
        f"got {name}")


class ProcessGroupZbccl(dist.ProcessGroup):
    """A torch process group whose collectives run on the zbccl communicator ``comm``.

    ``comm`` None means zbccl could not start: every op runs on ``gloo``.
    ``fallback`` holds the op keys (see :data:`~zbccl.adapters.backend.FALLBACK_KEYS`)
    that always run on ``gloo``. Made by the backend's creator, never directly.

    Every collective is a collective over the group's members. On CPU tensors it blocks the host until
    it is complete on this rank, and ``async_op=True`` does not make it run in the background: the call
    returns a Work that is already complete (its error, if any, inside it). On CUDA tensors it is
    enqueued on a stream and never blocks the host (see the module docstring). Only receives
    (``irecv``) and sends of heap tensors (``isend``) return Works that complete later.
    """

    def __init__(self, comm, *, rank: int, size: int, gloo: dist.ProcessGroup, fallback: frozenset[str],
                 owns_world: bool, reason: str | None = None, p2p=None) -> None:
        super().__init__(rank, size)
        self._comm = comm
        self._gloo = gloo
        self._fallback = fallback
        self._owns_world = owns_world
        self._p2p = p2p
        self._name = ""
        self._desc = ""
        self._closed = False
        self._side: dict[torch.device, torch.cuda.Stream] = {}  # async CUDA ops' streams (one per device)
        #: Why this group runs everything on gloo (None when zbccl runs it).
        self.fallback_reason = reason

    # ------------------------------------------------------------ identity
    @property
    def comm(self):
        """The zbccl communicator (None after an initialisation fallback)."""
        return self._comm

    def getBackendName(self) -> str:
        return "zbccl"

    def setGroupName(self, name: str) -> None:
        self._name = name

    def getGroupName(self) -> str:
        return self._name

    def setGroupDesc(self, desc: str) -> None:
        self._desc = desc

    def getGroupDesc(self) -> str:
        return self._desc

    def __repr__(self) -> str:
        how = "gloo fallback" if self._comm is None else f"ranks={list(self._comm.ranks)}"
        return f"ProcessGroupZbccl(rank={self.rank()}, size={self.size()}, name={self._name!r}, {how})"

    # ------------------------------------------------------------ dispatch
    def _zb(self, key: str) -> bool:
        return self._comm is not None and key not in self._fallback

    def _done(self, opts, result: list[torch.Tensor], run: Callable[[], None],
              inputs: tuple[torch.Tensor, ...] = ()) -> dist.Work:
        """Run ``run`` now; sync ops raise, async ops carry the error in their Work. CUDA ops are enqueued (on
        the current stream; async ones on this group's side stream, see :meth:`_device_async`)."""
        if not getattr(opts, "asyncOp", False):
            run()
            return _SYNC_DONE  # a sync call's Work is only waited on (torch drops it): one shared object
        if result and isinstance(result[0], torch.Tensor) and result[0].is_cuda:
            return self._device_async(result, inputs, run)
        try:
            run()
        except Exception as exc:  # noqa: BLE001 - the Work hands it to wait()/exception()/the future
            return CompletedWork(result, exc)
        return CompletedWork(result)

    def _device_async(self, result: list[torch.Tensor], inputs: tuple[torch.Tensor, ...],
                      run: Callable[[], None]) -> dist.Work:
        """An ``async_op=True`` CUDA collective on this group's side stream (see :func:`.device_work.launch`)."""
        device = result[0].device
        side = self._side.get(device)
        if side is None:
            side = self._side[device] = torch.cuda.Stream(device)
        return launch(self._comm, side, result, inputs, run)

    def _g(self, opts, result: list[torch.Tensor], call) -> dist.Work:
        """Run an op on the inner gloo group to completion (see :mod:`.gloo_route` for why)."""
        return gloo_route.on_gloo(opts, result, call, sync_done=_SYNC_DONE)

    def _p2p_gloo(self, work, tensors: list[torch.Tensor], anysource: bool = False) -> dist.Work:
        return gloo_route.p2p_work(work, tensors, default_timeout=self._gloo.options._timeout.total_seconds(),
                                   anysource=anysource)

    # ------------------------------------------------------------ allreduce
    def allreduce(self, tensors: list[torch.Tensor], opts=None) -> dist.Work:
        opts = opts if opts is not None else _c10d.AllreduceOptions()
        red = reduce_op_name(opts.reduceOp, op="allreduce")
        comm = self._comm
        if comm is None or red == "gloo" or "allreduce" in self._fallback:
            return self._g(opts, tensors, lambda s: self._gloo.allreduce(s.all(tensors), opts))
        if not opts.asyncOp:  # the hot path of inference engines, inline
            for t in tensors:
                all_reduce(t, red, comm=comm)
            return _SYNC_DONE

        return self._done(opts, tensors, lambda: [all_reduce(t, red, comm=comm) for t in tensors])

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts=None) -> dist.Work:
        opts = opts if opts is not None else _c10d.AllreduceCoalescedOptions()
        red = reduce_op_name(opts.reduceOp, op="allreduce_coalesced")
        if not self._zb("allreduce_coalesced") or red == "gloo":
            return self._g(opts, tensors, lambda s: self._gloo.allreduce_coalesced(s.all(tensors), opts))
        comm = self._comm

        return self._done(opts, tensors, lambda: [all_reduce(t, red, comm=comm) for t in tensors])

    # ------------------------------------------------------------ all_gather
    def allgather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                  opts=None) -> dist.Work:
        opts = opts if opts is not None else _c10d.AllgatherOptions()
        if not self._zb("allgather"):
            return self._g(opts, [t for o in output_lists for t in o], lambda s: [
                gloo_route.allgather_list(self._gloo, o, i, s) for o, i in zip(output_lists, inputs)])
        comm = self._comm

        return self._done(opts, [t for outs in output_lists for t in outs], lambda: [
            allgather_list(comm, outs, inp) for outs, inp in zip(output_lists, inputs)], tuple(inputs))

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts=None) -> dist.Work:
        opts = opts if opts is not None else _c10d.AllgatherOptions()
        if not self._zb("all_gather_into_tensor"):
            return self._g(opts, [output], lambda s: gloo_route.allgather_flat(self._gloo, output, input, s))
        comm = self._comm
        return self._done(opts, [output], lambda: all_gather_into_tensor(as_bytes(output), as_bytes(input),
                                                                         comm=comm), (input,))

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts=None) -> dist.Work:
        opts = opts if opts is not None else _c10d.AllgatherOptions()
        if not self._zb("all_gather_into_tensor"):
            return self._g(opts, outputs, lambda s: [
                gloo_route.allgather_flat(self._gloo, o, i, s) for o, i in zip(outputs, inputs)])
        comm = self._comm

        return self._done(opts, outputs, lambda: [
            all_gather_into_tensor(as_bytes(out), as_bytes(inp), comm=comm) for out, inp in zip(outputs, inputs)],
            tuple(inputs))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                            opts=None) -> dist.Work:
        opts = opts if opts is not None else _c10d.AllgatherOptions()
        if not self._zb("allgather"):
            return self._g(opts, [t for o in output_lists for t in o], lambda s: self._gloo.allgather_coalesced(
                s.nested(output_lists), s.all(inputs), opts))
        comm = self._comm
        # torch's layout: output_lists[r][i] is rank r's inputs[i].
        W = comm.world_size

        def run() -> None:
            if len(output_lists) != W:
                raise ZbcclInvalidUsageError(
                    f"allgather_coalesced: wrong output list length, expected {W}, got {len(output_lists)}")
            for i, inp in enumerate(inputs):
                allgather_list(comm, [output_lists[r][i] for r in range(W)], inp)

        return self._done(opts, [t for outs in output_lists for t in outs], run)

    # ------------------------------------------------------------ reduce_scatter
    def reduce_scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]],
                       opts=None) -> dist.Work:
        opts = opts if opts is not None else _c10d.ReduceScatterOptions()
        red = reduce_op_name(opts.reduceOp, op="reduce_scatter")
        if not self._zb("reduce_scatter") or red == "gloo":
            return self._g(opts, outputs, lambda s: self._gloo.reduce_scatter(s.all(outputs), s.nested(input_lists), opts))
        comm = self._comm

        return self._done(opts, outputs, lambda: [
            reduce_scatter_list(comm, as_real(out, red, op=_RS), [as_real(i, red, op=_RS) for i in ins], red)
            for out, ins in zip(outputs, input_lists)], tuple(t for ins in input_lists for t in ins))

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts=None) -> dist.Work:
        opts = opts if opts is not None else _c10d.ReduceScatterOptions()
        red = reduce_op_name(opts.reduceOp, op="reduce_scatter_tensor")
        if not self._zb("reduce_scatter_tensor") or red == "gloo":
            return self._g(opts, [output], lambda s: self._gloo._reduce_scatter_base(s(output), s(input), opts))
        comm = self._comm
        return self._done(opts, [output], lambda: reduce_scatter_tensor(
            as_real(output, red, op=_RS), as_real(input, red, op=_RS), red, comm=comm), (input,))

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts=None) -> dist.Work:
        opts = opts if opts is not None else _c10d.ReduceScatterOptions()
        red = reduce_op_name(opts.reduceOp, op="reduce_scatter_tensor_coalesced")
        if not self._zb("reduce_scatter_tensor") or red == "gloo":
            return self._g(opts, outputs, lambda s: [
                self._gloo._reduce_scatter_base(s(o), s(i), opts) for o, i in zip(outputs, inputs)])
        comm = self._comm

        return self._done(opts, outputs, lambda: [
            reduce_scatter_tensor(as_real(out, red, op=_RS), as_real(inp, red, op=_RS), red, comm=comm)
            for out, inp in zip(outputs, inputs)], tuple(inputs))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # ------------------------------------------------------------ all_to_all
    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                          input_split_sizes: list[int], opts=None) -> dist.Work:
        opts = opts if opts is not None else _c10d.AllToAllOptions()
        if not self._zb("alltoall_base"):
            return self._g(opts, [output], lambda s: self._gloo.alltoall_base(
                s(output), s(input), output_split_sizes, input_split_sizes, opts))
        comm = self._comm
        outs = list(output_split_sizes) or None
        ins = list(input_split_sizes) or None
        return self._done(opts, [output], lambda: all_to_all_single(as_bytes_rows(output), as_bytes_rows(input),
                                                                    outs, ins, comm=comm), (input,))

    alltoall_base = all_to_all_single

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts=None) -> dist.Work:
        opts = opts if opts is not None else _c10d.AllToAllOptions()
        if not self._zb("alltoall"):
            return self._g(opts, outputs, lambda s: gloo_route.alltoall_list(self._gloo, outputs, inputs, s))
        comm = self._comm

        return self._done(opts, outputs, lambda: alltoall_list(comm, outputs, inputs), tuple(inputs))

    # ------------------------------------------------------------ rooted ops
    def broadcast(self, tensors: list[torch.Tensor], opts=None) -> dist.Work:
        opts = opts if opts is not None else _c10d.BroadcastOptions()
        if not self._zb("broadcast"):
            return self._g(opts, tensors, lambda s: self._gloo.broadcast(s.all(tensors), opts))
        comm, root = self._comm, opts.rootRank

        return self._done(opts, tensors, lambda: [broadcast(as_bytes(t), root, comm=comm) for t in tensors])

    def reduce(self, tensors: list[torch.Tensor], opts=None) -> dist.Work:
        """Reduce to ``opts.rootRank``: a reduce_scatter then a gather into the root's tensor (see
        :func:`~.list_forms.reduce_to`); non-root tensors are left unchanged."""
        opts = opts if opts is not None else _c10d.ReduceOptions()
        red = reduce_op_name(opts.reduceOp, op="reduce")
        if not self._zb("reduce") or red == "gloo":
            if self.rank() == opts.rootRank:
                return self._g(opts, tensors, lambda s: self._gloo.reduce(s.all(tensors), opts))
            # gloo leaves partial sums in non-root tensors: reduce copies, so they stay unchanged here too
            return self._g(opts, tensors, lambda s: self._gloo.reduce(s.all([t.clone() for t in tensors]), opts))
        comm, root = self._comm, opts.rootRank

        return self._done(opts, tensors, lambda: [
            reduce_to(comm, root, as_real(t, red, op="reduce"), red) for t in tensors])

    def gather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts=None) -> dist.Work:
        """Gather to ``opts.rootRank``: an all_to_all in which only the root receives (no extra traffic)."""
        opts = opts if opts is not None else _c10d.GatherOptions()
        if not self._zb("gather"):
            return self._g(opts, [t for o in output_lists for t in o], lambda s: self._gloo.gather(
                s.nested(output_lists), s.all(inputs), opts))
        comm, root = self._comm, opts.rootRank
        return self._done(opts, [t for outs in output_lists for t in outs],
                          lambda: gather_list(comm, root, output_lists[0] if output_lists else [], inputs[0]))

    def scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts=None) -> dist.Work:
        """Scatter from ``opts.rootRank``: an all_to_all in which only the root sends."""
        opts = opts if opts is not None else _c10d.ScatterOptions()
        if not self._zb("scatter"):
            return self._g(opts, outputs, lambda s: self._gloo.scatter(s.all(outputs), s.nested(input_lists), opts))
        comm, root = self._comm, opts.rootRank
        return self._done(opts, outputs,
                          lambda: scatter_list(comm, root, outputs[0], input_lists[0] if input_lists else []))

    def barrier(self, opts=None) -> dist.Work:
        opts = opts if opts is not None else _c10d.BarrierOptions()
        if not self._zb("barrier"):
            return self._g(opts, [], lambda s: self._gloo.barrier(opts))
        comm = self._comm
        timeout = timeout_seconds(opts.timeout)  # torch's "unset" is negative: the group's default
        device = getattr(opts, "device", None)
        if getattr(device, "type", None) == "cuda" and torch.cuda.is_initialized():
            return self._done(opts, [], lambda: cuda_barrier(comm, device, timeout))
        return self._done(opts, [], lambda: barrier(comm=comm, timeout=timeout))

    # ------------------------------------------------------------ point to point
    def _device_p2p(self, tensors, post, *, receive: bool, anysource: bool = False) -> dist.Work:
        return gloo_route.device_p2p(tensors, post, default_timeout=self._gloo.options._timeout.total_seconds(),
                                     anysource=anysource, receive=receive)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> dist.Work:
        if tensors and isinstance(tensors[0], torch.Tensor) and tensors[0].is_cuda:  # through gloo on host copies (zbccl's mailboxes are CPU memory)
            return self._device_p2p(tensors, lambda h: self._gloo.send(h, dst, tag), receive=False)
        if self._p2p is None or not self._zb("send"):
            return self._p2p_gloo(self._gloo.send(tensors, dst, tag), tensors)
        return self._p2p.send(tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> dist.Work:
        if tensors and isinstance(tensors[0], torch.Tensor) and tensors[0].is_cuda:
            return self._device_p2p(tensors, lambda h: self._gloo.recv(h, src, tag), receive=True)
        if self._p2p is None or not self._zb("recv"):
            return self._p2p_gloo(self._gloo.recv(tensors, src, tag), tensors)
        return self._p2p.recv(tensors, src, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> dist.Work:
        if tensors and isinstance(tensors[0], torch.Tensor) and tensors[0].is_cuda:
            return self._device_p2p(tensors, lambda h: self._gloo.recv_anysource(h, tag), receive=True, anysource=True)
        if self._p2p is None or not self._zb("recv"):
            return self._p2p_gloo(self._gloo.recv_anysource(tensors, tag), tensors, anysource=True)
        return self._p2p.recv(tensors, None, tag)

    # ------------------------------------------------------------ lifetime
    def shutdown(self) -> None:
        """End this group: a sub-group returns its zbccl slot; the world group finalizes zbccl if it started it."""
        if self._closed:
            return
        self._closed = True
        if self._p2p is not None:
            self._p2p.close()
        comm, self._comm = self._comm, None
        if comm is None:
            return
        from ..runtime.state import finalize

        try:
            if comm.slot != 0:  # a store barrier of the members, bounded: a member that never comes keeps the slot
                comm.destroy(timeout=min(comm.timeout, _DESTROY_TIMEOUT_S))
            elif self._owns_world:
                finalize()
        except Exception as exc:  # noqa: BLE001 - teardown goes on (finalize already ran, a peer left...)
            _log.info("zbccl: process group shutdown: %s", exc)

    def abort(self) -> None:
        """Mark this rank failed (peers waiting on it raise at once) and stop using zbccl here."""
        from ..runtime.state import abort

        if self._comm is not None:
            abort("the process group was aborted")
        self._closed = True


#: What every synchronous call returns: complete, successful, no result kept.
_SYNC_DONE = CompletedWork()
