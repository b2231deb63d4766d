"""The zbccl error hierarchy.

Every error carries a stable ``code`` so that callers (and the process-group
adapter) can map failures without parsing messages. Messages follow the house
form ``"<op>: <what is wrong>, expected X, got Y"``.
"""

from __future__ import annotations

import enum

__all__ = [
    "ErrorCode",
    "ZbcclError",
    "ZbcclInvalidUsageError",
    "ZbcclOutOfMemoryError",
    "ZbcclRemoteError",
    "ZbcclSystemError",
    "ZbcclTimeoutError",
]


class ErrorCode(enum.IntEnum):
    """Stable numeric codes; also written into the shared control area."""

    OK = 0
    INTERNAL = 1
    INVALID_USAGE = 2
    TIMEOUT = 3
    REMOTE = 4
    OUT_OF_MEMORY = 5
    SYSTEM = 6


class ZbcclError(RuntimeError):
    """Base class of every error zbccl raises. ``code`` is an :class:`ErrorCode`."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str, *, ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        #: Ranks the error is about (missing, dead or disagreeing), possibly empty.
        self.ranks = tuple(ranks)


class ZbcclInvalidUsageError(ZbcclError, ValueError):
    """The caller passed something zbccl cannot accept (bad shape, handle, size...)."""

    code = ErrorCode.INVALID_USAGE


class ZbcclTimeoutError(ZbcclError, TimeoutError):
    """A blocking call ran out of time; ``ranks`` names the ranks that never arrived."""

    code = ErrorCode.TIMEOUT


class ZbcclRemoteError(ZbcclError):
    """A peer died, left, or failed; ``ranks`` names it."""

    code = ErrorCode.REMOTE


class ZbcclOutOfMemoryError(ZbcclError, MemoryError):
    """The heap (or the machine's shared memory) cannot hold the request."""

    code = ErrorCode.OUT_OF_MEMORY


class ZbcclSystemError(ZbcclError, OSError):
    """An operating-system call failed (mmap, socket, compiler...)."""

    code = ErrorCode.SYSTEM
