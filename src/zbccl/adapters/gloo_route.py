"""Ops the zbccl process group hands to its inner gloo group, made to mean what torch says.

Ops run on gloo when ``ZBCCL_FALLBACK_OPS`` names them, for the bitwise
reduce ops, and for every op after an initialisation fallback. Called
directly, ``ProcessGroupGloo`` differs from torch's contract (and from zbccl)
in ways a caller cannot see:

* it reads and writes a non-contiguous tensor as if it were contiguous (the
  wrong elements, silently): here such tensors get contiguous stand-ins,
  copied back after the op; a CUDA tensor gets a host stand-in the same way
  (gloo's own CUDA support covers a few ops only);
* some of its Works have no future (``reduce_scatter``) or report
  ``is_completed() == False`` after ``wait()``: here the gloo Work is waited
  inside the call and a zbccl Work returned, so the handle behaves like every
  other zbccl op (see :mod:`.work`: complete when returned; under
  ``async_op=True`` an error travels in the Work);
* its send/recv Works have no future: here they are wrapped in a
  :class:`~.work.PendingWork` (still asynchronous: a receive completes when
  gloo's does);
* it refuses lists of unequal sizes (``all_gather`` list form, ``all_to_all``
  list form), stacked or 0-dim ``all_gather_into_tensor`` operands, and has no
  ``allgather_into_tensor_coalesced``: here those run on gloo's flat ops.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch._C._distributed_c10d as _c10d

from ..errors import ZbcclInvalidUsageError
from ..ops.route import capturing
from .work import CompletedWork, PendingWork

__all__ = ["Stand", "on_gloo", "p2p_work", "device_p2p", "allgather_list", "alltoall_list", "allgather_flat"]


class Stand:
    """Contiguous stand-ins for the tensors handed to gloo; :meth:`finish` copies results back."""

    def __init__(self) -> None:
        self._back: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if t.is_contiguous() and t.device.type == "cpu":
            return t
        if t.device.type != "cpu":  # a device tensor travels through a host copy (gloo runs on the host)
            if capturing("cuda"):
                raise ZbcclInvalidUsageError(
                    "gloo fallback: this op runs on gloo (ZBCCL_FALLBACK_OPS, a bitwise reduce op, or zbccl could "
                    "not start), which copies device tensors through the host, expected an op zbccl runs on the "
                    "device inside a CUDA graph capture, got a capture in progress")
            c = t.to("cpu", memory_format=torch.contiguous_format)
        else:
            c = t.contiguous()
        self._back.append((t, c))
        return c

    def all(self, ts: list[torch.Tensor]) -> list[torch.Tensor]:
        return [self(t) for t in ts]

    def nested(self, tss: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        return [self.all(ts) for ts in tss]

    def finish(self) -> None:
        for t, c in self._back:
            t.copy_(c)


def on_gloo(opts, result: list[torch.Tensor], call: Callable[[Stand], object], *,
            sync_done: CompletedWork) -> CompletedWork:
    """Run ``call(stand)`` (which starts gloo ops on stand-ins and returns their Work or Works) to completion.

    A sync call raises; ``async_op=True`` returns a completed Work carrying the error, if any.
    """

    def run() -> None:
        stand = Stand()
        works = call(stand)
        for w in works if isinstance(works, (list, tuple)) else [works]:
            if w is not None:
                w.wait()
        stand.finish()

    if not getattr(opts, "asyncOp", False):
        run()
        return sync_done
    try:
        run()
    except Exception as exc:  # noqa: BLE001 - the Work hands it to wait()/exception()/the future
        return CompletedWork(result, exc)
    return CompletedWork(result)


def allgather_flat(gloo, output: torch.Tensor, input: torch.Tensor, stand: Stand):
    """``all_gather_into_tensor`` on gloo through 1-D views (gloo refuses stacked and 0-dim operands)."""
    out, inp = stand(output), stand(input)
    return gloo._allgather_base(out.view(-1), inp.reshape(-1), _c10d.AllgatherOptions())


def allgather_list(gloo, outs: list[torch.Tensor], inp: torch.Tensor, stand: Stand):
    """``all_gather`` list form on gloo; unequal sizes go through one padded flat all_gather."""
    if all(t.shape == inp.shape for t in outs):
        return gloo.allgather([stand.all(outs)], [stand(inp)], _c10d.AllgatherOptions())
    width = max(t.numel() for t in outs)
    padded = torch.zeros(width, dtype=inp.dtype)
    padded[:inp.numel()] = inp.reshape(-1)
    flat = torch.empty(width * len(outs), dtype=inp.dtype)
    gloo._allgather_base(flat, padded, _c10d.AllgatherOptions()).wait()
    for r, t in enumerate(outs):
        t.copy_(flat[r * width:r * width + t.numel()].view(t.shape))
    return None


def alltoall_list(gloo, outputs: list[torch.Tensor], inputs: list[torch.Tensor], stand: Stand):
    """``all_to_all`` list form on gloo; unequal sizes go through one flat ``alltoall_base`` with splits."""
    if all(t.shape == inputs[0].shape for t in [*inputs, *outputs]):
        return gloo.alltoall(stand.all(outputs), stand.all(inputs), _c10d.AllToAllOptions())
    flat_in = torch.cat([t.reshape(-1) for t in inputs]).cpu()
    flat_out = torch.empty(sum(t.numel() for t in outputs), dtype=flat_in.dtype)
    gloo.alltoall_base(flat_out, flat_in, [t.numel() for t in outputs], [t.numel() for t in inputs],
                       _c10d.AllToAllOptions()).wait()
    start = 0
    for t in outputs:
        t.copy_(flat_out[start:start + t.numel()].view(t.shape))
        start += t.numel()
    return None


def p2p_work(work, result: list[torch.Tensor], *, default_timeout: float, anysource: bool = False) -> PendingWork:
    """gloo's send/recv Work as a zbccl Work: the same completion, plus a future and the source rank."""
    from datetime import timedelta

    def step(timeout: float | None) -> bool:
        if timeout is None and not work.is_completed():
            return False
        if timeout is None:
            work.wait()
        else:
            work.wait(timedelta(seconds=timeout))
        if anysource:
            pending._source = work._source_rank()
        return True

    pending = PendingWork(result, step, default_timeout=default_timeout)
    return pending


def device_p2p(result: list[torch.Tensor], post: Callable[[list[torch.Tensor]], object], *, default_timeout: float,
               anysource: bool = False, receive: bool) -> PendingWork:
    """send/recv of CUDA tensors on gloo (zbccl's p2p mailboxes hold CPU tensors): through host copies, a
    receive copied back into the device tensors once gloo's completes. ``post(host_tensors)`` starts gloo's op."""
    if capturing("cuda"):
        raise ZbcclInvalidUsageError("send/recv: CUDA tensors go through gloo with host copies, expected no CUDA "
                                     "graph capture, got a capture in progress")
    host = [t.to("cpu", memory_format=torch.contiguous_format) for t in result]
    inner = p2p_work(post(host), host, default_timeout=default_timeout, anysource=anysource)

    def step(timeout: float | None) -> bool:
        if not inner._finish(timeout):
            return False
        inner.wait()  # raises gloo's error
        if receive:
            for t, h in zip(result, host):
                t.copy_(h)
        if anysource:
            pending._source = inner._source
        return True

    pending = PendingWork(result, step, default_timeout=default_timeout)
    return pending
