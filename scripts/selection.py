"""A pytest plugin for scripts/run_tests.py: after collection (and after ``-k``/``-m`` deselection) it writes
the selected tests to the JSON file named by $ADASUM_SELECTION, one entry per test: its node id, its
markers' names and its ``world_size`` sizes (None when unmarked). The runner reads it to start only the
runs (serial, MPI sizes, frameworks, numpy kernels, emulated nodes, the convergence check, the docs) that
the selection touches."""

from __future__ import annotations

import json
import os


def pytest_collection_finish(session) -> None:
    path = os.environ.get("ADASUM_SELECTION")
    if not path:
        return
    found = []
    for item in session.items:
        sizes = item.get_closest_marker("world_size")
        found.append({"id": item.nodeid, "marks": sorted({m.name for m in item.iter_markers()}),
                      "sizes": list(sizes.args) if sizes is not None else None})
    with open(path, "w") as f:
        json.dump(found, f)
