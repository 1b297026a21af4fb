# Set-up and checks. `make run` and `make test` work on a fresh machine: they create .venv and install
# everything, torch first (a CPU wheel here; see docs/install.md), then the package with its extras.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.mla-backends-installed
# the example plugin and the deliberately broken test plugin go to .test-site, which only the test run puts on
# the path (tests/conftest.py): `select`, `list` and `tune` in .venv never meet them. An example plugin left in
# .venv by an older Makefile is removed (drop-example-plugin, run by `make run` and `make test`).
EXAMPLE_PLUGIN := examples/mla_backends_example_plugin
BROKEN_PLUGIN := tests/plugins/broken_plugin
TEST_SITE := .test-site

.PHONY: run test install lint bench docs clean drop-example-plugin

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -e ".[test,hf,transformers,flashinfer,dev]"
	rm -rf $(TEST_SITE) && $(BIN)/python -m pip install -q --no-deps --no-build-isolation --target $(TEST_SITE) \
		$(BROKEN_PLUGIN) $(EXAMPLE_PLUGIN)
	touch $(STAMP)

install: $(STAMP) drop-example-plugin

drop-example-plugin: $(STAMP)
	@if PYTHONPATH= $(BIN)/python -c "import importlib.metadata as m; m.distribution('mla-backends-example-plugin')" \
		2>/dev/null; then $(BIN)/python -m pip uninstall -y -q mla-backends-example-plugin; fi

run: $(STAMP) drop-example-plugin
	$(BIN)/mla-backends demo

test: $(STAMP) drop-example-plugin
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check mla_backends selector tests benchmarks

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_layer_cpu.py

# regenerate docs/selection.md from the ladders and declarations (tests/test_selector_docs.py checks it)
docs: $(STAMP)
	$(BIN)/python -m selector.docs_gen

clean:
	rm -rf $(VENV) $(TEST_SITE) build dist *.egg-info
