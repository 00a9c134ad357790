#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh), then runs the serial tests and the MPI tests at several world
# sizes, one of them not a power of two. Extra arguments go to every pytest run (e.g. -k halving).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python scripts/run_tests.py "$@"
