#!/usr/bin/env bash
# Builds the documentation site (mkdocs.yml, docs/) into site/ with --strict: a broken link, a missing page
# or anchor, or a docstring mkdocstrings cannot read fails the build. Needs the `docs` extra
# (requirements-dev.txt installs it into .venv). Extra arguments go to mkdocs build (e.g. -d DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
MKDOCS=${MKDOCS:-.venv/bin/mkdocs}
NO_MKDOCS_2_WARNING=1 exec "$MKDOCS" build --strict --site-dir site "$@"
