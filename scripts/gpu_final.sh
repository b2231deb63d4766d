#!/usr/bin/env bash
# Usage: bash scripts/gpu_final.sh [TOTAL_S=270] [--dry-run]
#
# The one-shot GPU run of issue 23, bounded by TOTAL_S seconds of wall time (default 270), each step
# guarded (its own timeout, printed `STEP <name> rc=<rc> <s>s`, then the next step runs):
#   0. MPS, started as the lead's run2.sh does (nvidia-cuda-mps-control -d, then the CUDA transport's
#      selfcheck under it); if either fails, time-slicing. Every figure below says which (MODE=...).
#      zbccl's native core builds meanwhile (~25 s on a fresh machine).
#   1. the full stack at world 2: every op (--quick), heap_scope, graph capture of every op and the decode
#      step replayed 100 times, torch.distributed; then the bench rows (4 KiB .. 64 MiB, zbccl auto/
#      one-shot/two-shot/graph vs device memcpy, torch SymmetricMemory one-shot/two-shot, staged memcpy).
#   2. the same at world 4.
#   3. kernels (GPU_FINAL_LAST=pytest: instead the CUDA tests, tests/gpu's heap and transport files, and the
#      transport conformance suite on cuda; GPU_FINAL_LAST=probe: scripts/gpu_launch_probe.py): the Triton kernels alone (scripts/triton_kernels_gpu.py: no CUDA transport, CUDA IPC
#      buffers) at worlds 2 and 4 with its bench rows, in what time is left (about 30 kernel variants per
#      world to compile: first, it would leave the full stack no time; last, the cache has most of them).
#   4. the tables for docs/benchmarks.md, and every failed CHECK line and every rank's first error.
# After a step that failed or was killed, MPS is restarted (a client killed in a spinning kernel can
# leave the MPS server refusing new clients, which is what made world 4 of GPU run 2 fail at set-up).
# --dry-run: no GPU: step 2's cases as the interpreter rehearsal (python -m zbccl.bench.gpu --interpret).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1
PY="${PYTHON:-python3}"
TOTAL="${1:-270}"
DRY=0
for a in "$@"; do [ "$a" = --dry-run ] && DRY=1; done
T0=$SECONDS
LOGS="${GPU_FINAL_OUT:-${OUT:-/tmp/zbccl-gpu-final}}"  # the device runner's $OUT: the logs come back as files
mkdir -p "$LOGS"
left() { echo $((TOTAL - (SECONDS - T0))); }
mode=off
mps_start() {
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  mode=off
  if command -v nvidia-cuda-mps-control > /dev/null && nvidia-cuda-mps-control -d; then
    if timeout -k 5 60 "$PY" -m zbccl.heap.transports.cuda.selfcheck --timeout 40 > "$LOGS/selfcheck.log" 2>&1; then
      mode=on
    else
      grep -E "CHECK|Error" "$LOGS/selfcheck.log" | head -20
      echo quit | timeout 10 nvidia-cuda-mps-control; sleep 1
    fi
  fi
  if [ "$mode" = off ]; then
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    echo "MODE=time-slicing (no MPS: every rank's kernels take turns on the GPU; handshakes wait for slices)"
  else
    echo "MODE=MPS (the ranks' kernels run concurrently; selfcheck: $(grep -c PASS "$LOGS/selfcheck.log") PASS)"
  fi
}
mps_stop() { [ "$mode" = on ] && echo quit | timeout 10 nvidia-cuda-mps-control; sleep 1; }
# step NAME CAP_S CMD...: runs CMD bounded by min(CAP_S, what is left minus 10 s), logs to $OUT/NAME.log
step() {
  local name=$1 cap=$2; shift 2
  local l; l=$(( $(left) - 10 ))
  [ "$l" -lt "$cap" ] && cap=$l
  if [ "$cap" -lt 25 ]; then echo "STEP $name SKIPPED (only $(left)s left)"; return 0; fi
  local t=$SECONDS
  echo "=== STEP $name (cap ${cap}s, MODE=$mode, $(date -u +%H:%M:%S))"
  # the whole output in $LOGS/NAME.log; on stdout all but the kernel script's per-case PASS lines
  timeout -k 5 "$cap" "$@" 2>&1 | grep --line-buffered -v -E "RuntimeWarning: zbccl: torch .* is untested|native.prepare\(world_size|FutureWarning: .enable_symm_mem_for_group|^  enable\(self.group\)|^  backend_class = creator_fn" | tee "$LOGS/$name.log" | grep --line-buffered -v -E "^CHECK w[0-9]+_.* PASS"
  local rc=${PIPESTATUS[0]}
  echo "($(grep -c -E '^CHECK .* PASS' "$LOGS/$name.log") CHECK PASS lines in $name.log)"
  echo "STEP $name rc=$rc $((SECONDS - t))s"
  if [ "$rc" != 0 ] && [ "$mode" = on ] && [ "$DRY" = 0 ]; then  # a clean server for the next step
    mps_stop; mps_start
  fi
}

echo "gpu_final: $(date -u +%Y-%m-%dT%H:%M:%SZ) $(git rev-parse --short HEAD 2>/dev/null || echo '?') budget ${TOTAL}s"
if [ "$DRY" = 1 ]; then
  step rehearsal-w2 "$TOTAL" "$PY" -m zbccl.bench.gpu --interpret --quick --worlds 2 --replays 3 --heap 64M \
    --budget $(( TOTAL - 20 )) --json "$LOGS/w2.json"
  exit 0
fi
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader 2>/dev/null | head -1
# zbccl's native core (the CPU heap's; ~25 s on a fresh machine), built while MPS starts (which needs none)
"$PY" -c "from zbccl import native; native.prepare(world_size=2)" > "$LOGS/native.log" 2>&1 &
native_pid=$!
mps_start
for _ in $(seq 60); do kill -0 "$native_pid" 2>/dev/null || break; sleep 1; done
kill "$native_pid" 2>/dev/null; wait "$native_pid"; echo "native build rc=$? $(tail -c 300 "$LOGS/native.log" | tr '\n' ' ')"
# 1./2. the full stack per world: cases, then bench (each world its own processes and budget)
cap() { local l=$(( $(left) - 10 )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
# GPU_FINAL_CASE_WORLDS: the worlds whose cases run (default "2 4"); GPU_FINAL_BENCH_S: each bench's cap (55),
# GPU_FINAL_BENCH4_S: world 4's (default: the same)
for w in 2 4; do
  if [[ " ${GPU_FINAL_CASE_WORLDS:-2 4} " == *" $w "* ]]; then
    c=$(cap 75)
    step "w$w-cases" "$c" "$PY" -m zbccl.bench.gpu --only cases --quick --worlds "$w" --replays 100 \
      --budget $((c - 3)) --json "$LOGS/w$w-cases.json"
  fi
  b=${GPU_FINAL_BENCH_S:-55}
  [ "$w" = 4 ] && b=${GPU_FINAL_BENCH4_S:-$b}
  c=$(cap "$b")
  step "w$w-bench" "$c" "$PY" -m zbccl.bench.gpu --only bench --quick --worlds "$w" --budget $((c - 3)) \
    --mode "$mode" --json "$LOGS/w$w-bench.json"
done
# 3. the kernels alone (no CUDA transport: CUDA IPC buffers), with what is left (its ~30 kernel variants per
# world compile first: after the full stack, the triton cache has many of them)
l=$(( $(left) - 12 ))
if [ "$l" -lt 30 ]; then
  echo "STEP ${GPU_FINAL_LAST:-kernels} SKIPPED (only $(left)s left)"
elif [ "${GPU_FINAL_LAST:-kernels}" = probe ]; then  # instead: where an eager op's host time goes
  step probe "$l" "$PY" scripts/gpu_launch_probe.py --only launch
elif [ "${GPU_FINAL_LAST:-kernels}" = pytest ]; then  # instead: the CUDA tests and the conformance suite on cuda
  step pytest "$l" "$PY" -m pytest -q -p no:cacheprovider --timeout 120 tests/gpu/test_cuda_heap.py \
    tests/gpu/test_cuda_transport_gpu.py tests/transports/test_conformance.py -k "not shm and not mooncake"
else
  step kernels "$l" "$PY" scripts/triton_kernels_gpu.py --worlds 2 4 --bench --timeout $(( (l - 8) / 2 ))
fi
mps_stop
# 4. the table and the summary
echo
echo "=== KERNELS ALONE (scripts/triton_kernels_gpu.py, rank 0's view, MODE=$mode)"
grep -h -E "^# world|^op |^memcpy|^zbccl_|^symm_mem" "$LOGS/kernels.log" 2>/dev/null
echo
echo "=== TABLE for docs/benchmarks.md (MODE=$mode; H100 rows: every rank on GPU 0)"
grep -h -E "^GPU bench|^\| " "$LOGS"/w2-bench.log "$LOGS"/w4-bench.log 2>/dev/null | awk '!(/^\| W \||^\|---/ && seen[$0]++)'
echo
echo "=== SUMMARY (MODE=$mode, $((SECONDS - T0))s)"
grep -h -E "^CHECK .* (FAIL|SKIP)|^FIRST-ERROR \[rank [0-9]+\] [^n]|^ERROR " "$LOGS"/*.log | cut -c1-400 | head -40
grep -h "^CHECK " "$LOGS"/*.log | awk '{n++; if ($3 == "PASS") p++} END {print "CHECK lines: " p "/" n " PASS"}'
