"""SGLang's model forward inside ``zbccl.heap_scope``: zero-buffer collectives.

SGLang all-reduces the outputs of its row-parallel linears (and all-gathers the vocab-parallel
logits) inside ``ModelRunner.forward``, which every TP worker calls once per scheduler step
(prefill or decode). Running it in ``heap_scope`` makes every tensor the forward allocates
(activations, op outputs) a heap tensor, so zbccl's collectives read and write them in place and
stage nothing (``memory_stats()["staged_bytes"]`` does not grow in a decode step). Weights and the
KV cache are allocated outside the forward and stay ordinary memory. When the heap is full an
allocation falls back to ordinary memory (counted in ``fallback_allocs``) and the collective on it
is staged: correct, no longer zero-buffer.

The scope is entered only in a process where zbccl is running (a routed group started it);
elsewhere (fallback, TP=PP=1) the forward is SGLang's own.
"""

from __future__ import annotations

__all__ = ["scoped_forward"]


def scoped_forward(original, runner, *args, **kwargs):
    """AROUND hook of ``ModelRunner.forward``."""
    from ...adapters.scope import heap_scope
    from .group import running

    if not running():
        return original(runner, *args, **kwargs)
    with heap_scope():
        return original(runner, *args, **kwargs)
