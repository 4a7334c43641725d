# syntax=docker/dockerfile:1
# pagedserve: an OpenAI-compatible LLM server.
#
#   docker build -t pagedserve:cpu .                               # CPU image (default), embedded SmolLM2 baked in
#   docker build -t pagedserve:cuda --build-arg VARIANT=cuda .      # CUDA image: CUDA torch + Triton kernels
#   docker run --rm -p 8000:8000 pagedserve:cpu                    # serves the embedded model on :8000
#   docker run --rm --gpus all -p 8000:8000 pagedserve:cuda --config configs/llama3-8b-h200.yaml
#
# Arguments after the image name go to `pagedserve serve`. Where it listens and how long it drains come from
# the environment (PAGEDSERVE_HOST=0.0.0.0, PAGEDSERVE_PORT=8000, PAGEDSERVE_SHUTDOWN_TIMEOUT=3, below), which
# flags override (`--port 8521`) without dropping the others. The HEALTHCHECK probes where the server really
# listens: it reads the running server's environment and flags as the server did (server/settings.py).
# Stopping: requests in flight run on for 3 s after SIGTERM, the rest then end with an error event, and the
# engine core and the server exit in about a second: all inside `docker stop`'s 10 s grace. For a longer drain
# give both: `docker run --stop-timeout 45 -e PAGEDSERVE_SHUTDOWN_TIMEOUT=30 ... pagedserve:cpu`.
#
# Layers, for a cache that survives code changes: the dependencies come from pyproject.toml's dependency lists
# alone (stages requirements, deps), the embedded model is prepared in a stage of its own whose output only
# changes with the model (stage model), the native CPU kernels are compiled in a stage that holds the compiler
# and only their sources (stage kernels), and the project itself is a small wheel installed last. The CPU
# runtime carries no compiler.

ARG VARIANT=cpu
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

# ---- common base: a Python with the venv on PATH ---------------------------------------------------------
FROM ${PYTHON_IMAGE} AS base
# On every stage too, so `docker image prune --filter label=org.opencontainers.image.title=pagedserve` finds
# this build's leftovers (tests/containers.py clears them after each build).
LABEL org.opencontainers.image.title="pagedserve"
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PAGEDSERVE_CACHE_DIR=/opt/pagedserve/cache

# ---- requirements: the project's dependencies, as pyproject.toml lists them --------------------------------
# A file of its own, so edits elsewhere in pyproject.toml (tool settings, test extras) leave the deps stage cached:
# COPY --from compares content.
FROM base AS requirements
ARG VARIANT
WORKDIR /src
COPY pyproject.toml ./
RUN extras=""; if [ "$VARIANT" = "cuda" ]; then extras=triton; fi \
    && python -c 'import sys, tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
print("\n".join(p["dependencies"] + [r for e in sys.argv[1:] for r in p["optional-dependencies"][e]]))' \
        $extras > /requirements.txt

# ---- deps: torch, the project's dependencies and the embedded model's GGUF into /opt/venv -------------------
FROM base AS deps
ARG VARIANT
# cpu: the CPU-only torch build (~200 MB instead of several GB); cuda: PyPI's Linux torch, a CUDA 12 build
# that carries its own CUDA libraries. Override with --build-arg TORCH_INDEX_URL_CPU=... or TORCH_INDEX_URL_CUDA=...
# (e.g. https://download.pytorch.org/whl/cu128 for another CUDA build).
ARG TORCH_INDEX_URL_CPU=https://download.pytorch.org/whl/cpu
ARG TORCH_INDEX_URL_CUDA=
ARG TORCH_SPEC=torch==2.13.0
WORKDIR /src
RUN python -m venv /opt/venv
COPY --from=requirements /requirements.txt ./
COPY docker/install.sh ./docker/install.sh
RUN if [ "$VARIANT" = "cuda" ]; then \
        index="$TORCH_INDEX_URL_CUDA"; \
    elif [ "$VARIANT" = "cpu" ]; then \
        index="$TORCH_INDEX_URL_CPU"; \
    else \
        echo "VARIANT must be cpu or cuda, not $VARIANT" >&2; exit 1; \
    fi \
    && TORCH_SPEC="$TORCH_SPEC" TORCH_INDEX_URL="$index" \
       sh docker/install.sh --requirements requirements.txt /opt/venv/bin/python
# torch ships ~200 MB that serving never opens: C++ test binaries, protoc and the C++ headers (those are for
# building extensions and torch.compile's CPU code generation, which pagedserve does not use).
RUN torch_dir=$(python -c "import importlib.util as u; print(u.find_spec('torch').submodule_search_locations[0])") \
    && rm -rf "$torch_dir/test" "$torch_dir/include" "$torch_dir"/bin/*Test "$torch_dir"/bin/test_* \
        "$torch_dir"/bin/protoc*

# ---- builder: the project's wheel, what users install too --------------------------------------------------
FROM deps AS builder
COPY pyproject.toml README.md __init__.py ./
COPY engine ./engine
COPY kernels ./kernels
COPY server ./server
RUN python -m pip wheel --no-deps --wheel-dir /wheels /src

# ---- model: the embedded GGUF converted once (the server would otherwise convert it at every start) ---------
# Its output depends on the model and the converter, not on the rest of the code, so the final stage's COPY of
# it stays cached across code changes. Readable by the server's user, not writable by it.
FROM deps AS model
COPY --from=builder /wheels /wheels
RUN python -m pip install --no-deps /wheels/*.whl \
    && HF_HUB_OFFLINE=1 python -m pagedserve.engine \
    && chmod -R a+rX,go-w "$PAGEDSERVE_CACHE_DIR"

# ---- compiler: a C compiler and libc headers, for the kernels stage and the CUDA runtime ------------------
# Their versions are left to the base image's Debian release (point releases replace pinned versions).
FROM base AS compiler
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && apt-get clean \
    && rm -rf /var/lib/apt/lists/*

# ---- kernels: the native CPU kernels, one library per CPU level of this machine type -----------------------
# -march=native is no option for an image that runs on other CPUs: kernels/native_build.py builds x86-64-v2,
# -v3 and -v4 (armv8-a on arm64), named by the sources' digest, and the server loads the best level its CPU
# runs (kernels/cpu_native.py). Standard library only: no torch needed here, and no code but the kernels'.
FROM compiler AS kernels
COPY kernels/native_build.py /src/kernels/native_build.py
COPY kernels/csrc /src/kernels/csrc
RUN python -I /src/kernels/native_build.py /opt/pagedserve/cpu-kernels \
    && chmod -R a+rX,go-w /opt/pagedserve/cpu-kernels

# ---- runtimes: what each variant needs besides the venv ---------------------------------------------------
# CPU: nothing; its kernels come built. CUDA: Triton compiles its kernel launchers at first use, with gcc.
FROM base AS runtime-cpu

FROM compiler AS runtime-cuda
ENV NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

# ---- final image ------------------------------------------------------------------------------------------
# A stage of this file, picked by VARIANT (hadolint cannot tell it from an untagged image).
# hadolint ignore=DL3006
FROM runtime-${VARIANT} AS final
ARG VARIANT
LABEL org.opencontainers.image.description="OpenAI-compatible LLM serving engine (${VARIANT})" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN useradd --create-home --no-log-init --uid 10001 --user-group pagedserve
COPY --from=deps /opt/venv /opt/venv
WORKDIR /opt/pagedserve
COPY --from=model /opt/pagedserve/cache ./cache
COPY --from=kernels /opt/pagedserve/cpu-kernels ./cpu-kernels
COPY configs ./configs
COPY --from=builder /wheels /tmp/wheels
# The HEALTHCHECK runs the installed server/settings.py by its path (standard library only: no torch import).
RUN python -m pip install --no-cache-dir --no-deps /tmp/wheels/*.whl && rm -rf /tmp/wheels \
    && package=$(python -c "import importlib.util as u; print(u.find_spec('pagedserve').submodule_search_locations[0])") \
    && ln -s "$package/server/settings.py" /opt/pagedserve/healthcheck.py
ENV HF_HOME=/home/pagedserve/.cache/huggingface \
    PAGEDSERVE_VARIANT=${VARIANT} \
    PAGEDSERVE_KERNEL_PREBUILT_DIR=/opt/pagedserve/cpu-kernels \
    PAGEDSERVE_HOST=0.0.0.0 \
    PAGEDSERVE_PORT=8000 \
    PAGEDSERVE_SHUTDOWN_TIMEOUT=3
USER 10001:10001
# As the server's user, who can write neither: the baked model must be what the server finds (this fails the
# build instead of converting), and the kernels built ahead of time must load. The GGUF's mtime (part of the
# cache key) must survive a push and pull (layers keep whole seconds).
RUN HF_HUB_OFFLINE=1 python -m pagedserve.engine \
    && python -c "from pagedserve.engine.worker.weights.checkpoint import embedded_gguf_path as p; assert p().stat().st_mtime_ns % 10**9 == 0" \
    && if [ "$VARIANT" = "cpu" ]; then \
        python -c "from pagedserve.kernels.cpu_native import native_library as n, prebuilt_dirs as d; assert str(n()._name).startswith(str(d()[0]))"; \
    fi
EXPOSE 8000
# Liveness: /health is 200 while the engine core is alive (loading included); /ready is for readiness.
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-I", "/opt/pagedserve/healthcheck.py"]
ENTRYPOINT ["pagedserve", "serve"]
CMD []
