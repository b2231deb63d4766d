#!/usr/bin/env bash
# Usage: scripts/setup_sglang.sh [--force]
#
# Creates .venv-sglang in the repository root: SGLang 0.5.23 on CPU torch 2.13.0, with zbccl
# (editable, no deps) and its SGLang plugin entry point, for `make sglang-e2e` and
# examples/sglang_bench.py. Kept apart from .venv: SGLang pins ~100 packages zbccl must not
# depend on. Idempotent: an existing, working venv is kept and only zbccl is refreshed.
#
# A plain `pip install sglang==0.5.23` pulls a CUDA torch (2.14.1+cu13 and ~40 nvidia packages).
# So, each step printed before it runs:
#   1. python3 -m venv .venv-sglang; pip install torch==2.13.0 (the local CPU wheel)
#   2. pip install --no-deps sglang==0.5.23
#   3. pip install -c scripts/sglang/constraints.txt -r scripts/sglang/requirements-cpu.txt
#      (sglang's requirements less the CUDA-only ones; the constraint torch==2.13.0 makes any
#      package that wants another torch fail instead of pulling a CUDA build)
#   4. pip install -c ... torchvision==0.28.0, and scripts/sglang/_zbccl_tv_shim.{py,pth}
#   5. scripts/sglang/sgl_kernel (a stub package) into site-packages
#   6. checks: torch is still +cpu, `import sglang.srt.entrypoints.engine` works
#   7. pip install --no-deps --no-build-isolation -e .  (zbccl and its sglang.srt.plugins entry
#      point), python -m zbccl build (the native core for this interpreter)
# Steps 4 and 5 exist only because SGLang's CPU packaging on PyPI is incomplete (PyPI has only a
# CUDA torchvision and no CPU sgl_kernel); see the headers of those files.
# Environment: PYTHON (default python3, 3.11+), SGLANG_SPEC, TORCH_SPEC, SGLANG_VENV.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
HERE="$ROOT/scripts/sglang"
VENV="${SGLANG_VENV:-$ROOT/.venv-sglang}"
PY="$VENV/bin/python"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
SGLANG_SPEC="${SGLANG_SPEC:-sglang==0.5.23}"
STAMP="$VENV/.zbccl-sglang-ok"
PIP=("$PY" -m pip install -q)

step() { printf '[setup_sglang] %s\n' "$*"; }

check_cpu_torch() {
    "$PY" -c "import torch, sys; v = torch.__version__; print('torch', v); \
sys.exit(0 if v.endswith('+cpu') else 'setup_sglang: a non-CPU torch arrived, expected 2.13.0+cpu, got ' + v)"
}

check_sglang() {
    SGLANG_USE_CPU_ENGINE=1 "$PY" - <<'PYEOF'
import importlib.metadata as md
import torch
import sglang.srt.entrypoints.engine  # noqa: F401  (imports torchvision and sgl_kernel on CPU)
print(f"sglang {md.version('sglang')} imports on torch {torch.__version__}")
PYEOF
}

if [[ "${1:-}" == "--force" ]]; then
    step "--force: removing $VENV"
    rm -rf "$VENV"
fi

install_zbccl() {
    step "pip install --no-deps --no-build-isolation -e $ROOT (zbccl, editable, with its sglang.srt.plugins entry point)"
    "${PIP[@]}" --no-deps --no-build-isolation -e "$ROOT"
    step "python -m zbccl build (native core for $PY)"
    (cd "$ROOT" && "$PY" -m zbccl build >/dev/null)
    "$PY" -c "from importlib.metadata import entry_points as e; \
assert any(p.value == 'zbccl.integrations.sglang:register' for p in e(group='sglang.srt.plugins')), 'entry point missing'; \
print('zbccl SGLang plugin entry point present')"
}

if [[ -f "$STAMP" ]] && check_cpu_torch && check_sglang; then
    step "$VENV has SGLang (delete it or pass --force to rebuild)"
    install_zbccl
    step "done: $VENV"
    exit 0
fi

if [[ ! -x "$PY" ]]; then
    step "creating $VENV with $PYTHON ($("$PYTHON" -V 2>&1))"
    "$PYTHON" -m venv "$VENV"
fi
step "pip install $TORCH_SPEC (the local CPU wheel, before anything that could want another torch)"
"${PIP[@]}" "$TORCH_SPEC"
step "pip install --no-deps $SGLANG_SPEC"
"${PIP[@]}" --no-deps "$SGLANG_SPEC"
step "pip install -c constraints.txt -r requirements-cpu.txt (sglang's non-CUDA requirements; large: triton via xgrammar)"
"${PIP[@]}" -c "$HERE/constraints.txt" -r "$HERE/requirements-cpu.txt"
step "pip install -c constraints.txt torchvision==0.28.0 (PyPI's only build is +cu130: shimmed below)"
"${PIP[@]}" -c "$HERE/constraints.txt" torchvision==0.28.0
check_cpu_torch
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
step "torchvision shim and sgl_kernel stub into $SITE"
cp "$HERE/_zbccl_tv_shim.py" "$HERE/_zbccl_tv_shim.pth" "$SITE/"
rm -rf "$SITE/sgl_kernel" && cp -r "$HERE/sgl_kernel" "$SITE/sgl_kernel"
step "checking that SGLang imports"
check_sglang
touch "$STAMP"
install_zbccl
step "done: $VENV"
