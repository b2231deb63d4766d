"""Usage: zbccl bench [-n N] [--ops OPS] [--dtypes fp32,bf16] [--min-size 4K] [--max-size 64M]
                   [--baselines gloo,memcpy[,vllm|,mpi]] [--json PATH] [--plot PATH] [--quick] [--threads T]
                   [--idle-wait S] [--no-zbccl] [--gap-ms MS]
       zbccl bench --hosts N [--ranks-per-host M] [--smoke] [--no-ep] [--ops OPS] [--dtypes D] [--threads T]
                   [--json PATH] (root)

The zbccl benchmark: nccl-tests-style rows (``size count dtype time_us algbw
busbw #wrong``) for all_reduce, all_gather, reduce_scatter, all_to_all and
broadcast, with gloo, the memcpy limit and (opt-in) vLLM's CPU shm ops in
the same table, each with its own correctness column. ``--gap-ms`` times
each call as an inference step makes it: after that much matmul work, every
rank entering at one instant (``timing``, "Calls inside a model step").

Modules: ``runner`` (the per-rank sweep and :func:`run_bench`), ``timing``
(calibrated timing, load gating, foreign-CPU accounting, payloads and the
oracle; torch-only), ``baselines`` (gloo, memcpy), ``ab`` (vLLM's shm ops
interleaved with zbccl round by round in the same ranks), ``probe`` (the host-state probe: the cost of a
store into lines the peer core just read, in every run's header), ``report``
(tables, JSON, plot, progress bar), ``micro`` (host overheads: allocator,
native call floor, the Python part of a small all_reduce), ``hosts`` and ``hosts_rank`` (``--hosts``:
the same sweep between namespace hosts, with raw Mooncake and the inter-host bytes per op).
"""

from .report import algbw_bytes, busbw_factor, format_table, write_json, write_plot
from .runner import run_bench, size_ladder
from .timing import TimingConfig, summarize

__all__ = ["run_bench", "size_ladder", "busbw_factor", "algbw_bytes", "format_table", "write_json",
           "write_plot", "summarize", "TimingConfig"]
