#!/usr/bin/env bash
# Build zbccl's wheel and use it as a newcomer would: a fresh venv holding only torch (CPU) and numpy,
# the wheel installed with --no-deps, no C/C++ compiler on PATH, an empty ZBCCL_CACHE_DIR; then a
# two-rank torchrun of scripts/wheel_smoke.py (first collective timed, nothing compiled, heap tensors,
# heap_scope) and of the two examples (every torch.distributed collective, zbccl.ep dispatch/combine).
# Also checks the wheel's LICENSE, SPDX metadata, py.typed and prebuilt manifest.
#
# Usage: scripts/check_wheel.sh [python]   (default: .venv/bin/python, which builds the wheel)
# Env:   TORCH_SPEC (default torch==2.13.0; on other machines add
#        PIP_INDEX_URL=https://download.pytorch.org/whl/cpu to keep CUDA wheels out), WORK (scratch dir,
#        removed at the end unless KEEP=1).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${1:-.venv/bin/python}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
WORK=${WORK:-$(mktemp -d /tmp/zbccl-wheel-check.XXXXXX)}
[ "${KEEP:-0}" = 1 ] || trap 'rm -rf "$WORK"' EXIT
echo "== scratch: $WORK"

echo "== building the wheel with $PY (no build isolation: its torch is the one the wheel is built against)"
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$WORK/dist" "$ROOT"
WHEEL=$(ls "$WORK"/dist/zbccl-*.whl)
echo "   $(basename "$WHEEL") ($(du -h "$WHEEL" | cut -f1))"

echo "== wheel contents and metadata"
"$PY" - "$WHEEL" <<'PYEOF'
import json, sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
names = z.namelist()
meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
need = {
    "LICENSE (Apache-2.0 text)": any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    and b"Apache License" in z.read(next(n for n in names if n.endswith(".dist-info/licenses/LICENSE"))),
    "License-Expression: Apache-2.0": "License-Expression: Apache-2.0" in meta,
    "Requires-Dist torch range": "Requires-Dist: torch<2.14,>=2.11" in meta,
    "py.typed": "zbccl/py.typed" in names,
    "platform tag": "-cp3" in sys.argv[1] and "linux" in sys.argv[1],
}
manifest = json.loads(z.read("zbccl/native/_prebuilt/manifest.json"))
for name, lib in manifest["libraries"].items():
    need[f"prebuilt {name}"] = f"zbccl/native/_prebuilt/{lib['path']}" in names
bad = [k for k, ok in need.items() if not ok]
print("   " + ", ".join(need))
print(f"   manifest: abi {manifest['abi']}; " + "; ".join(f"{k} torch={v['torch']}" for k, v in manifest["libraries"].items()))
sys.exit(f"wheel check failed: {bad}" if bad else 0)
PYEOF

echo "== fresh venv: $TORCH_SPEC and numpy, then the wheel --no-deps"
python3 -m venv "$WORK/venv"
V="$WORK/venv/bin"
"$V/python" -m pip install -q "$TORCH_SPEC" numpy
"$V/python" -m pip install -q --no-deps "$WHEEL"

echo "== two ranks, no compiler on PATH, empty ZBCCL_CACHE_DIR"
mkdir -p "$WORK/run" "$WORK/cache"
cp scripts/wheel_smoke.py examples/torch_distributed.py examples/ep_dispatch_combine.py "$WORK/run/"
run() {  # no gcc/cc/g++ reachable: PATH is the venv alone; nothing of the checkout on sys.path
  (cd "$WORK/run" && env -i HOME="$WORK" PATH="$V" ZBCCL_CACHE_DIR="$WORK/cache" OMP_NUM_THREADS=1 \
     "$V/python" -m torch.distributed.run --standalone --nproc-per-node 2 "$@" 2>&1 \
     | grep -v -e "^W[0-9]" -e "OMP_NUM_THREADS" -e "^\*\*\*")
}
env -i PATH="$V" "$V/python" -c 'import shutil; assert not any(shutil.which(c) for c in ("gcc", "cc", "g++", "c++")), "a compiler is on PATH"'
run wheel_smoke.py
run torch_distributed.py --heap-scope
run ep_dispatch_combine.py
if [ -n "$(ls -A "$WORK/cache" 2>/dev/null)" ] && [ -n "$(ls -A "$WORK/cache/native" 2>/dev/null)" ]; then
  echo "check_wheel: something was compiled into $WORK/cache/native" >&2; exit 1
fi
echo "== the wheel works without a compiler"
