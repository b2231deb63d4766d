"""Runtime: init/finalize, communicators, bounded waits with death detection."""

from .communicator import Communicator
from .state import abort, add_finalize_hook, finalize, get_default, init, is_initialized, resolve_comm

__all__ = ["Communicator", "init", "finalize", "abort", "add_finalize_hook", "get_default",
           "is_initialized", "resolve_comm"]
