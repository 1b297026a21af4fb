# Set-up and checks. `make run` and `make test` work on a fresh machine: they create .venv and install
# everything, torch first (a CPU wheel here; see docs/install.md), then the package with its extras.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.mla-backends-installed
# packages installed beside the project for the plugin tests (real entry points)
PLUGIN_PKGS := examples/mla_backends_example_plugin tests/plugins/broken_plugin

.PHONY: run test install lint bench docs clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -e ".[test,hf,flashinfer,dev]"
	for p in $(PLUGIN_PKGS); do test ! -d $$p || $(BIN)/python -m pip install -q -e $$p || exit 1; done
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/mla-backends demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check mla_backends selector tests benchmarks

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_layer_cpu.py

clean:
	rm -rf $(VENV) build dist *.egg-info
