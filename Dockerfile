# syntax=docker/dockerfile:1
# pagedserve: an OpenAI-compatible LLM server.
#
#   docker build -t pagedserve:cpu .                               # CPU image (default), embedded SmolLM2 baked in
#   docker build -t pagedserve:cuda --build-arg VARIANT=cuda .      # CUDA image: CUDA torch + Triton kernels
#   docker run --rm -p 8000:8000 pagedserve:cpu                    # serves the embedded model on :8000
#   docker run --rm --gpus all -p 8000:8000 pagedserve:cuda --host 0.0.0.0 --config configs/llama3-8b-h200.yaml
#
# Arguments after the image name replace CMD and go to `pagedserve serve`; keep `--host 0.0.0.0` when you do.

ARG VARIANT=cpu
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

# ---- common base: a Python with the venv on PATH ---------------------------------------------------------
FROM ${PYTHON_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PAGEDSERVE_CACHE_DIR=/opt/pagedserve/cache

# ---- builder: torch, the project and the embedded model into /opt/venv ----------------------------------
FROM base AS builder
ARG VARIANT
# cpu: the CPU-only torch build (~200 MB instead of several GB); cuda: PyPI's Linux torch, a CUDA 12 build
# that carries its own CUDA libraries. Override with --build-arg TORCH_INDEX_URL_CPU=... or TORCH_INDEX_URL_CUDA=...
# (e.g. https://download.pytorch.org/whl/cu128 for another CUDA build).
ARG TORCH_INDEX_URL_CPU=https://download.pytorch.org/whl/cpu
ARG TORCH_INDEX_URL_CUDA=
ARG TORCH_SPEC=torch==2.13.0
WORKDIR /src
RUN python -m venv /opt/venv
COPY pyproject.toml README.md __init__.py ./
COPY engine ./engine
COPY kernels ./kernels
COPY server ./server
COPY docker/install.sh ./docker/install.sh
RUN if [ "$VARIANT" = "cuda" ]; then \
        index="$TORCH_INDEX_URL_CUDA"; extras=triton; \
    elif [ "$VARIANT" = "cpu" ]; then \
        index="$TORCH_INDEX_URL_CPU"; extras=""; \
    else \
        echo "VARIANT must be cpu or cuda, not $VARIANT" >&2; exit 1; \
    fi \
    && TORCH_SPEC="$TORCH_SPEC" TORCH_INDEX_URL="$index" EXTRAS="$extras" \
       sh docker/install.sh /opt/venv/bin/python /src

# ---- runtimes: what each variant needs besides the venv ---------------------------------------------------
# Both compile C at first use, for the CPU or GPU they run on: the CPU decode-attention kernel
# (kernels/cpu_native.py) and Triton's kernel launchers. That needs a C compiler and libc headers; their
# versions are left to the base image's Debian release (point releases replace pinned versions).
FROM base AS runtime-common
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
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
LABEL org.opencontainers.image.title="pagedserve" \
      org.opencontainers.image.description="OpenAI-compatible LLM serving engine (${VARIANT})" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN useradd --create-home --no-log-init --uid 10001 --user-group pagedserve
COPY --from=builder /opt/venv /opt/venv
WORKDIR /opt/pagedserve
COPY configs ./configs
# Convert the embedded GGUF now, so a container serves in seconds; the result is readable by the server's user,
# not writable by it. The check fails the build if the GGUF's mtime (part of the cache key) would not survive
# a push and pull (layers keep whole seconds).
RUN HF_HUB_OFFLINE=1 python -m pagedserve.engine \
    && python -c "from pagedserve.engine.loader import embedded_gguf_path as p; assert p().stat().st_mtime_ns % 10**9 == 0" \
    && chmod -R a+rX,go-w "$PAGEDSERVE_CACHE_DIR"
ENV HF_HOME=/home/pagedserve/.cache/huggingface \
    PAGEDSERVE_VARIANT=${VARIANT}
USER 10001:10001
EXPOSE 8000
# Liveness: /health is 200 while the engine core is alive (loading included); /ready is for readiness.
# Set PAGEDSERVE_PORT (read only here) when CMD serves on another port.
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('PAGEDSERVE_PORT', '8000'), timeout=4)"]
ENTRYPOINT ["pagedserve", "serve"]
CMD ["--host", "0.0.0.0", "--port", "8000"]
