#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh: .venv with the `docs` extra), then builds the documentation site
# (mkdocs.yml, docs/) into site/ with --strict: a broken link, a missing page or anchor, or a docstring
# mkdocstrings cannot read fails the build. The site works opened from disk (site/index.html); extra
# arguments go to mkdocs build (e.g. -d DIR). MKDOCS=path/to/mkdocs uses another mkdocs and skips the set-up.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${MKDOCS:-}" ]; then
    bash scripts/setup.sh
    MKDOCS=.venv/bin/mkdocs
fi
NO_MKDOCS_2_WARNING=1 "$MKDOCS" build --strict --site-dir site "$@"
echo "built the documentation site: open index.html in its folder (site/index.html unless -d DIR) in a browser"
