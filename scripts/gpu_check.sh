#!/usr/bin/env bash
# Usage: scripts/gpu_check.sh [--no-selfcheck] [--quick] [--worlds 2,4] [--only cases,bench] [--json out.json]
#
# The GPU check of zbccl's CUDA path (issue 23): every op at worlds 2 and 4 on GPU 0 against a
# plain-torch reference, CUDA graph capture and replay (each op, and a decode step replayed 100 times),
# and the bench against the device memcpy, torch SymmetricMemory one-shot/two-shot and a staged
# cudaMemcpy all_reduce. Each check prints `CHECK <name> PASS|FAIL|SKIP <detail>`; a table for
# docs/benchmarks.md follows. Run from anywhere; uses the checkout's src/ (nothing is installed).
# Builds only zbccl's native core if its cache lacks it (g++; ~15-30 s, reported by `CHECK native`).
# First the CUDA transport's own selfcheck (python -m zbccl.heap.transports.cuda.selfcheck, <= 60 s;
# --no-selfcheck skips it, e.g. right after scripts/gpu_cuda_transport.sh, which runs it too).
# Bounded: every spawned world has a timeout, and the whole run ends within 6 minutes (350 s + kill margins).
# Exit status: 0 all passed, 1 a check failed, 3 no CUDA device, 124 the overall timeout hit.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1  # the ranks share one GPU (torch symm_mem refuses it otherwise)
PY="${PYTHON:-python3}"
echo "gpu_check: $(date -u +%Y-%m-%dT%H:%M:%SZ) $(git rev-parse --short HEAD 2>/dev/null || echo '?') $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)"
start=$SECONDS
st=0
if [ "${1:-}" = "--no-selfcheck" ]; then  # scripts/gpu_cuda_transport.sh already ran it
  shift
else
  # 1. the CUDA transport alone (two processes share VMM memory on GPU 0): its own CHECK lines
  timeout -k 5 60 "$PY" -m zbccl.heap.transports.cuda.selfcheck --timeout 45
  st=$?
  [ "$st" = 124 ] && echo "CHECK cuda-transport-selfcheck FAIL killed at 60 s"
fi
# 2. ops, graphs, bench: whatever is left of the 350 s, the Python side keeping 15 s to report
left=$((350 - (SECONDS - start)))
timeout -k 10 "$left" "$PY" -m zbccl.bench.gpu --budget $((left - 15)) "$@"
rc=$?
[ "$rc" = 124 ] && echo "CHECK overall FAIL the run hit its ${left} s limit"
[ "$rc" = 0 ] && [ "$st" != 0 ] && rc=1
exit "$rc"
