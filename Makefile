# Two entry points for users and CI; each sets up .venv on first use.
#   make run    the quick-start example (GPU if there is one, else the CPU path)
#   make test   the test suite (CPU tests always; GPU tests when CUDA is present)

VENV ?= .venv
PY := $(VENV)/bin/python
export CUDA_HOME ?= /usr/local/cuda

.PHONY: run test
run: $(VENV)/.installed
	$(PY) examples/quickstart.py

test: $(VENV)/.installed
	$(PY) -m pytest -q tests

# torch first, at the tested pin, so that the project's range installs nothing bigger.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test,hf]"
	touch $@
