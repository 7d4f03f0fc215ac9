# The two commands: `make demo` and `make test`. Both create and reuse .venv here.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch==2.13.0 first: the CPU build; the project's range (>=2.9,<2.15) is then satisfied
# and pip pulls no multi-GB CUDA build.
TORCH_CPU := torch==2.13.0

.PHONY: setup protos demo test test-unit clean

setup: $(VENV)/.installed protos

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_CPU)
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

protos: $(VENV)/.installed
	$(PY) tools/gen_protos.py

demo: setup
	$(VENV)/bin/structgen demo

test: setup
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) structgen/v1
