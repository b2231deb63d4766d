"""The cuda transport: rank heaps in GPU memory (CUDA VMM, shared as POSIX descriptors).

Nothing here imports CUDA at import time: :mod:`.vmm` loads ``cuda.bindings`` on first use.
"""

__all__: list[str] = []
