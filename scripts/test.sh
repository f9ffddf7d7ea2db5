#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export OPENTAU_CACHE_DIR="${OPENTAU_CACHE_DIR:-$PWD/.cache/opentau}"
.venv/bin/python -m pytest -q "$@"
