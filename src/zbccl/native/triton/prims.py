"""The primitives that differ between a GPU and the Triton interpreter, behind one set of names.

``helper`` (how device functions are declared), ``pause`` (back-off in a spin), ``now`` (a clock in
ns), ``bound`` (a loop bound), ``vsum``/``vmin`` and ``vsum2``/``vmin2`` (reductions of 1-d and 2-d
tensors to a scalar). On a GPU they are plain Triton (``nanosleep``, ``%globaltimer``); under
``TRITON_INTERPRET=1`` they are host Python, for speed and to work around two interpreter limits
(see each).
"""

from __future__ import annotations

import functools
import time

import numpy as np
import triton
import triton.language as tl
from triton import knobs

__all__ = ["INTERPRET", "helper", "pause", "now", "bound", "vsum", "vmin", "vsum2", "vmin2"]

#: Whether the kernels run under the Triton interpreter (``TRITON_INTERPRET=1`` when triton was imported).
INTERPRET = bool(knobs.runtime.interpret)

if INTERPRET:
    from triton.runtime.interpreter import InterpretedFunction

    def helper(fn):
        """A device function under the interpreter: its rewritten Python, called directly. (The interpreter's
        own device-function call re-patches triton.language on every call, ~0.5 ms each; the kernel's
        launch has patched it already.)"""
        interpreted = InterpretedFunction(fn)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            return interpreted.rewrite()(*args, **kwargs)

        return call

    # The interpreter runs a kernel's Python on the host: back off with a real sleep (the peers are other
    # processes on the same cores) and time out by the host clock.
    def _host_pause(polls) -> None:
        # Exponential back-off to 2 ms: an interpreted poll costs the host far more than a GPU's, and the
        # peer it waits for needs the same cores.
        time.sleep(min(50e-6 * 2 ** min(_host_int(polls), 6), 2e-3))

    def _host_now() -> int:
        return time.monotonic_ns()

    def _host_int(x) -> int:
        # A scalar kernel argument is a 1-element array under the interpreter, which numpy 2 will not
        # turn into an int for range(); loop bounds go through here.
        data = getattr(getattr(x, "handle", None), "data", x)
        return int(np.asarray(data).reshape(-1)[0])

    @helper
    def pause(polls):
        _host_pause(polls)

    @helper
    def now():
        return tl.full([], _host_now(), tl.int64)

    @helper
    def bound(x):
        return _host_int(x)

    def _host_reduce(x, how):
        # tl.sum/tl.min run their combine function as a device-function call, which the interpreter pays
        # dearly for (see helper); a 1-d reduction is one numpy call.
        from triton.runtime.interpreter import TensorHandle

        data = np.asarray(x.handle.data)
        value = np.array(data.sum() if how == 0 else data.min(), dtype=data.dtype)
        return tl.core.tensor(TensorHandle(value, x.dtype.scalar), x.dtype.scalar)

    @helper
    def vsum(x):
        return _host_reduce(x, 0)

    @helper
    def vmin(x):
        return _host_reduce(x, 1)

    @helper
    def vsum2(x):
        return _host_reduce(x, 0)

    @helper
    def vmin2(x):
        return _host_reduce(x, 1)
else:
    from triton.language.extra.cuda import utils as _cuda

    helper = triton.jit

    @helper
    def pause(polls):
        tl.inline_asm_elementwise("nanosleep.u32 100; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False,
                                  pack=1)

    @helper
    def now():
        return _cuda.globaltimer()

    @helper
    def bound(x):
        return x

    @helper
    def vsum(x):
        return tl.sum(x, axis=0)

    @helper
    def vmin(x):
        return tl.min(x, axis=0)

    @helper
    def vsum2(x):
        return tl.sum(tl.sum(x, axis=1), axis=0)

    @helper
    def vmin2(x):
        return tl.min(tl.min(x, axis=1), axis=0)
