"""What the native core gives EP, as one explicit object resolved once (no attribute probes per op)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

from ..errors import ZbcclSystemError

__all__ = ["Capabilities"]


@dataclass(frozen=True)
class Capabilities:
    """What the native core gives EP: each kernel ``fn(address of its argument block) -> int``, and the row
    copier ``copy_many(table address, rows, threads)``. Resolved once per process (:meth:`of`)."""

    layout: Callable[[int], int]
    route: Callable[[int], int]
    plan: Callable[[int], int]
    pull: Callable[[int], int]
    combine: Callable[[int], int]
    ll_plan: Callable[[int], int]
    ll_pull: Callable[[int], int]
    ll_addrs: Callable[[int], int]
    ll_combine: Callable[[int], int]
    hosts_recv: Callable[[int], int]
    hosts_pack: Callable[[int], int]
    hosts_handle: Callable[[int], int]
    hosts_ll_recv: Callable[[int], int]
    copy_many: Callable[[int, int, int], None]

    @classmethod
    def of(cls, prims) -> Capabilities:
        """The kernels of ``prims`` (the heap's primitives); :class:`ZbcclSystemError` naming what is missing."""
        native = {f.name: getattr(prims, f.name if f.name == "copy_many" else "ep_" + f.name, None)
                  for f in fields(cls)}
        missing = sorted(n for n, fn in native.items() if fn is None)
        if missing:
            raise ZbcclSystemError(
                f"ep: the native core's EP kernels are missing, expected {sorted(native)}, got none of {missing}; "
                "zbccl.ep needs the native core: install a C compiler and run 'zbccl build' ('zbccl info' says why "
                "it is not built)")
        return cls(**native)
