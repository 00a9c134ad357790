#!/usr/bin/env bash
# Creates .venv (if missing) and installs the package in editable mode with MPI (MPICH from PyPI), torch
# (the version requirements-dev.txt pins), the example's and the tests' dependencies. Safe to run again:
# pip skips what is there.
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu bash scripts/setup.sh   # torch's CPU build
# (without it pip takes torch from the default index, which on Linux serves the CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
    .venv/bin/python -m pip install --quiet --upgrade pip
fi
if [ -n "${TORCH_INDEX_URL:-}" ]; then
    .venv/bin/python -m pip install --quiet --index-url "$TORCH_INDEX_URL" "$(grep -E '^torch[=<>~]' requirements-dev.txt)"
fi
.venv/bin/python -m pip install --quiet -r requirements-dev.txt
