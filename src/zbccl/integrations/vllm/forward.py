"""The model forward of vLLM's CPU runner inside ``zbccl.heap_scope``: zero-buffer collectives.

vLLM all-reduces the outputs of its row-parallel linears (and gathers the logits) inside the
model forward, ``GPUModelRunner._model_forward`` (and gathers logits in ``execute_model``), which
``CPUModelRunner`` inherits. Wrapping those methods in ``heap_scope`` makes every tensor the forward allocates (activations, op
outputs, oneDNN scratch) a heap tensor, so zbccl's collectives read and write them in place and
stage nothing (``memory_stats()["staged_bytes"]`` does not grow in a decode step). Weights and
the KV cache are allocated outside the forward and stay ordinary memory. When the heap is full
an allocation falls back to ordinary memory (counted in ``fallback_allocs``) and the collective
on it is staged: correct, no longer zero-buffer.

The scope is entered only in a worker whose zbccl is running (a TP or PP group started it);
elsewhere (fallback, TP=PP=1) the forward is vLLM's own.
"""

from __future__ import annotations

import functools

__all__ = ["patch_model_forward"]

_MARK = "_zbccl_heap_scope"


def patch_model_forward() -> None:
    """Idempotent: run ``CPUModelRunner.execute_model`` and ``_model_forward`` in ``heap_scope``.

    ``execute_model`` covers a serving step (forward and ``compute_logits``, whose vocab-parallel
    gather is a collective too); ``_model_forward`` alone is also called by vLLM's warm-up and
    profiling runs. The scopes nest harmlessly.
    """
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    for name in ("execute_model", "_model_forward"):
        inner = getattr(CPUModelRunner, name)
        if not getattr(inner, _MARK, False):
            setattr(CPUModelRunner, name, _scoped(inner))


def _scoped(inner):
    @functools.wraps(inner)
    def run(self, *args, **kwargs):
        from ...adapters.scope import heap_scope
        from ...runtime.registry import get_default

        if get_default() is None:
            return inner(self, *args, **kwargs)
        with heap_scope():
            return inner(self, *args, **kwargs)

    setattr(run, _MARK, True)
    return run
