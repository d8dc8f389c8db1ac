# The two set-up commands: `make demo` (train a small model across local processes) and
# `make test`. Both create .venv when missing and install what they need.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_PIN := torch==2.13.0
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-train

.PHONY: demo test lint typecheck pytest bench clean venv gpu-check

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH_PIN)
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP) $(DEMO_STAMP)

# The demo needs the runtime and what `pipetrain train` shows (the train extra), not the test tools.
$(DEMO_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH_PIN)
	$(BIN)/python -m pip install --quiet -e ".[train]"
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/pipetrain train

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples

typecheck: $(STAMP)
	$(BIN)/mypy --strict src/pipetrain

# torch's own pipelining tests with the import switched run in a process of their own
# (tests/torch_conformance/conftest.py).
pytest: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 tests
	$(BIN)/python -m pytest -q -n 2 tests/torch_conformance

test: lint typecheck pytest

bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py --out benchmarks/RESULTS.md

# On a machine with GPUs (and a CUDA build of torch in .venv): every schedule on CUDA, gradients,
# no host synchronisation in steady state, step times; NCCL checks and runtime_vs_torch with 2+ GPUs.
gpu-check: $(STAMP)
	$(BIN)/python benchmarks/gpu_check.py

clean:
	rm -rf $(VENV) build dist .pytest_cache .mypy_cache .ruff_cache
