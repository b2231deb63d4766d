"""The public ops' guard (runtime/registry.py ``collective``): generated with each op's own signature."""

from __future__ import annotations

import importlib
import inspect

import pytest

from zbccl.runtime.oplock import OpLock
from zbccl.runtime.registry import collective

allreduce, barrier, broadcast, exchange, reduce_scatter = (importlib.import_module(f"zbccl.ops.{m}") for m in (
    "allreduce", "barrier", "broadcast", "exchange", "reduce_scatter"))  # the modules (zbccl.ops exports the functions)


@pytest.mark.parametrize("fn", [allreduce._all_reduce, exchange.all_gather_into_tensor, exchange.all_to_all_single,
                                exchange.all_gather_v, reduce_scatter.reduce_scatter_tensor, broadcast.broadcast,
                                barrier.barrier, barrier.tagged_barrier])
def test_the_guard_has_the_ops_signature(fn):
    guard = inspect.signature(fn, follow_wrapped=False)
    assert guard == inspect.signature(fn.__wrapped__)
    assert fn.__name__ == fn.__wrapped__.__name__ and fn.__doc__ == fn.__wrapped__.__doc__


def test_the_guard_passes_every_argument_on():
    seen = []

    @collective("probe")
    def probe(a, b=2, *, c2=3, comm=None, timeout=None):
        seen.append((a, b, c2, comm, timeout))

    class Comm:  # what the guard needs of a communicator: a live one with an op lock
        def __init__(self) -> None:
            self._live, self.role, self._ctx, self._op_lock = True, 0, None, OpLock()

    comm = Comm()
    probe(1, comm=comm)
    probe(1, 5, c2=7, comm=comm, timeout=9.0)
    assert seen == [(1, 2, 3, comm, None), (1, 5, 7, comm, 9.0)]
    assert not comm._op_lock.busy() and comm._op_lock.owner is None
    with pytest.raises(TypeError):
        probe(1, 2, 3, comm=comm)  # c2 is keyword-only, as in the op


@pytest.mark.parametrize("src", ["def f(*args, comm=None): pass", "def f(x, **kw): pass", "def f(x, comm=None): pass",
                                 "def f(x, *, comm=0): pass", "def f(x): pass", "def f(lock, *, comm=None): pass",
                                 "def f(_x, *, comm=None): pass"])
def test_the_guard_refuses_what_it_cannot_mirror(src):
    ns: dict = {}
    exec(src, ns)  # noqa: S102 - test inputs
    with pytest.raises(TypeError, match="collective"):
        collective("bad")(ns["f"])
