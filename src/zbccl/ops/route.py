"""Device routing: the public collectives run device tensors on the communicator's device ops.

CPU tensors take the op channel (the native protocol) exactly as before. An op reaches this module
only from its local checks, where they found a tensor that is not on the CPU (``args.tensor_error``),
so the CPU path pays nothing for it: no device test, no lookup.

A CUDA collective goes to ``comm.device_ops("cuda")`` (``ops/device.py`` ``DeviceOps``: Triton kernels
over the CUDA heap's pointer tables), made on first use over the runtime's CUDA heap
(``ctx.device_heaps["cuda"]``). Synchronisation is the kernels' (each rank publishes its arguments in
its signal-pad row, signals, and spins, bounded, on its peers' rows, in device memory; epochs live in
device memory): this module only orders the op on a stream and never waits on the host.

Ordering (the lane): every rank must run a communicator's ops in the same order, and the device runs
work of different streams in any order. So an op enqueued on another stream than this
communicator's previous device op first makes its stream wait for that one (``wait_stream``, only when
the stream changes: nothing on the common path). Inside a CUDA graph capture the lane moves to the
capturing stream without a cross-stream wait (a capture may not wait on uncaptured work; torch's
``cuda.graph`` synchronises the device before it captures).

Growth needs nothing here: a peer's heap grows in place (its range is reserved at the maximum), and its
``grow`` returns only once every local rank has mapped the new chunks (the cuda transport's handshake), so
no offset a kernel receives lies in memory this rank has not mapped, eager or captured.

Graph capture: nothing here reads device memory or allocates. The device ops (and their pointer
tables) must exist before a capture: making them inside one raises, naming the op and how to warm up.
Addresses are fixed at capture (heap tensors never move), and the kernels exchange offsets on the
device at each replay.

World size 1 needs no device ops (nor a device heap): the null backend's copies, on the current stream.

Argument errors: the device ops check every operand (device, layout, heap placement, sizes) and, when
only this rank's call is wrong, still run the handshake as an ERROR launch, so that every peer raises
too instead of waiting; then this rank raises. A per-op ``timeout=`` is refused here, on this rank
(the kernels' waits are bounded by the communicator's timeout; a peer that passed none waits that long
and names this rank).
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import ZbcclInvalidUsageError
from ..runtime import registry
from . import null

__all__ = ["device_of", "lane", "make_device_ops", "capturing", "all_reduce", "all_gather", "all_gather_v",
           "reduce_scatter", "reduce_scatter_v", "all_to_all", "broadcast", "barrier"]


def device_of(op: str, *tensors: Any) -> str | None:
    """``"cuda"`` when an operand is a CUDA tensor: the device ops run the op, and their checks report any
    other operand's device (or layout) on every rank (an ERROR launch the peers' kernels see). None
    otherwise: the CPU path's checks stand, and their error fails the op on every rank through the op
    channel (an operand on another device, not a tensor, ...)."""
    for t in tensors:
        if isinstance(t, torch.Tensor):
            if t.is_cuda:
                return "cuda"
            if _FAKE_DEVICES and t.device.type in _FAKE_DEVICES:
                return t.device.type
    return None


#: Device types besides "cuda" that tests register device ops for (see tests/unit/test_routing.py).
_FAKE_DEVICES: set[str] = set()


def capturing(device: str) -> bool:
    """Whether the current stream of ``device`` is capturing a CUDA graph."""
    return device == "cuda" and torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def make_device_ops(comm, device: str, op: str = "device_ops"):
    """The factory behind ``Communicator.device_ops``: a ``DeviceOps`` over the runtime's heap on ``device``
    (``comm.device_heap``: its error says how to ask for one at init)."""
    if capturing(device):
        raise ZbcclInvalidUsageError(
            f"{op}: first {device} collective of this communicator inside a CUDA graph capture, expected "
            f"its device ops made before the capture (run each op once eagerly, or call "
            f"comm.device_ops({device!r}), before capturing), got a capture in progress")
    factory = _factories.get(device)
    if factory is not None:
        return factory(comm)
    transport = comm.device_heap(device, op=op).transport
    from .device import DeviceOps  # triton is imported by the kernels only when they run

    # collective: each rank zeroes its kernel slot of this communicator, then a host barrier of the group
    return DeviceOps(comm.rank, comm.ranks, transport, slot=comm.slot, timeout_s=comm.timeout, barrier=comm.barrier)


#: Device-ops factories by device type, registered by tests (a fake device), consulted before the heap.
_factories: dict[str, Any] = {}

registry.set_device_ops_factory(make_device_ops)


class _Lane:
    """The stream of a communicator's last op on one device (see "Ordering" above)."""

    __slots__ = ("stream", "key")

    def __init__(self) -> None:
        self.stream: Any = None
        self.key: tuple[int, int] | None = None


_LANE = "cuda/lane"  # its key in comm.device_state


def lane(comm, device: str, op: str):
    """The communicator's device ops, after ordering the current stream behind its previous device op."""
    ops = comm.device_state.get(device)
    if ops is None:
        ops = comm.device_ops(device, op=op)
    if device != "cuda":
        return ops
    ln = comm.device_state.get(_LANE)
    if ln is None:
        ln = comm.device_state[_LANE] = _Lane()
    key = _stream_key()
    if key != ln.key:  # the stream changed (a torch Stream object costs microseconds: made only then)
        cur = torch.cuda.current_stream()
        if ln.stream is not None and not torch.cuda.is_current_stream_capturing():
            cur.wait_stream(ln.stream)
        ln.stream, ln.key = cur, key
    return ops


def _stream_key() -> tuple[int, int]:
    """The current CUDA stream, as ``(device, handle)``: two streams are the same exactly when these are."""
    dev = torch._C._cuda_getDevice()
    return dev, torch._C._cuda_getCurrentRawStream(dev)


def _timeout(op: str, timeout) -> None:
    """Refuse a per-op timeout (callers on the hot path test ``timeout is not None`` first)."""
    if timeout is not None:
        raise ZbcclInvalidUsageError(
            f"{op}: a per-op timeout is not supported for device tensors (the kernels' bounded waits use the "
            f"communicator's timeout, set at init), expected timeout=None, got {timeout!r}")


def all_reduce(comm, device: str, tensor: torch.Tensor, op, timeout) -> torch.Tensor:
    if timeout is not None:
        _timeout("all_reduce", timeout)
    if comm.world_size > 1:
        lane(comm, device, "all_reduce").all_reduce(tensor, op)
    return tensor


def _gather_like(comm, device: str, op: str, output, input, timeout, *args, **kwargs) -> torch.Tensor:
    """The ops whose one-rank form is a copy of ``input`` into ``output``: that copy at world size 1, else
    the device ops' ``op(output, input, *args, **kwargs)``."""
    if timeout is not None:
        _timeout(op, timeout)
    if comm.world_size == 1:
        null.copy_into(output, input)
    else:
        getattr(lane(comm, device, op), op)(output, input, *args, **kwargs)
    return output


def all_gather(comm, device: str, output: torch.Tensor, input: torch.Tensor, dim: int, timeout) -> torch.Tensor:
    return _gather_like(comm, device, "all_gather", output, input, timeout, dim=dim)


def all_gather_v(comm, device: str, output, input, sizes, dim: int, timeout) -> torch.Tensor:
    return _gather_like(comm, device, "all_gather_v", output, input, timeout, sizes, dim=dim)


def reduce_scatter(comm, device: str, output, input, op, dim: int, timeout) -> torch.Tensor:
    return _gather_like(comm, device, "reduce_scatter", output, input, timeout, op, dim=dim)


def reduce_scatter_v(comm, device: str, output, input, sizes, op, dim: int, timeout) -> torch.Tensor:
    return _gather_like(comm, device, "reduce_scatter_v", output, input, timeout, sizes, op, dim=dim)


def all_to_all(comm, device: str, output, input, out_splits, in_splits, timeout) -> torch.Tensor:
    _timeout("all_to_all", timeout)
    if comm.world_size == 1:
        null.copy_into(output, input)
        return output
    ops = lane(comm, device, "all_to_all")
    if out_splits is None and in_splits is None:
        ops.all_to_all(output, input)
    else:
        W = comm.world_size
        outs = out_splits if out_splits is not None else [output.shape[0] // W] * W
        ins = in_splits if in_splits is not None else [input.shape[0] // W] * W
        ops.all_to_all_v(output, input, outs, ins)
    return output


def broadcast(comm, device: str, tensor: torch.Tensor, src: int, timeout) -> torch.Tensor:
    _timeout("broadcast", timeout)
    if comm.world_size > 1:
        lane(comm, device, "broadcast").broadcast(tensor, src)
    return tensor


def barrier(comm, device: str, timeout) -> None:
    """A device barrier on the current stream: later work on it starts once every rank's stream reached it."""
    _timeout("barrier", timeout)
    lane(comm, device, "barrier").barrier()
