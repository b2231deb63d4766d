"""Usage: zbccl bench [-n N] [--ops OPS] [--dtypes fp32,bf16] [--min-size 4K] [--max-size 64M]
                   [--baselines gloo,memcpy[,vllm]] [--json PATH] [--plot PATH] [--quick] [--threads T]
                   [--idle-wait S] [--no-zbccl]

The zbccl benchmark: nccl-tests-style rows (``size count dtype time_us algbw
busbw #wrong``) for all_reduce, all_gather, reduce_scatter, all_to_all and
broadcast, with gloo, the memcpy limit and (opt-in) vLLM's CPU shm ops in
the same table, each with its own correctness column.

Modules: ``runner`` (the per-rank sweep and :func:`run_bench`), ``timing``
(calibrated timing, load gating, foreign-CPU accounting, payloads and the
oracle; torch-only, shared with the vLLM worker), ``baselines`` (gloo,
memcpy, the vLLM driver), ``probe`` (the host-state probe: the cost of a
store into lines the peer core just read, in every run's header), ``report``
(tables, JSON, plot, progress bar), ``vllm_worker`` (a standalone script
for the vLLM venv; not imported here).
"""

from .report import algbw_bytes, busbw_factor, format_table, write_json, write_plot
from .runner import run_bench, size_ladder
from .timing import TimingConfig, summarize

__all__ = ["run_bench", "size_ladder", "busbw_factor", "algbw_bytes", "format_table", "write_json",
           "write_plot", "summarize", "TimingConfig"]
