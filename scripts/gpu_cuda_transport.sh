#!/usr/bin/env bash
# Usage: scripts/gpu_cuda_transport.sh
#
# The CUDA transport and the runtime's CUDA heap on a GPU (issue 23), in under 4 minutes:
#   1. python -m zbccl.heap.transports.cuda.selfcheck: two processes on GPU 0 share VMM memory, no zbccl
#      runtime (its own `CHECK <name> PASS|FAIL` lines; <= 60 s);
#   2. pytest: the transport growing past the granularity + pointer tables read by a Triton kernel
#      (tests/gpu/test_cuda_transport_gpu.py), the conformance suite on cuda (tests/transports -k cuda),
#      the CUDA heap at worlds 2 and 4 on one GPU, heap_scope, growth (tests/gpu/test_cuda_heap.py).
# Uses the checkout's src/ (nothing is installed); needs torch with CUDA, cuda-bindings, triton, pytest.
# Exit status: 0 all passed, 1 something failed, 124 a step hit its time limit.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
echo "gpu_cuda_transport: $(date -u +%Y-%m-%dT%H:%M:%SZ) $(git rev-parse --short HEAD 2>/dev/null || echo '?') $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)"
timeout -k 5 60 "$PY" -m zbccl.heap.transports.cuda.selfcheck --timeout 45
s1=$?
[ "$s1" = 124 ] && echo "CHECK cuda-selfcheck FAIL killed at 60 s"
# skipped tests would read as a pass: say first whether the cuda transport can run here at all
if ! timeout -k 5 60 "$PY" -c "from tests.transports.conftest import unavailable as u; r = u('cuda'); \
print('CHECK cuda-available', 'PASS' if r is None else 'FAIL ' + r); raise SystemExit(r is not None)"; then
  exit 1
fi
timeout -k 10 170 "$PY" -m pytest -q -rs -p no:cacheprovider --durations=0 \
    tests/gpu/test_cuda_transport_gpu.py tests/transports -k cuda tests/gpu/test_cuda_heap.py
s2=$?
case "$s2" in
  0) echo "CHECK cuda-transport-tests PASS" ;;
  124) echo "CHECK cuda-transport-tests FAIL killed at 170 s" ;;
  *) echo "CHECK cuda-transport-tests FAIL pytest exit $s2" ;;
esac
[ "$s1" = 0 ] && [ "$s2" = 0 ] && exit 0
[ "$s1" = 124 ] || [ "$s2" = 124 ] && exit 124
exit 1
