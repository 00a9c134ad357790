#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh), then trains the MNIST-1D example on 4 ranks with Adasum.
# NP=16 or extra arguments (e.g. --op mean) change the run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
exec mpiexec -n "${NP:-4}" python -m mpi4py examples/train.py "$@"
