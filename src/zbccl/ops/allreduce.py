"""all_reduce: in place, over every rank's heap tensor.

Heap placement: the tensor must be in the heap (peers read it); otherwise it
is staged through a heap block (counted in ``staged_bytes``).

Algorithms (chosen by the tuner, identical on every rank, checked in the
handshake):

* ``oneshot`` (the last to arrive reduces for all): every rank posts its
  header and ``ARRIVE``; the rank that sees every peer arrived claims the op
  in the group's election word (a CAS: exactly one rank), reduces all N
  inputs, in rank order, into its scratch, copies the result into every
  rank's tensor and releases the word; the others only wait for the release.
  The late rank of a step never waits for an early one (which may be asleep
  by then). Reads N·W and writes N·W, all by one rank: for small messages
  whose ranks arrive apart, as in a model step.
* ``twoshot`` (reduce-scatter, then push): the tensor is cut into chunks (the
  tuner's chunk size). For each chunk, rank r reduces slice r from all N
  inputs, in rank order, into slice r of its own tensor, then writes it into
  slice r of every peer's tensor. Only rank r reads or writes slice r of any
  tensor during the op, and it reads them all before it writes any, so no step
  waits for another rank: ``ARRIVE``, the work, ``DONE`` (every push into this
  rank's tensor landed). Its own slice stays in lines only its core holds
  (cached for the next read); the pushes use the store kind group rank 0
  measured to be cheaper. No scratch at all. The default at every size.

Python checks the arguments, picks the algorithm, stages a tensor that is
not a contiguous heap tensor, and runs the whole protocol in one native call
(``native/csrc/core/chan_ops.c``). twoshot pushes with cached or streaming stores,
chosen per size by group rank 0, which measures both (``chan_ops.c``, "Store
kind"; the protocol is the same either way). World size 1: the null backend.

Bitwise identity across ranks: oneshot reduces once and copies the result;
twoshot reduces each slice once and copies it. Both reduce in rank order. bf16/fp16 accumulate in fp32
and round once.

A rank that leaves an op half-way (timeout, Ctrl-C, a lost peer) marks its
ABORT line and returns only once no peer can still push into its tensor; a
peer checks ABORT after its own ARRIVE before it pushes (``chan.c``
``leave_op``). A timed-out rank refuses later ops (the group is out of step).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.autograd.profiler as _profiler

from ..errors import ZbcclInvalidUsageError
from ..native.abi import OP_ALL_REDUCE
from ..runtime import registry
from ..runtime.communicator import Communicator
from ..runtime.registry import collective
from . import hosts, null, route
from .args import tensor_error
from .channel import OpChannel, channel_of
from .dtypes import SUM, dtype_code, reduce_op_code
from .entry import run_op
from .operands import Operand
from .route import device_of
from .tuner import choose

__all__ = ["all_reduce", "bind_all_reduce"]

_OP = "all_reduce"


def all_reduce(tensor: torch.Tensor, op="sum", *, comm: Communicator | None = None,
               timeout: float | None = None) -> torch.Tensor:
    """Collective: reduce ``tensor`` over all ranks, in place; returns ``tensor``.

    ``tensor``: any shape, a CPU tensor, or a CUDA heap tensor (enqueued on the current stream, see
    :mod:`.route`; the host does not wait). ``op``: ``"sum"``, ``"avg"``, ``"max"``, ``"min"``,
    ``"product"`` or a ``torch.distributed.ReduceOp``. dtypes: float32/64, bfloat16, float16 and
    integers (avg: floats only). ``timeout``: seconds this op may wait (default: the
    communicator's). Blocks the host until every rank finished reading this rank's tensor.
    Every rank gets bitwise identical results.
    """
    # The native hot entry: a cache, in front of the op's one door (_all_reduce), of the plans that door
    # made for heap tensors at the default timeout; it returns -1 for anything it does not hold.
    c = registry._default if comm is None else comm
    if op == "sum" and timeout is None and type(tensor) is torch.Tensor:
        ch = getattr(c, "op_state", None)
        if ch is not None and ch.hot is not None and ch.run_hot(ch.hot, tensor, op=_OP):
            return tensor
        return _all_reduce(tensor, comm=comm)  # no keywords for collective() to pass on
    return _all_reduce(tensor, op, comm=comm, timeout=timeout)


def bind_all_reduce(comm: Communicator) -> Callable[[torch.Tensor], torch.Tensor]:
    """``f(tensor) -> tensor``: :func:`all_reduce` (sum, the communicator's timeout) of ``comm``, bound once.

    For an engine that calls all_reduce on one communicator every layer (vLLM's communicator): the
    native hot entry first, found without the default-communicator and op lookups :func:`all_reduce`
    makes per call (they cost microseconds in a model step, where the layer's matmuls left the Python
    entry cold); anything it does not serve takes :func:`all_reduce`'s one door. Collective, blocking,
    as :func:`all_reduce`. Binding is local (it creates this rank's op channel, which needs the native core
    at world size > 1), not collective."""
    if comm.world_size == 1 or not comm._single_host:  # no op channel: the door (across hosts: ops/hosts)
        return lambda tensor: all_reduce(tensor, comm=comm)
    ch = channel_of(comm)

    def bound(tensor: torch.Tensor) -> torch.Tensor:
        hot = ch.hot  # read per call: a profiler (integrations/vllm/probe.py) may wrap it
        if hot is not None and type(tensor) is torch.Tensor and ch.run_hot(hot, tensor, op=_OP):
            return tensor
        return _all_reduce(tensor, comm=comm)

    return bound


@collective("all_reduce")
def _all_reduce(tensor: torch.Tensor, op="sum", *, comm: Communicator | None = None,
                timeout: float | None = None) -> torch.Tensor:
    """:func:`all_reduce`'s one door, with the op lock held: a repeated sum of a tensor it made a plan for
    (same heap address, size and dtype, contiguous: every check passed then) goes straight to the plan;
    anything else gets every check, then the op."""
    ch = comm.op_state
    if ch is not None and ch.plain and op == "sum" and timeout is None and not _profiler._is_profiler_enabled:
        try:
            plan = ch.choices.get((_OP, tensor.data_ptr(), tensor.numel(), tensor.dtype))
        except (AttributeError, RuntimeError):  # not a tensor; a tensor without storage: the checks say so
            plan = None
        if plan is not None and tensor.is_contiguous():
            ch.submit(plan, op=_OP)
            if ch.hot is not None:  # the hot entry did not serve it: its table lost the tensor
                ch.hot_register(tensor, plan)
            return tensor
    error = tensor_error(tensor, "tensor", op=_OP, written=True)
    if error is not None and (device := device_of(_OP, tensor)) is not None:  # a CUDA tensor: the device ops
        return route.all_reduce(comm, device, tensor, op, timeout)
    dt = red = 0
    if error is None:
        try:
            dt = dtype_code(tensor.dtype, op=_OP)
            red = reduce_op_code(op, tensor.dtype, op=_OP)
        except ZbcclInvalidUsageError as exc:
            error = str(exc)
    if not comm._single_host:  # a communicator across hosts
        return hosts.all_reduce(comm, tensor, dt, red, error, timeout)
    run_op(comm, OP_ALL_REDUCE, error, _run, null.all_reduce, (tensor, dt, red), op=_OP, timeout=timeout, t=tensor)
    return tensor


def _run(ch: OpChannel, tensor: torch.Tensor, dt: int, red: int) -> None:
    contiguous = tensor.is_contiguous()
    key = (OP_ALL_REDUCE, tensor.data_ptr(), tensor.numel(), dt, red)
    plan = ch.choices.get(key) if contiguous else None
    if plan is None:
        plan = _plan(ch, tensor, dt, red, key) if contiguous else None
        if plan is None:
            _staged(ch, tensor, dt, red)
            return
    if red == SUM and ch.plain:  # the plan holds the default timeout: the door's plan cache and the hot entry
        ch.choices[(_OP, key[1], key[2], tensor.dtype)] = plan
        ch.hot_register(tensor, plan)
    ch.submit(plan, op=_OP)


def _args(ch: OpChannel, tensor: torch.Tensor) -> tuple[int, int, int, int, int]:
    count, itemsize = tensor.numel(), tensor.element_size()
    algo, chunk = choose(ch, OP_ALL_REDUCE, tensor.dtype, count * itemsize)
    return count, itemsize, algo, max(1, chunk // itemsize), count * itemsize


def _plan(ch: OpChannel, tensor: torch.Tensor, dt: int, red: int, key: tuple) -> tuple | None:
    """The prefilled call for a contiguous heap tensor (zero-copy), or None."""
    count, itemsize, algo, chunk_elems, nbytes = _args(ch, tensor)
    off = ch.offset_of(tensor)
    if off < 0:
        return None
    addr = tensor.data_ptr()
    return ch.plan(key, op=OP_ALL_REDUCE, dtype=dt, redop=red, in_numel=count, out_numel=count, in_off=off, out_off=-1,
                   algo=algo, aux=chunk_elems, in_addr=addr, out_addr=addr, itemsize=itemsize)


def _staged(ch: OpChannel, tensor: torch.Tensor, dt: int, red: int) -> None:
    """A tensor outside the heap, non-contiguous or empty: through a heap block (Operand)."""
    count, itemsize, algo, chunk_elems, _ = _args(ch, tensor)
    operand = Operand(ch, tensor, op=_OP, role="tensor", read=True, write=True)
    try:
        if operand.error is not None:
            ch.fail(OP_ALL_REDUCE, operand.error, operand.kind, op=_OP)
        ch.run(_OP, op=OP_ALL_REDUCE, dtype=dt, redop=red, in_numel=count, out_numel=count, in_off=operand.offset,
               out_off=-1, algo=algo, aux=chunk_elems, in_addr=operand.addr, out_addr=operand.addr, itemsize=itemsize)
    finally:
        operand.finish()
