"""One job shared by two modules' tests (the elastic stage's time): tests/elastic/worker.py's plain run and
its elastic run with nobody dying (test_elastic.py), then, in the same processes, the three phases of
tests/elastic/paths_worker.py with a death in each (test_paths.py)."""

from __future__ import annotations

import json

import pytest

from jobs import launch

# HSDP: rank 3 (its replica partner is rank 2); the gradient hook: rank 1 (a middle rank of 0, 1, 2); the
# delta hook: rank 0 (the rendezvous host of the process group started again on the survivors).
PATHS_KILLS = ("3@3", "1@5", "0@3")


@pytest.fixture(scope="session")
def plain_then_paths(tmp_path_factory):
    """(the worker's result, the paths' result, {rank: time it was killed}) of the shared job."""
    tmp = tmp_path_factory.mktemp("plain-then-paths")
    result, _ = launch(tmp, 4, "--plain", *[a for k in PATHS_KILLS for a in ("--paths", k)])
    paths = tmp / "result.json.paths"
    assert paths.exists(), "the paths' phases wrote no result"
    killed = {int(p.name.rsplit(".", 1)[1]): float(p.read_text()) for p in tmp.glob("result.json.paths.killed.*")}
    return result, json.loads(paths.read_text()), killed
