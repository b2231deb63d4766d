"""Expert parallelism: ``zbccl.ep.Buffer`` behind an SGLang ``BaseDispatcher``.

How the Buffer reaches SGLang, of the three ways the issue lists:

* assigning ``Buffer``/``Config`` in SGLang's DeepEP dispatcher module
  (``layers/moe/token_dispatcher/deepep.py``), or
* replacing ``DeepEPBuffer.get_deepep_buffer``,

both keep SGLang's DeepEP dispatcher, which is CUDA code around the Buffer calls
(``torch.cuda.get_device_properties``, CUDA streams and events): it cannot run on a CPU worker
whatever Buffer it is given. The third,

* an AROUND hook on ``create_moe_dispatcher`` returning :class:`ZbcclEPDispatcher`, a
  ``BaseDispatcher`` (``layers/moe/token_dispatcher/base.py``) whose ``dispatch``/``combine`` are
  ``zbccl.ep.Buffer.dispatch``/``combine``,

runs on CPU, touches no module name (no ``deep_ep`` squatted: SGLang's own DeepEP stays importable
and usable), and is chosen only where SGLang has no working dispatcher: zbccl is on, the MoE EP
group is routed (``moe_ep`` size > 1), ``--moe-a2a-backend`` is ``none`` and the experts are
unquantized. There SGLang's ``StandardDispatcher`` marks non-local experts -1, and the CPU MoE
runner (``fused_moe_native``) cannot take a -1 (the reference error:
``RuntimeError: index -1 is out of bounds for dimension 1 with size 4``).

What it does, with the tokens replicated over the TP ranks (SGLang's attention TP): each rank
sends only its own contiguous share of the rows (the others are routed nowhere: top-k ids -1);
``get_dispatch_layout`` + ``dispatch`` bring every rank the rows whose experts it holds (expert
``e`` lives on rank ``e // num_local_experts``, SGLang's placement), with local expert ids and
router weights; ids of experts elsewhere come back -1 and are handed to SGLang's runner as a local
expert the row does not name yet, with weight 0 (:func:`distinct_local_ids`), so its output rows are already weighted sums over this rank's experts;
``combine`` sums each token's rows back on the rank that sent it (fp32, rank order) and leaves the
rows it did not send 0; the layer's TP all-reduce that follows (SGLang all-reduces MoE output
when ``moe_ep_size > 1``) then gives every rank every token.
"""

from __future__ import annotations

import torch
from sglang.srt.layers.moe.token_dispatcher.base import BaseDispatcher
from sglang.srt.layers.moe.token_dispatcher.standard import StandardDispatchOutput
from sglang.srt.layers.moe.topk import StandardTopKOutput

__all__ = ["ZbcclEPDispatcher", "counts", "create_moe_dispatcher", "buffer_for", "distinct_local_ids"]

_buffers: dict[int, object] = {}
#: This process's dispatches and combines through zbccl.ep (reported in /server_info).
counts = {"dispatch": 0, "combine": 0, "rows_received": 0}


def buffer_for(comm):
    """One ``zbccl.ep.Buffer`` per zbccl communicator (collective on first use; its layers share it)."""
    from ...ep import Buffer

    buf = _buffers.get(id(comm))
    if buf is None:
        buf = _buffers[id(comm)] = Buffer(comm)
    return buf


def distinct_local_ids(recv_idx: torch.Tensor, num_local: int) -> torch.Tensor:
    """``recv_idx`` with each -1 (an expert on another rank) replaced by a local expert id the row does not
    use yet: SGLang's CPU runner counts a row's experts with ``scatter_`` (not add), so a row must name
    each expert once. Those entries carry weight 0. Needs ``num_local >= top_k``."""
    out = recv_idx.clone()
    if out.numel() == 0:
        return out
    used = torch.zeros(out.shape[0], num_local + 1, dtype=torch.bool)
    used.scatter_(1, torch.where(out < 0, num_local, out), True)  # column num_local: a sink for -1
    used = used[:, :num_local]
    rows = torch.arange(out.shape[0])
    for j in range(out.shape[1]):
        elsewhere = out[:, j] < 0
        if not bool(elsewhere.any()):
            continue
        first = (~used).to(torch.int8).argmax(dim=1)
        out[:, j] = torch.where(elsewhere, first, out[:, j])
        used[rows[elsewhere], first[elsewhere]] = True
    return out


class ZbcclEPDispatcher(BaseDispatcher):
    """SGLang ``BaseDispatcher`` over ``zbccl.ep.Buffer`` (see the module doc)."""

    def __init__(self, moe_runner_config, comm) -> None:
        super().__init__()
        self.num_experts = int(moe_runner_config.num_experts)
        self.num_local_experts = int(moe_runner_config.num_local_experts)
        self.world_size, self.rank = comm.world_size, comm.rank
        if self.num_local_experts < int(moe_runner_config.top_k or 1):
            raise ValueError(f"ZbcclEPDispatcher: SGLang's CPU runner needs distinct expert ids per token, expected "
                             f"at least top_k={moe_runner_config.top_k} local experts, got {self.num_local_experts}")
        if self.num_experts != self.num_local_experts * self.world_size:
            raise ValueError(f"ZbcclEPDispatcher: experts must split evenly over the EP ranks, expected "
                             f"{self.num_local_experts} x {self.world_size}, got {self.num_experts}")
        self.buffer = buffer_for(comm)
        self._handle = None
        self._num_recv = 0
        self.dispatches = 0

    def dispatch(self, hidden_states: torch.Tensor, topk_output) -> StandardDispatchOutput:
        weights, ids = topk_output.topk_weights, topk_output.topk_ids
        n = hidden_states.shape[0]
        start, stop = (n * self.rank) // self.world_size, (n * (self.rank + 1)) // self.world_size
        idx = torch.full(ids.shape, -1, dtype=torch.int64)
        idx[start:stop] = ids[start:stop].to(torch.int64)  # this rank's share; the rest goes nowhere
        buf = self.buffer
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, self.num_experts)
        recv_x, recv_idx, recv_w, _, handle, _ = buf.dispatch(
            hidden_states.contiguous(), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=weights.float().contiguous())
        self._handle, self._num_recv = handle, recv_x.shape[0]
        self.dispatches += 1
        counts["dispatch"] += 1
        counts["rows_received"] += int(self._num_recv)
        ids_out = distinct_local_ids(recv_idx, self.num_local_experts).to(ids.dtype)
        w_out = torch.where(recv_idx < 0, torch.zeros_like(recv_w), recv_w).to(weights.dtype)
        if self._num_recv == 0:  # SGLang's CPU runner cannot take 0 rows: one zero row, weight 0, dropped in combine
            recv_x = hidden_states.new_zeros((1, hidden_states.shape[1]))
            ids_out = ids.new_zeros((1, ids.shape[1]))
            w_out = weights.new_zeros((1, weights.shape[1]))
        return StandardDispatchOutput(hidden_states=recv_x, hidden_states_scale=None,
                                      topk_output=StandardTopKOutput(w_out, ids_out, None))

    def combine(self, combine_input) -> torch.Tensor:
        if self._handle is None:
            raise RuntimeError("ZbcclEPDispatcher.combine: no dispatch to combine, expected dispatch() first, "
                               "got combine() alone")
        x = combine_input.hidden_states[:self._num_recv].contiguous()
        handle, self._handle = self._handle, None
        out, _, _ = self.buffer.combine(x, handle)
        counts["combine"] += 1
        return out


def create_moe_dispatcher(original, moe_runner_config, quant_method, *args, **kwargs):
    """AROUND hook of ``fused_moe_triton.layer.create_moe_dispatcher``: :class:`ZbcclEPDispatcher` where it
    applies (zbccl on, routed ``moe_ep`` group of 2+ ranks, a2a backend ``none``, unquantized experts),
    SGLang's own dispatcher elsewhere."""
    from sglang.srt.distributed.parallel_state import get_moe_ep_group
    from sglang.srt.layers.moe.utils import get_moe_a2a_backend

    from .group import group_of

    ep = get_moe_ep_group()
    zb = group_of(ep) if ep is not None else None
    if (zb is None or ep.world_size <= 1 or not get_moe_a2a_backend().is_none()
            or type(quant_method).__name__ != "UnquantizedFusedMoEMethod"
            or moe_runner_config.num_local_experts < (moe_runner_config.top_k or 1)):
        return original(moe_runner_config, quant_method, *args, **kwargs)
    return ZbcclEPDispatcher(moe_runner_config, zb.comm)
