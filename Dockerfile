# syntax=docker/dockerfile:1
# pagedserve: an OpenAI-compatible LLM server.
#
#   docker build -t pagedserve:cpu .                               # CPU image (default), embedded SmolLM2 baked in
#   docker build -t pagedserve:cuda --build-arg VARIANT=cuda .      # CUDA image: CUDA torch + Triton kernels
#   docker run --rm -p 8000:8000 pagedserve:cpu                    # serves the embedded model on :8000
#   docker run --rm --gpus all -p 8000:8000 pagedserve:cuda --host 0.0.0.0 --config configs/llama3-8b-h200.yaml
#
# Arguments after the image name replace CMD and go to `pagedserve serve`; keep `--host 0.0.0.0` when you do.
# Stopping: the default CMD lets requests in flight run on for 3 s after SIGTERM, then ends the rest with an error
# event; with the engine's own shutdown (~2.5-4 s here) that fits `docker stop`'s 10 s grace. For a longer drain
# give both: `docker run --stop-timeout 45 ... pagedserve:cpu --host 0.0.0.0 --shutdown-timeout 30`.
#
# Layers, for a cache that survives code changes: the dependencies come from pyproject.toml's dependency lists
# alone (stages requirements, deps), the embedded model is converted in a stage of its own whose output only
# changes with the model (stage model), and the project itself is a small wheel installed last.

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

# ---- runtimes: what each variant needs besides the venv ---------------------------------------------------
# Both compile C at first use, for the CPU or GPU they run on: the CPU kernels (kernels/cpu_native.py, built
# with -march=native, so not at image build time) and Triton's kernel launchers. That needs a C compiler and
# libc headers; their versions are left to the base image's Debian release (point releases replace pinned
# versions).
FROM base AS runtime-common
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && apt-get clean \
    && rm -rf /var/lib/apt/lists/*

FROM runtime-common AS runtime-cpu

FROM runtime-common AS runtime-cuda
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
COPY configs ./configs
COPY --from=builder /wheels /tmp/wheels
RUN python -m pip install --no-cache-dir --no-deps /tmp/wheels/*.whl && rm -rf /tmp/wheels
ENV HF_HOME=/home/pagedserve/.cache/huggingface \
    PAGEDSERVE_VARIANT=${VARIANT}
USER 10001:10001
# The baked model must be what the server finds: as the server's user, who cannot write the cache, this fails
# the build instead of converting. The GGUF's mtime (part of the cache key) must survive a push and pull
# (layers keep whole seconds).
RUN HF_HUB_OFFLINE=1 python -m pagedserve.engine \
    && python -c "from pagedserve.engine.worker.weights.checkpoint import embedded_gguf_path as p; assert p().stat().st_mtime_ns % 10**9 == 0"
EXPOSE 8000
# Liveness: /health is 200 while the engine core is alive (loading included); /ready is for readiness.
# Set PAGEDSERVE_PORT (read only here) when CMD serves on another port.
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('PAGEDSERVE_PORT', '8000'), timeout=4)"]
ENTRYPOINT ["pagedserve", "serve"]
CMD ["--host", "0.0.0.0", "--port", "8000", "--shutdown-timeout", "3"]
