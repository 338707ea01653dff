#!/usr/bin/env bash
# The wheels specdecode needs beyond what a GPU machine's image usually holds (PyTorch, Triton, transformers,
# tokenizers, numpy, scipy, pytest, click, h11, anyio), for a machine that cannot reach PyPI: fetched here into
# DIR (default .whl) for CPython 3.12 on x86-64 Linux (PYTHON_VERSION to change), each without its dependencies
# (the image's numpy and torch must not be shadowed). There:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site DIR/*.whl
#   export PYTHONPATH=/tmp/site:$PWD/src; python3 tools/cuda_check.py --out results
set -euo pipefail
dir=${1:-.whl}
fetch() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${PYTHON_VERSION:-3.12}" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$dir" "$@"
}
fetch gguf fastapi starlette uvicorn pydantic annotated-types typing-inspection typing-extensions llguidance \
  annotated-doc opentelemetry-api  # fastapi's since 0.12x
# pydantic pins its compiled core exactly
core=$(unzip -p "$dir"/pydantic-2*.whl '*/METADATA' | sed -n 's/^Requires-Dist: pydantic-core==\([0-9.]*\).*/\1/p')
fetch "pydantic-core==$core"
ls "$dir"
