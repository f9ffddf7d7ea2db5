#!/usr/bin/env bash
# Create .venv and install opentau with its test and video extras. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
# The CPU build of torch 2.13 is what these machines install offline; on a GPU machine pip picks the CUDA build
# of the same version from its index (set PIP_INDEX_URL / TORCH_SPEC to choose another).
.venv/bin/python -m pip install --quiet "${TORCH_SPEC:-torch==2.13.0}"
.venv/bin/python -m pip install --quiet -e '.[dev]'
