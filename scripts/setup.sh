#!/usr/bin/env bash
# Creates .venv (if missing) and installs the package in editable mode with MPI (MPICH from PyPI), torch
# (the version requirements-dev.txt pins), the example's, the tests' and the documentation's dependencies.
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu bash scripts/setup.sh   # torch's CPU build
# (without it pip takes torch from the default index, which on Linux serves the CUDA build).
#
# Safe to run again: .venv/.setup-stamp holds a hash of what the install depends on (requirements-dev.txt,
# pyproject.toml, setup.py, the C kernels' sources, whether the built kernels are there, TORCH_INDEX_URL);
# while it matches, the script says so and does not call pip. Delete the stamp to force a reinstall.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
STAMP=.venv/.setup-stamp

say() { echo "[setup] $*"; }

inputs_hash() {
    "$1" - <<'EOF'
import glob, hashlib, os
h = hashlib.sha256()
for path in ["requirements-dev.txt", "pyproject.toml", "setup.py",
             *sorted(glob.glob("adasum/kernels/_kernels*.[ch]"))]:
    h.update(path.encode() + b"\0")
    with open(path, "rb") as f:
        h.update(f.read())
h.update(b"built:" + ",".join(sorted(glob.glob("adasum/kernels/_kernels*.so") + glob.glob("adasum/kernels/_kernels*.pyd"))).encode())
h.update(b"torch-index:" + os.environ.get("TORCH_INDEX_URL", "").encode())
print(h.hexdigest())
EOF
}

if [ -x .venv/bin/python ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$(inputs_hash .venv/bin/python)" ]; then
    say ".venv is up to date (requirements-dev.txt, pyproject.toml, setup.py and the C kernels unchanged since" \
        "the last install): nothing to do"
    exit 0
fi

if [ ! -x .venv/bin/python ]; then
    say "creating .venv with $("$PYTHON" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
    "$PYTHON" -m venv .venv
    say "upgrading pip in .venv"
    .venv/bin/python -m pip install --quiet --upgrade pip
fi
rm -f "$STAMP"
if [ -n "${TORCH_INDEX_URL:-}" ]; then
    torch_pin=$(grep -E '^torch[=<>~]' requirements-dev.txt)
    say "installing $torch_pin from $TORCH_INDEX_URL"
    .venv/bin/python -m pip install --index-url "$TORCH_INDEX_URL" "$torch_pin"
fi
say "installing requirements-dev.txt into .venv: adasum in editable mode (compiling its C kernels), MPICH," \
    "$(grep -E '^torch[=<>~]' requirements-dev.txt), the example's, the tests' and the docs' dependencies," \
    "Lightning, Accelerate and transformers"
say "the first time this downloads about 1.7 GB (torch's CUDA build; less with TORCH_INDEX_URL) and takes" \
    "several minutes; later runs only check"
.venv/bin/python -m pip install -r requirements-dev.txt
inputs_hash .venv/bin/python > "$STAMP"
say "done: .venv is ready (.venv/bin/python -m adasum prints what is installed)"
