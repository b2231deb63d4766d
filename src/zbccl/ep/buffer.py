"""``Buffer``: DeepEP's expert-parallel communication API over zbccl's shared heap.

``import zbccl.ep as deep_ep`` runs code written against DeepEP's (legacy, V1) ``deep_ep.Buffer``
on CPU processes. Every op is collective over the Buffer's group, blocks the host until its
results are complete, and follows the protocol of :mod:`zbccl.ep.exchange` (publish a header,
pull rows straight from peers' memory, barrier). Receive tensors are allocated in the heap at
their exact size; no buffer is reserved up front. CUDA tensors take :mod:`zbccl.ep.device` instead
(the CUDA heap and the device collectives, enqueued on the current stream: DeepEP's stream semantics).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import deque
from collections.abc import Callable

import torch

from ..errors import ZbcclInvalidUsageError, ZbcclOutOfMemoryError
from ..native.abi import EP_OP_CLEAN as OP_CLEAN  # the tag of clean_low_latency_buffer's barrier
from ..native.abi import WHERE_EP
from . import fast, internode, internode_combine, internode_ll, low_latency, normal
from .config import Config, combine_config, dispatch_config, get_low_latency_rdma_size_hint
from .event import DeviceEventHandle, EventHandle, EventOverlap
from .event import completed as _event
from .event import stream_error as _stream_error
from .exchange import PHASE_CLEAN, Exchange, Fail, device_heap_empty, heap_empty
from .group import communicator_of as _communicator_of
from .wire import HostWire, spans_hosts

__all__ = ["Buffer"]


class _KeyRef(weakref.ref):
    """A handle tensor's weakref, with the ``id`` it is registered under."""

    __slots__ = ("k",)


class Buffer:
    """DeepEP-compatible expert-parallel buffer over a zbccl communicator.

    ``group``: a zbccl :class:`~zbccl.Communicator`, or a torch ProcessGroup: one of the zbccl
    backend (its communicator), or of another backend such as gloo, which runs on
    zbccl's default communicator, started from that group's store (``zbccl.init(group=group)``;
    heap: ``ZBCCL_HEAP_SIZE`` if set, else ``num_nvl_bytes + num_rdma_bytes`` up to 1 GiB and half
    the machine's free memory per rank, at least the default) when zbccl is not initialized yet. A world started
    from one group reaches only that group's ranks: a Buffer on a group with others raises
    :class:`~zbccl.errors.ZbcclInvalidUsageError` on every rank; start zbccl over torch's world first
    (``zbccl.init(group=torch.distributed.group.WORLD)``) when Buffers use several groups. Construction is collective
    over the group: the Buffer takes a private sub-communicator of its ranks, so its ops never
    interleave with the caller's collectives. ``num_nvl_bytes``/``num_rdma_bytes`` reserve
    nothing (receive tensors are allocated at their exact size after the handshake); they only
    size :meth:`get_local_buffer_tensor`. As DeepEP's, ``num_rdma_bytes`` must be a multiple of 128 (on
    one host, without low-latency mode, it is accepted and unused, as DeepEP's is). A group that spans hosts (the routed
    transport) runs DeepEP's internode mode (``docs/ep-internode.md``): the same API on the transport
    verbs, a token bound for several ranks of one host crossing to it once, the handle DeepEP's internode
    10-tuple, and :meth:`memory_stats` reporting what crossed; there each rank holds the slots that carry the
    small parts (``tuner.ep_hosts_eager``), within ``num_rdma_bytes`` when it is given and an eighth of the
    heap. ``low_latency_mode``, ``num_qps_per_rank``, ``allow_nvlink_for_low_latency_mode``, ``allow_mnnvl``,
    ``use_fabric`` and ``comm`` (mpi4py) are accepted and ignored; ``enable_shrink`` enables the rank masks
    (:meth:`low_latency_update_mask_buffer`). ``timeout`` (keyword-only, seconds; default the
    communicator's) bounds every wait of every op. Ops are serialised per Buffer (a lock).
    """

    num_sms: int = 20

    def __init__(self, group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, use_fabric: bool = False, explicitly_destroy: bool = False,
                 enable_shrink: bool = False, comm=None, *, timeout: float | None = None) -> None:
        if group is None and comm is None:
            raise ValueError("Either 'group' or 'comm' must be provided.")
        parent, members = _communicator_of(group if group is not None else comm, num_nvl_bytes + num_rdma_bytes)
        if num_nvl_bytes < 0 or num_rdma_bytes < 0:
            raise ZbcclInvalidUsageError(
                f"Buffer: sizes must be >= 0, got num_nvl_bytes={num_nvl_bytes}, num_rdma_bytes={num_rdma_bytes}")
        if num_rdma_bytes % 128:
            raise ZbcclInvalidUsageError(f"Buffer: num_rdma_bytes must be a multiple of 128 (as DeepEP's), got "
                                         f"{num_rdma_bytes}")
        self.group = group if group is not None else comm
        self.rank, self.group_size = members.index(parent.rank), len(members)
        self.num_nvl_bytes, self.num_rdma_bytes = int(num_nvl_bytes), int(num_rdma_bytes)
        self.low_latency_mode, self.explicitly_destroy = bool(low_latency_mode), bool(explicitly_destroy)
        self.enable_shrink = bool(enable_shrink)
        self.comm = parent.new_group(members, timeout=timeout)
        self.comm.role = WHERE_EP  # a rank that leaves an op of it half-way left an EP op (runtime/liveness.py)
        #: The control plane across hosts (ep/wire.py) when the group spans hosts, else None (the op channel's).
        try:
            self.wire = HostWire(self.comm, timeout, self.num_rdma_bytes) if spans_hosts(self.comm) else None
        except ZbcclOutOfMemoryError:  # raised on every rank together: the sub-communicator goes back at once
            self.comm.destroy()
            raise
        self.ex = self.wire if self.wire is not None else Exchange(self.comm, timeout)
        self.runtime = self
        self.seq = 0
        self.layout_memo = None  # (topk_idx, its version, num_tokens_per_expert, its version, data_ptr)
        self._lock = threading.RLock()
        self._handles: dict[int, tuple] = {}
        self._dead_handles: deque = deque()  # weakrefs of handle tensors that died (appended in C)
        self._local: dict[bool, torch.Tensor] = {}
        self._ll = low_latency.LowLatencyState()
        self._mask = torch.zeros(self.group_size, dtype=torch.int32)
        self._scratch: dict[str, torch.Tensor] = {}
        self._device_ep = None  # ep/device.py's view of this Buffer, made at its first op on CUDA tensors
        self._device_memo = None  # the last CUDA get_dispatch_layout's tensors (with versions and addresses)

    def scratch(self, name: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """A private work tensor (contents undefined), kept between ops: fresh pages cost page faults."""
        n = dtype.itemsize
        for d in shape:
            n *= int(d)
        buf = self._scratch.get(name)
        if buf is None or buf.numel() < n:
            buf = self._scratch[name] = torch.empty(max(n, 64), dtype=torch.uint8)
        return buf[:n].view(dtype).view(shape)

    # ------------------------------------------------------------------ lifecycle
    def destroy(self) -> None:
        """Collective: release the Buffer's sub-communicator and blocks (DeepEP: needs explicitly_destroy).

        Without ``explicitly_destroy`` there is no destructor that could run this collective: the
        sub-communicator (one of a job's ~120 comm slots) then lives until ``zbccl.finalize()``.
        """
        assert self.explicitly_destroy, "`explicitly_destroy` flag must be set"
        self._release()

    def _release(self) -> None:
        if self.runtime is None:
            return
        self.runtime = None
        self._local.clear()
        self.layout_memo = None
        self._ll = low_latency.LowLatencyState()
        self.ex.drop_reused()
        if self.wire is not None:
            self.wire.close()
        self.ex = self.wire = None  # the wire's region, aux and held blocks go back to the heap with it
        self.comm.destroy()

    @property
    def bytes_moved(self) -> int:
        """Payload bytes this rank copied from or read in peers' memory in its last op (rows, scales,
        top-k; not the handshake): dispatch ``num_recv * row``, combine the same back."""
        return self.ex.moved if self.ex is not None else 0

    def memory_stats(self) -> dict[str, int]:
        """What this rank's last op held and moved across hosts (all 0 on one host), DeepEP's RDMA buffer's share:
        ``rdma_send_bytes`` the rows it staged for, or summed for, other hosts; ``rdma_recv_bytes`` the rows it
        received from other hosts (forwarding staging, or combine sums read); ``nvl_bytes`` the rows it packed for
        its own host; ``rdma_peak_bytes`` the largest forwarding staging of any op so far. Every block is exact-size
        and freed at the op's end (nothing is reserved: ``num_rdma_bytes`` only sizes
        :meth:`get_local_buffer_tensor`)."""
        if self.wire is None:
            return {"rdma_send_bytes": 0, "rdma_recv_bytes": 0, "nvl_bytes": 0, "rdma_peak_bytes": 0}
        return dict(self.wire.stats)

    def _op(self, name: str) -> contextlib.AbstractContextManager:
        """The op's boundary (:meth:`Exchange.op`: leaving it half-way marks this rank's ABORT line)."""
        ex = self.ex
        return ex.op(name) if ex is not None else contextlib.nullcontext()

    def is_available(self) -> bool:
        return self.runtime is not None

    def _live(self) -> None:
        if self.runtime is None:
            raise ZbcclInvalidUsageError("Buffer: used after destroy(), expected a live Buffer, got a destroyed one")

    # ------------------------------------------------------------------ handles
    def register(self, key: torch.Tensor, extra=None) -> None:
        """Remember that ``key`` (a handle's tensor) came from this Buffer's op number ``seq``."""
        # Forget the handles whose tensor died. Their weakrefs' callback only queued them: a Python callback
        # would run at the tensor's death, where a Ctrl-C is raised and dropped (see heap/releases.py).
        dead = self._dead_handles
        while dead:
            ref = dead.popleft()
            if self._handles.get(ref.k, (None,))[0] is ref:
                del self._handles[ref.k]
        ref = _KeyRef(key, dead.append)
        ref.k = id(key)
        self._handles[ref.k] = (ref, self.seq, extra)

    def lookup(self, key, op: str) -> tuple[int, object]:
        entry = self._handles.get(id(key)) if isinstance(key, torch.Tensor) else None
        if entry is None or entry[0]() is not key:
            raise Fail("handle was not returned by this Buffer's dispatch, expected a handle from this Buffer, "
                       f"got {type(key).__name__} not known to it")
        return entry[1], entry[2]

    def handle_seq(self, handle, op: str) -> int:
        if not isinstance(handle, (tuple, list)) or len(handle) != 6:
            raise Fail(f"handle must be the 6-tuple dispatch returned, got {type(handle).__name__}")
        return self.lookup(handle[3], op)[0]

    # ------------------------------------------------------------------ device tensors (CUDA)
    def _on_device(self, *tensors) -> bool:
        """Whether this op's tensors are CUDA tensors: it then runs on the device heap (``ep/device.py``)."""
        t = next((t for t in tensors if isinstance(t, torch.Tensor)), None)
        return t is not None and t.is_cuda

    def _device(self, op: str, previous_event):
        """The device side of this Buffer (made at its first CUDA op, collectively: the group's device ops), after
        the current stream waited for ``previous_event``."""
        if self.wire is not None:
            raise ZbcclInvalidUsageError(f"{op}: CUDA tensors in a Buffer that spans hosts, expected CPU tensors "
                                         "(EP across hosts runs on the host heaps)")
        if self.enable_shrink:
            raise ZbcclInvalidUsageError(f"{op}: rank masks (enable_shrink) on CUDA tensors, expected a Buffer "
                                         "without enable_shrink (masks are implemented on the CPU path only)")
        if self._device_ep is None:
            from ..ops import route
            from .device import DeviceEP

            comm = self.comm
            transport = comm.device_heap("cuda", op=op).transport
            me = comm.global_rank
            self._device_ep = DeviceEP(
                ops=lambda name: route.lane(comm, "cuda", name),
                empty=lambda shape, dtype: device_heap_empty(comm, "cuda", shape, dtype),
                in_heap=lambda t: transport.offset_of(me, t) >= 0, rank=self.rank, R=self.group_size,
                ranks=tuple(comm.ranks))
        if previous_event is not None and previous_event.event is not None:
            previous_event.current_stream_wait()
        # what the kernels reported since the last check (a peer's refused call, a rank that never arrived, rows
        # past num_worst_tokens) raises here, at the next EP op: no host sync (a snapshot read, none in a capture)
        self._device_ep.ops(op).check()
        return self._device_ep

    # ------------------------------------------------------------------ static API
    @staticmethod
    def is_sm90_compiled() -> bool:
        """True: FP8 (e4m3) inputs and outputs are supported (torch casts on CPU)."""
        return True

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        assert new_num_sms % 2 == 0, "The SM count must be even"
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An event at this point of the current CUDA stream when CUDA is in use, else of the host's work
        (always complete on CPU)."""
        return EventOverlap(DeviceEventHandle() if torch.cuda.is_initialized() else EventHandle())

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """Bytes DeepEP would reserve for low-latency mode (zbccl reserves nothing; see ``Config``)."""
        return get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """DeepEP's recommended dispatch config (any rank count works here; unknown ones get 2-rank values)."""
        return dispatch_config(num_ranks, Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return combine_config(num_ranks, Buffer.num_sms)

    def get_comm_stream(self):
        """None: there is no communication stream on CPU (on CUDA the ops run on the current stream)."""
        return None

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: torch.Size | None = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> torch.Tensor:
        """A heap block of ``num_nvl_bytes`` (or ``num_rdma_bytes``), allocated on first use, as ``dtype``."""
        self._live()
        nbytes = self.num_rdma_bytes if use_rdma_buffer else self.num_nvl_bytes
        raw = self._local.get(use_rdma_buffer)
        if raw is None:
            raw = self._local[use_rdma_buffer] = heap_empty(self.comm, (nbytes,), torch.uint8)
        t = raw[: nbytes - nbytes % dtype.itemsize].view(dtype)[offset:]
        if size is None:
            return t
        assert t.numel() >= size.numel()
        return t[: size.numel()].view(size)

    # ------------------------------------------------------------------ normal mode
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event: EventOverlap | None = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """Local (not collective): the routing layout of ``topk_idx``.

        Arguments: ``topk_idx`` ``[num_tokens, num_topk]`` ``topk_idx_t`` (int64; int32 accepted), ``-1``
        meaning no expert; ``num_experts`` a multiple of the group size.
        Returns ``(num_tokens_per_rank [num_ranks] torch.int, num_tokens_per_rdma_rank [num_hosts] torch.int
        (tokens bound for any rank of each host; None on one host, as DeepEP's intranode), num_tokens_per_expert
        [num_experts] torch.int, is_token_in_rank [num_tokens, num_ranks] torch.bool, event)``; a token counts
        once per rank (and host) however many of its experts live there.
        """
        R = self.group_size
        error, got = _stream_error(previous_event, async_finish, allocate_on_comm_stream), None
        if error is None and self._on_device(topk_idx):
            from . import device

            if not isinstance(num_experts, int) or num_experts <= 0 or num_experts % R:
                raise ZbcclInvalidUsageError(f"get_dispatch_layout: num_experts must be a positive multiple of the "
                                             f"{R} ranks, got {num_experts!r}")
            self._device("get_dispatch_layout", previous_event)
            per_rank, per_expert, in_rank = device.layout(topk_idx, num_experts, R)
            # dispatch skips the checks that sync the device when handed these very tensors, unchanged
            self._device_memo = tuple((t, t._version, t.data_ptr()) for t in (topk_idx, per_rank, per_expert, in_rank))
            return per_rank, None, per_expert, in_rank, _event(async_finish, device=True)
        if error is None:
            try:
                normal._tensor(topk_idx, "topk_idx", 2, (torch.int64, torch.int32))
                if not isinstance(num_experts, int) or num_experts <= 0 or num_experts % R:
                    raise Fail(f"num_experts must be a positive multiple of the {R} ranks, got {num_experts!r}")
                got = fast.layout(self.ex.caps, topk_idx, num_experts, R)
                if got is None:  # a bad entry: the checks say which
                    normal._check_topk(topk_idx, torch.zeros(topk_idx.shape), topk_idx.size(0), num_experts,
                                       self.ex.caps)
            except Fail as exc:
                error = str(exc)
        if error is not None:
            raise ZbcclInvalidUsageError(f"get_dispatch_layout: {error}")
        per_rank, per_expert, in_rank = got
        per_host = None
        if self.wire is not None:  # DeepEP's num_tokens_per_rdma_rank: tokens bound for any rank of each host
            per_host = torch.stack([in_rank[:, r].any(1).sum(dtype=torch.int32) for r in self.wire.hosts])
        # dispatch skips re-checking topk_idx against num_tokens_per_expert when both are these, unchanged.
        self.layout_memo = (topk_idx, topk_idx._version, per_expert, per_expert._version, topk_idx.data_ptr())
        return per_rank, per_host, per_expert, in_rank, _event(async_finish)

    def dispatch(self, x, handle: tuple | None = None, num_tokens_per_rank: torch.Tensor | None = None,
                 num_tokens_per_rdma_rank: torch.Tensor | None = None, is_token_in_rank: torch.Tensor | None = None,
                 num_tokens_per_expert: torch.Tensor | None = None, topk_idx: torch.Tensor | None = None,
                 topk_weights: torch.Tensor | None = None, expert_alignment: int = 1, num_worst_tokens: int = 0,
                 config: Config | None = None, previous_event: EventOverlap | None = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False, *, int8: bool = False):
        """Collective: send each token to every rank that holds one of its experts.

        Arguments:
            x: ``[num_tokens, hidden]`` ``torch.bfloat16`` (float16/float32 pass through), or the pair
                ``(x [num_tokens, hidden] torch.float8_e4m3fn, scales [num_tokens, hidden // 128] torch.float)``
                (int32 packed scales and column-major scales accepted).
            handle: a previous dispatch's handle: re-send the same routing (no top-k arguments).
            num_tokens_per_rank ``[num_ranks]`` torch.int, is_token_in_rank ``[num_tokens, num_ranks]``
                torch.bool, num_tokens_per_expert ``[num_experts]`` torch.int: from
                :meth:`get_dispatch_layout` (required without ``handle``). They are checked against
                ``topk_idx``, except when they are that call's very tensors for this very ``topk_idx``, unchanged
                since by torch's version counter: a write that bypasses it (through ``.numpy()`` or ``.data``)
                goes unseen, and the outputs then disagree with each other (no peer memory is at risk: every
                receiver maps expert ids outside its range to -1).
            topk_idx ``[num_tokens, num_topk]`` topk_idx_t (``-1``: none) and topk_weights
                ``[num_tokens, num_topk]`` torch.float: optional, both or neither.
            expert_alignment: the per-expert counts in the returned list are rounded up to it.
            num_worst_tokens: if > 0, every output has exactly this many rows (only the first
                ``num_recv`` valid; ``recv_topk_idx`` is -1 below them) and the list is ``[]``. On CUDA
                tensors the dispatch then never syncs the host and can be captured in a CUDA graph (as
                DeepEP's): the layout tensors are not checked against ``topk_idx``, and a rank's wrong call
                is reported to its peers at their next check (``docs/cuda-ops.md``).
            config: only ``num_sms`` matters (channels of ``channel_prefix_matrix``).
            int8 (keyword-only, zbccl extension): send a bf16/fp16/fp32 ``x`` as per-128-channel int8
                plus float scales (about half the bytes of bf16); ``recv_x`` comes back dequantised.
        Returns ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle,
        event)``: ``recv_x`` has the kind of ``x`` (fp8 scales row-major) and exactly ``num_recv`` rows,
        ordered by source rank, then source token; ``recv_topk_idx`` ``[num_recv, num_topk]`` holds
        local expert ids (``-1``: not on this rank) and ``recv_topk_weights`` 0.0 there. A cached
        dispatch returns ``(recv_x, None, None, None, None, event)``. ``recv_x`` is a heap tensor.
        Blocks the host until the rows arrived and no peer reads ``x`` any more.
        """
        self._live()
        cfg = config if config is not None else self.get_dispatch_config(self.group_size)
        a = dict(x=x, handle=handle, num_tokens_per_rank=num_tokens_per_rank, is_token_in_rank=is_token_in_rank,
                 num_tokens_per_expert=num_tokens_per_expert, topk_idx=topk_idx, topk_weights=topk_weights,
                 expert_alignment=int(expert_alignment), num_worst_tokens=int(num_worst_tokens), config=cfg,
                 int8=bool(int8), error=_stream_error(previous_event, async_finish, allocate_on_comm_stream),
                 num_tokens_per_rdma_rank=num_tokens_per_rdma_rank)
        if self._on_device(x[0] if isinstance(x, tuple) else x):
            from . import device

            with self._lock, self._op("dispatch"):
                self.seq += 1
                d = self._device("dispatch", previous_event)
                known = self._device_memo is not None and all(
                    t is m and t._version == v and t.data_ptr() == p for t, (m, v, p) in zip(
                        (topk_idx, num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank), self._device_memo))
                recv_x, idx, w, lst, h = device.dispatch(
                    d, x, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_rank, num_tokens_per_expert,
                    handle, expert_alignment=a["expert_alignment"], num_worst_tokens=a["num_worst_tokens"],
                    num_channels=max(cfg.num_sms // 2, 1), known=known,
                    error=a["error"] or ("int8 transfers are CPU-only, expected int8=False" if int8 else None))
            return recv_x, idx, w, lst, h, _event(async_finish, device=True)
        with self._lock, self._op("dispatch"):
            self.seq += 1
            recv_x, idx, w, lst, h = (internode if self.wire is not None else normal).dispatch(self, a)
        return recv_x, idx, w, lst, h, _event(async_finish)

    def combine(self, x: torch.Tensor, handle: tuple, topk_weights: torch.Tensor | None = None, bias=None,
                config: Config | None = None, previous_event: EventOverlap | None = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False):
        """Collective: return each token the (unweighted) sum of the rows the ranks send back.

        Arguments:
            x: ``[num_recv, hidden]`` ``torch.bfloat16`` (float16/float32 accepted), row-aligned with the
                dispatch output; read in place from peers when it is a heap tensor, else staged.
            handle: the handle this Buffer's (non-cached) dispatch returned.
            topk_weights: optional ``[num_recv, num_topk]`` ``torch.float``, summed the same way.
            bias: 0, 1 or 2 ``[num_tokens, hidden]`` tensors of ``x``'s dtype, added once.
        Returns ``(combined_x [num_tokens, hidden] (x's dtype), combined_topk_weights [num_tokens, num_topk]
        torch.float or None, event)``; sums are taken in fp32, over ranks in order.
        """
        self._live()
        error = _stream_error(previous_event, async_finish, allocate_on_comm_stream)
        if self._on_device(x):
            from . import device

            biases = () if bias is None else (bias,) if isinstance(bias, torch.Tensor) else tuple(bias)
            with self._lock, self._op("combine"):
                self.seq += 1
                d = self._device("combine", previous_event)
                out, w = device.combine(d, x, handle, topk_weights, biases, error)
            return out, w, _event(async_finish, device=True)
        with self._lock, self._op("combine"):
            self.seq += 1
            out, w = (internode_combine if self.wire is not None else normal).combine(self, x, handle, topk_weights, bias, error)
        return out, w, _event(async_finish)

    # ------------------------------------------------------------------ low-latency mode
    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Collective: a barrier (there are no signalling areas to zero; kept for DeepEP code)."""
        self._live()
        with self._lock, self._op("clean_low_latency_buffer"):
            self.ex.sync("clean_low_latency_buffer", OP_CLEAN, self.seq, PHASE_CLEAN)

    def get_next_low_latency_combine_buffer(self, handle: tuple) -> torch.Tensor:
        """The heap tensor ``[num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank, hidden]``
        torch.bfloat16 that the next ``low_latency_combine(..., zero_copy=True)`` reads in place."""
        self._live()
        src_info, _, tmax, hidden, num_experts = handle
        R = self.group_size
        if self._on_device(src_info):
            return device_heap_empty(self.comm, "cuda", (num_experts // R, R * tmax, hidden), torch.bfloat16)
        return self._ll.next_combine_buffer(self.comm, num_experts // R, R * tmax, hidden)

    def _hook(self, recv: Callable[[], None]) -> Callable[[], None]:
        state = {"done": False}

        def hook() -> None:
            if state["done"]:
                return
            state["done"] = True
            with self._lock, self._op("low_latency_dispatch (its receive hook)"):
                recv()

        return hook

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                             dispatch_wait_recv_cost_stats: torch.Tensor | None = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False):
        """Collective: send each token to each of its selected experts (once per expert).

        Arguments: ``x`` ``[num_tokens, hidden]`` torch.bfloat16 (``num_tokens <=
        num_max_dispatch_tokens_per_rank``, hidden a multiple of 128, of 512 with ``use_ue8m0``);
        ``topk_idx`` ``[num_tokens, num_topk]`` topk_idx_t (``-1``: none);
        ``cumulative_local_expert_recv_stats`` ``[num_local_experts]`` torch.int (+= received counts);
        ``dispatch_wait_recv_cost_stats`` ``[num_ranks]`` torch.int64 (+= ns waited in the handshake).
        ``use_fp8``: e4m3 with per-128-channel scales (``round_scale``: powers of two; ``use_ue8m0``: their
        exponent bytes packed four per int32).
        Returns ``(recv_x, recv_count, handle, event, hook)``: ``recv_x`` ``[num_local_experts, num_ranks *
        num_max_dispatch_tokens_per_rank, hidden]`` bf16, or with fp8 ``(e4m3 tensor, scales [..., hidden // 128]
        float32 or [..., hidden // 512] int32, column-major in the last two dims)``; only the first
        ``recv_count [num_local_experts] torch.int`` rows of each expert are valid; ``handle`` is
        ``(src_info [num_local_experts, N] torch.int, layout_range [num_local_experts, num_ranks] torch.int64,
        num_max_dispatch_tokens_per_rank, hidden, num_experts)``. With ``return_recv_hook`` the call only
        publishes (``x`` may be reused at once) and ``hook()`` (collective) receives; else ``hook`` is None.
        """
        self._live()
        error = None
        if async_finish and return_recv_hook:
            error = "async_finish and return_recv_hook exclude each other, expected at most one, got both"
        elif use_ue8m0 and not round_scale:
            error = "use_ue8m0 needs round_scale, expected round_scale=True, got False"
        flags = ((low_latency.FLAG_FP8 if use_fp8 else 0) | (low_latency.FLAG_ROUND if round_scale else 0)
                 | (low_latency.FLAG_UE8M0 if use_ue8m0 else 0) | (low_latency.FLAG_HOOK if return_recv_hook else 0))
        if self._on_device(x):
            return self._ll_dispatch_device(x, topk_idx, int(num_max_dispatch_tokens_per_rank), int(num_experts),
                                            cumulative_local_expert_recv_stats, use_fp8, round_scale, use_ue8m0,
                                            async_finish, return_recv_hook, error)
        with self._lock, self._op("low_latency_dispatch"):
            self.seq += 1
            out, plan, recv = (internode_ll if self.wire is not None else low_latency).dispatch(
                self, x, topk_idx, int(num_max_dispatch_tokens_per_rank), int(num_experts),
                cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, flags, error)
            self._ll.idx ^= 1
            self.register(out["src_info"], plan)
            hook = self._hook(recv) if return_recv_hook else None
            if hook is None:
                recv()
        handle = (out["src_info"], out["layout"], int(num_max_dispatch_tokens_per_rank), out["x"].size(2),
                  int(num_experts))
        recv_x = (out["x"], out["scales"]) if use_fp8 else out["x"]
        return recv_x, out["count"], handle, _event(async_finish, (x, topk_idx, out["x"])), hook

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: tuple,
                            use_logfmt: bool = False, zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: torch.Tensor | None = None,
                            combine_wait_recv_cost_stats: torch.Tensor | None = None):
        """Collective: ``combined_x[t] = sum_k topk_weights[t, k] * expert_output(t, k)``, in fp32.

        Arguments: ``x`` ``[num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank, hidden]``
        torch.bfloat16 in the dispatch layout (read in place from peers when it is a heap tensor; with
        ``zero_copy`` the data is taken from :meth:`get_next_low_latency_combine_buffer` instead);
        ``topk_idx``/``topk_weights`` ``[num_tokens, num_topk]``: this rank's routing, as dispatched;
        ``handle``: from this Buffer's ``low_latency_dispatch``; ``out``: optional ``[num_tokens, hidden]``
        bf16 result tensor. ``use_logfmt``: every expert row is summed after DeepEP's LogFMT-10 cast
        (per 128 channels, lossy as on a GPU; the bytes moved stay bf16's). Returns ``(combined_x [num_tokens, hidden]
        torch.bfloat16, event, hook)``; with ``return_recv_hook``, ``hook()`` (collective) receives, and
        ``x`` must stay unchanged until it returned.
        """
        self._live()
        error = None
        if async_finish and return_recv_hook:
            error = "async_finish and return_recv_hook exclude each other, expected at most one, got both"
        elif zero_copy and use_logfmt:
            error = "zero_copy and use_logfmt exclude each other, expected at most one, got both"
        flags = ((low_latency.FLAG_HOOK if return_recv_hook else 0) | (low_latency.FLAG_FP8 if zero_copy else 0)
                 | (low_latency.FLAG_LOGFMT if use_logfmt else 0))
        if self._on_device(x):
            if error is None and use_logfmt:
                error = "use_logfmt on CUDA tensors, expected use_logfmt=False (LogFMT is implemented on the CPU path)"
            if error is not None:
                raise ZbcclInvalidUsageError(f"low_latency_combine: {error}")
            from . import device

            with self._lock, self._op("low_latency_combine"):
                self.seq += 1
                combined = device.ll_combine(self._device("low_latency_combine", None), x, topk_idx, topk_weights,
                                             handle, out)
            return (combined, _event(async_finish, (x, topk_idx, topk_weights, combined), device=True),
                    (lambda: None) if return_recv_hook else None)
        with self._lock, self._op("low_latency_combine"):
            self.seq += 1
            combined, recv = (internode_ll if self.wire is not None else low_latency).combine(self, x, topk_idx, topk_weights, handle, bool(zero_copy), out, flags,
                                                 error)
            self._ll.idx ^= 1
            hook = self._hook(recv) if return_recv_hook else None
            if hook is None:
                recv()
        return combined, _event(async_finish, (x, topk_idx, topk_weights, combined)), hook

    def _ll_dispatch_device(self, x, topk_idx, tmax: int, E: int, stats, use_fp8: bool, round_scale: bool,
                            use_ue8m0: bool, async_finish: bool, return_recv_hook: bool, error: str | None):
        """:meth:`low_latency_dispatch` of CUDA tensors (``ep/device.py``): enqueued on the current stream, no host
        sync; the receive happens in stream order, so the hook (with ``return_recv_hook``) has nothing left to do."""
        from . import device

        op = "low_latency_dispatch"
        R = self.group_size
        if error is None:
            if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype != torch.bfloat16:
                error = "x must be a [num_tokens, hidden] bfloat16 tensor"
            elif not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2 or topk_idx.size(0) != x.size(0):
                error = f"topk_idx must be [{x.size(0)}, num_topk], got {getattr(topk_idx, 'shape', topk_idx)}"
            elif x.size(0) > tmax or E <= 0 or E % R or x.size(1) % (512 if use_ue8m0 else 128):
                error = (f"expected num_tokens <= num_max_dispatch_tokens_per_rank ({tmax}), num_experts a positive "
                         f"multiple of {R} and hidden a multiple of {512 if use_ue8m0 else 128}, got "
                         f"{x.size(0)} tokens, {E} experts, hidden {x.size(1)}")
        with self._lock, self._op(op):
            self.seq += 1
            d = self._device(op, None)
            if error is not None:
                d.fail(op, error, device.LL_LAUNCHES)
            recv_x, count, src_info, layout_range = device.ll_dispatch(d, x, topk_idx, tmax, E, use_fp8=use_fp8,
                                                                       round_scale=round_scale, use_ue8m0=use_ue8m0)
            if stats is not None:
                stats += count.to(stats.dtype)
        handle = (src_info, layout_range, tmax, x.size(1), E)
        return (recv_x, count, handle, _event(async_finish, (x, topk_idx), device=True),
                (lambda: None) if return_recv_hook else None)

    def _shrink(self, op: str) -> None:
        if not self.enable_shrink:
            raise ZbcclInvalidUsageError(f"{op}: shrink mode must be enabled, expected Buffer(..., enable_shrink=True), "
                                         "got enable_shrink=False")

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Local (needs ``enable_shrink``): as in DeepEP, this rank then receives nothing from a masked
        rank in ``low_latency_dispatch`` and its ``low_latency_combine`` drops the top-k slots of experts
        on it. Unlike DeepEP, a masked rank must still call every op (the group never shrinks; a dead
        rank raises ``ZbcclRemoteError`` on the others instead of being masked by timeout)."""
        self._shrink("low_latency_update_mask_buffer")
        if not 0 <= int(rank_to_mask) < self.group_size:
            raise ZbcclInvalidUsageError(f"low_latency_update_mask_buffer: rank out of range, expected [0, "
                                         f"{self.group_size}), got {rank_to_mask}")
        self._mask[int(rank_to_mask)] = int(bool(mask))

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Write the mask ``[num_ranks]`` torch.int (1: masked) into ``mask_status``."""
        self._shrink("low_latency_query_mask_buffer")
        mask_status.copy_(self._mask)

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmask every rank."""
        self._shrink("low_latency_clean_mask_buffer")
        self._mask.zero_()
