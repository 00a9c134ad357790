#!/usr/bin/env bash
# Creates .venv (if missing) and installs the package with MPI (MPICH from PyPI), torch (CPU build,
# pinned), the example's and the tests' dependencies. Safe to run again: pip skips what is there.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
    .venv/bin/python -m pip install --quiet --upgrade pip
fi
.venv/bin/python -m pip install --quiet -r requirements-dev.txt
