"""Runtime: init/finalize and fork, communicators, the op guard, bounded waits with death detection."""

from .communicator import Communicator, NonMember
from .registry import collective
from .state import (
    abort,
    add_finalize_hook,
    add_fork_hook,
    finalize,
    get_default,
    in_forked_child,
    init,
    is_initialized,
    resolve_comm,
)

__all__ = ["Communicator", "NonMember", "init", "finalize", "abort", "add_finalize_hook", "add_fork_hook",
           "get_default", "is_initialized", "in_forked_child", "resolve_comm", "collective"]
