# Each target bootstraps .venv itself: a fresh clone needs only `make demo` or `make test`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip

.PHONY: demo test test-quick bench venv

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet "$(TORCH_SPEC)"
	$(PIP) install --quiet -e ".[test]"
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(VENV)/bin/policyworker demo

test: venv
	HYPOTHESIS_PROFILE=ci $(PY) -m pytest -m "not gpu and not multigpu" tests; rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 1; fi; exit $$rc

test-quick: venv
	$(PY) -m pytest -q -m "not distributed and not gpu and not multigpu and not slow" tests

bench: venv
	$(VENV)/bin/policyworker bench
