"""benchmarks/fsdp_replicas.py --quick at 4 ranks (a 2×2 mesh): every variant times its steps and the
ratios to native HSDP come out as the medians of the rounds' ratios."""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import tempfile

import pytest

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks",
                     "fsdp_replicas.py")
_spec = importlib.util.spec_from_file_location("benchmark_fsdp_replicas", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


@pytest.mark.mpi(min_size=4)
@pytest.mark.world_size(4)
@pytest.mark.fsdp
@pytest.mark.timeout(300)
def test_quick_run(comm, pg, capsys):
    root = comm.bcast(tempfile.mkdtemp() if comm.Get_rank() == 0 else None, root=0)
    path = os.path.join(root, "fsdp.json")
    results = bench.main(["--quick", "--json", path])
    comm.Barrier()
    assert results["mesh"] == [2, 2]
    assert all(len(r) == 2 and all(t > 0 for t in r) for r in results["rounds_s"].values())
    for v in ("mean", "adasum"):
        want = statistics.median(a / b for a, b in zip(results["rounds_s"][v], results["rounds_s"]["native"]))
        assert results["ratio_to_native"][v] == pytest.approx(want)
    if comm.Get_rank() == 0:
        assert json.load(open(path))["ratio_to_native"] == results["ratio_to_native"]
        out = capsys.readouterr().out
        assert "adasum / native:" in out and "mesh 2x2" in out
