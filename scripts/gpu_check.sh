#!/usr/bin/env bash
# Usage: scripts/gpu_check.sh [--quick] [--worlds 2,4] [--only cases,bench] [--json out.json]
#
# The GPU check of zbccl's CUDA path (issue 23): every op at worlds 2 and 4 on GPU 0 against a
# plain-torch reference, CUDA graph capture and replay (each op, and a decode step replayed 100 times),
# and the bench against the device memcpy, torch SymmetricMemory one-shot/two-shot and a staged
# cudaMemcpy all_reduce. Each check prints `CHECK <name> PASS|FAIL|SKIP <detail>`; a table for
# docs/benchmarks.md follows. Run from anywhere; uses the checkout's src/ (nothing is installed).
# Builds only zbccl's native core if its cache lacks it (g++; ~15-30 s, reported by `CHECK native`).
# Bounded: every spawned world has a timeout, and the whole run is killed after 345 s.
# Exit status: 0 all passed, 1 a check failed, 3 no CUDA device, 124 the overall timeout hit.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1  # the ranks share one GPU (torch symm_mem refuses it otherwise)
PY="${PYTHON:-python3}"
echo "gpu_check: $(date -u +%Y-%m-%dT%H:%M:%SZ) $(git rev-parse --short HEAD 2>/dev/null || echo '?') $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)"
timeout -k 10 345 "$PY" -m zbccl.bench.gpu "$@"
rc=$?
[ "$rc" = 124 ] && echo "CHECK overall FAIL the run hit its 345 s limit"
exit "$rc"
