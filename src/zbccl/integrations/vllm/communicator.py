"""``ZbcclCpuCommunicator``: vLLM's CPU device communicator with its collectives on zbccl.

vLLM builds one device communicator per model-parallel group and rank
(``GroupCoordinator.__init__``); the plugin names this class in place of vLLM's
``CpuCommunicator``. For ``tp*`` and ``pp*`` groups it runs on a zbccl
communicator of the group's members:

* **Start.** The first such group of a worker starts zbccl over the whole vLLM
  world, through the default torch store vLLM already made (keys under
  ``zbccl-vllm/``); every later group is ``world.new_group(ranks)`` (the world
  itself when the group is the whole world). vLLM makes every rank's groups in
  the same order, so the collective starts line up.
* **Agreement.** Every member's start verdict is all-reduced (MIN) on vLLM's
  gloo ``cpu_group``: if any member could not start, all of them run vLLM's
  own ``CpuCommunicator`` and each warns once, naming the reason. A start that
  half-worked therefore never leaves ranks on different transports.
* **Ops.** Group ranks in vLLM's calls (``dst``, ``src``) are the order of
  ``self.ranks``, which must be ascending: zbccl numbers a group's members in
  global order. Collectives block the host until complete on this rank, as
  vLLM's shm ops do. send/recv (and the tensor-dict forms of CPU pipeline
  parallelism) use the heap-to-heap mailboxes of ``adapters/p2p.py``; a send of
  a private tensor is staged (counted in ``staged_bytes``) and returns at once.
* **Hot entry.** ``zbccl.all_reduce`` and ``all_gather_into_tensor`` first offer
  the tensors to the channel's native hot entries (``OpChannel.hot``,
  ``native/csrc/py/hot.cpp``): tensors zbccl already made a plan for (the same heap
  activation every step) run in one native call, without the Python entry that
  a layer's matmuls leave cold. all_reduce runs through ``zbccl.ops.bind_all_reduce``
  (bound once per group): the hot entry without the per-call lookups of
  ``zbccl.all_reduce``, which cost 4-7 µs more per call in vLLM's step
  (docs/benchmarks.md); a tensor the entry does not serve takes all_reduce's
  Python path.

Other groups (``dcp``, ``ep``, ...) are vLLM's ``CpuCommunicator`` unchanged.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch
import torch.distributed as dist
from vllm.distributed.device_communicators.base_device_communicator import DeviceCommunicatorBase
from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

from ... import ops
from ...adapters.list_forms import gather_list
from ...adapters.objects import object_to_tensor, tensor_to_object
from ...adapters.p2p import PointToPoint

__all__ = ["ZbcclCpuCommunicator", "start_group"]

_log = logging.getLogger("zbccl")
_TAG_DATA, _TAG_META = 1, 2
_warned: list[str] = []


def start_group(global_ranks: list[int]):
    """Collective over ``global_ranks``: the zbccl communicator of these vLLM ranks (starts zbccl first)."""
    from ...runtime.registry import get_default
    from ...runtime.state import init

    if list(global_ranks) != sorted(global_ranks):
        raise ValueError(f"vllm group: ranks must be ascending for zbccl, expected sorted ranks, "
                         f"got {list(global_ranks)}")
    world = get_default()
    if world is None:
        store = dist.PrefixStore("zbccl-vllm/", dist.distributed_c10d._get_default_store())
        world = init(store=store, rank=dist.get_rank(), world_size=dist.get_world_size())
        if world.local_world_size != world.world_size:
            raise ValueError(f"vllm group: zbccl has no inter-host transport, expected one host, "
                             f"got {len(world.topology.hosts)}")
    if list(global_ranks) == list(range(world.world_size)):
        return world
    return world.new_group(list(global_ranks))


class ZbcclCpuCommunicator(CpuCommunicator):
    """vLLM ``DeviceCommunicator`` over zbccl (``tp*``/``pp*`` groups); vLLM's own elsewhere or on failure."""

    def __init__(self, cpu_group, device: torch.device | None = None, device_group=None,
                 unique_name: str = "", use_all2all: bool = False) -> None:
        DeviceCommunicatorBase.__init__(self, cpu_group, device, device_group, unique_name,
                                        use_all2all=use_all2all)
        self.zb = None
        self.p2p: PointToPoint | None = None
        self._all_reduce = None  # zbccl's all_reduce bound to the group's communicator
        if not unique_name.startswith(("tp", "pp")) or use_all2all:
            CpuCommunicator.__init__(self, cpu_group, device, device_group, unique_name, use_all2all)
            return
        comm, reason = None, None
        try:
            comm = start_group(list(self.ranks))
        except Exception as exc:  # any failure: vLLM's own communicator, agreed below
            reason = f"{type(exc).__name__}: {exc}"
        ok = torch.tensor([1 if reason is None else 0], dtype=torch.int64)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.cpu_group)
        if int(ok.item()) == 1:
            self.zb = comm
            self.p2p = PointToPoint(comm, incarnation=f"vllm-{unique_name}")
            self._all_reduce = ops.bind_all_reduce(comm)
            self.dist_module = None
            self.supports_tensor_dict = True
            _log.info("zbccl: vLLM group %s runs on zbccl (ranks %s)", unique_name, self.ranks)
            return
        why = reason or "another member of the group could not start zbccl"
        if why not in _warned:
            _warned.append(why)
            warnings.warn(f"zbccl: vLLM group {unique_name!r} falls back to vLLM's own CPU communicator: "
                          f"{why}", RuntimeWarning, stacklevel=2)
        CpuCommunicator.__init__(self, cpu_group, device, device_group, unique_name, use_all2all)

    # ------------------------------------------------------------ collectives
    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        if self._all_reduce is None:
            return super().all_reduce(input_)
        return self._all_reduce(input_)

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.zb is None:
            return super().all_gather(input_, dim)
        dim = dim + input_.dim() if dim < 0 else dim
        size = input_.size()
        # each rank's rows straight into their columns: no gather along dim 0 and reordering copy after
        out = torch.empty(size[:dim] + (self.world_size * size[dim],) + size[dim + 1:], dtype=input_.dtype)
        ops.all_gather_into_tensor(out, input_, dim=dim, comm=self.zb)
        return out

    def all_gatherv(self, input_: torch.Tensor | list[torch.Tensor], dim: int = 0,
                    sizes: list[int] | None = None) -> torch.Tensor | list[torch.Tensor]:
        if self.zb is None:
            return super().all_gatherv(input_, dim, sizes)
        if not isinstance(input_, torch.Tensor):
            return [self.all_gatherv(t, dim, sizes) for t in input_]
        if sizes is None:
            return self.all_gather(input_, dim)
        dim = dim + input_.dim() if dim < 0 else dim
        size = input_.size()  # sizes that disagree with the input fail in zbccl, on every rank
        out = torch.empty(size[:dim] + (sum(sizes),) + size[dim + 1:], dtype=input_.dtype)
        ops.all_gather_v(out, input_, list(sizes), dim=dim, comm=self.zb)  # rows straight into their columns
        return out

    def reduce_scatter(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.zb is None:
            return super().reduce_scatter(input_, dim)
        return self.reduce_scatterv(input_, dim, None)

    def reduce_scatterv(self, input_: torch.Tensor, dim: int = -1,
                        sizes: list[int] | None = None) -> torch.Tensor:
        if self.zb is None:
            return super().reduce_scatterv(input_, dim, sizes)
        dim = dim + input_.dim() if dim < 0 else dim
        size = input_.size()
        # each rank reduces its chunk straight from the peers' columns: no reordering copies; sizes that do
        # not fit the input fail in zbccl, on every rank
        if sizes is None:
            out = torch.empty(size[:dim] + (size[dim] // self.world_size,) + size[dim + 1:], dtype=input_.dtype)
            ops.reduce_scatter_tensor(out, input_, dim=dim, comm=self.zb)
        else:
            mine = sizes[self.rank_in_group] if len(sizes) == self.world_size else 0
            out = torch.empty(size[:dim] + (mine,) + size[dim + 1:], dtype=input_.dtype)
            ops.reduce_scatter_v(out, input_, list(sizes), dim=dim, comm=self.zb)
        return out

    def gather(self, input_: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        if self.zb is None:
            return super().gather(input_, dst, dim)
        dim = dim + input_.dim() if dim < 0 else dim
        inp = input_.contiguous()
        me = self.rank_in_group == dst
        outs = [torch.empty_like(inp) for _ in range(self.world_size)] if me else []
        gather_list(self.zb, dst, outs, inp)
        return torch.cat(outs, dim=dim) if me else None

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.zb is None:
            return super().broadcast(tensor, src)
        ops.broadcast(tensor, src, comm=self.zb)
        return tensor

    # ------------------------------------------------------------ point to point
    def send(self, tensor: torch.Tensor, dst: int | None = None) -> None:
        if self.zb is None:
            return super().send(tensor, dst)
        dst = (self.rank_in_group + 1) % self.world_size if dst is None else dst
        self.p2p.send([tensor.contiguous()], dst, _TAG_DATA).wait()

    def recv(self, size: torch.Size, dtype: torch.dtype, src: int | None = None) -> torch.Tensor:
        if self.zb is None:
            return super().recv(size, dtype, src)
        src = (self.rank_in_group - 1) % self.world_size if src is None else src
        out = torch.empty(size, dtype=dtype)
        self.p2p.recv([out], src, _TAG_DATA).wait()
        return out

    def send_tensor_dict(self, tensor_dict: dict[str, torch.Tensor | Any], dst: int) -> None:
        """Blocking: the tensors (sizes and dtypes in a pickled header first); non-tensors ride in the header."""
        if self.zb is None:
            return super().send_tensor_dict(tensor_dict, dst)
        tensors = {k: v for k, v in tensor_dict.items() if isinstance(v, torch.Tensor)}
        meta = [(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]
        others = {k: v for k, v in tensor_dict.items() if k not in tensors}
        header = object_to_tensor((meta, others))
        self.p2p.send([torch.tensor([header.numel()], dtype=torch.int64)], dst, _TAG_META).wait()
        self.p2p.send([header], dst, _TAG_META).wait()
        for v in tensors.values():
            if v.numel():
                self.p2p.send([v.contiguous()], dst, _TAG_DATA).wait()

    def recv_tensor_dict(self, src: int) -> dict[str, torch.Tensor | Any]:
        if self.zb is None:
            return super().recv_tensor_dict(src)
        n = torch.empty(1, dtype=torch.int64)
        self.p2p.recv([n], src, _TAG_META).wait()
        header = torch.empty(int(n.item()), dtype=torch.uint8)
        self.p2p.recv([header], src, _TAG_META).wait()
        meta, others = tensor_to_object(header)
        out: dict[str, Any] = {}
        for key, shape, dtype in meta:
            t = torch.empty(shape, dtype=dtype)
            if t.numel():
                self.p2p.recv([t], src, _TAG_DATA).wait()
            out[key] = t
        out.update(others)
        return out

    def destroy(self) -> None:
        """Drops this group's mailboxes; the heap itself ends with the worker (zbccl's atexit finalize)."""
        if self.p2p is not None:
            self.p2p.close()
            self.p2p = None
        super().destroy()
