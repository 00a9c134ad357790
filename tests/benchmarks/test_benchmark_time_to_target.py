"""benchmarks/time_to_target.py at toy size in one MPI job (no emulated hosts): every contender's record, the
summary over seeds, and the report (tables and plot) over the JSON it writes."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import tempfile

import pytest

_missing = [m for m in ("mnist1d", "matplotlib") if importlib.util.find_spec(m) is None]
pytestmark = pytest.mark.skipif(bool(_missing), reason=f"needs {', '.join(_missing)} (the examples extra)")

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks",
                     "time_to_target.py")
_spec = importlib.util.spec_from_file_location("benchmark_time_to_target", _PATH)
ttt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ttt)

# 200 signals: 160 to train, 8 per micro-batch; 2 epochs, 2 evaluations each; a target reached at once.
TOY = ["--task", "mnist1d", "--set", "num_samples=200", "--set", "channels=4", "--set", "epochs=2",
       "--set", "batch_size=8", "--set", "evals_per_epoch=2", "--set", "target=0.0", "--local-steps", "3",
       "--cache", "", "--contenders", "local,ddp,adasum-x1-H4-delay"]


@pytest.mark.mpi(min_size=2)
@pytest.mark.world_size(2, 3)  # micro-batches that the ranks divide evenly and ones they do not
@pytest.mark.timeout(120)
def test_toy_run_records_every_contender_and_reports(comm, capsys):
    size, rank = comm.Get_size(), comm.Get_rank()
    root = comm.bcast(tempfile.mkdtemp() if rank == 0 else None, root=0)
    path = os.path.join(root, f"mnist1d-local-{size}h.json")
    result = ttt.main([*TOY, "--worker", "--json", path])
    comm.Barrier()
    if rank != 0:
        assert result is None
        return
    saved = json.load(open(path))
    assert saved["hosts"] == size and saved["task"] == "mnist1d" and saved["target"] == 0.0
    assert len(saved["loadavg_start"]) == 3 and len(saved["loadavg_end"]) == 3
    runs = {r["contender"]: r for r in saved["runs"]}
    assert list(runs) == ["local", "ddp", "adasum-x1-H4-delay"]
    assert runs["local"]["steps"] == 3 and runs["local"]["mean_step_s"] > 0
    micro = math.ceil((160 - 160 % size) // size / 8)  # micro-batches per epoch and rank
    params = runs["ddp"]["parameters"]
    for name in ("ddp", "adasum-x1-H4-delay"):
        r = runs[name]
        h = r["history"]
        assert len(h) == 1 + 2 * 2  # the untrained model, then two evaluations per epoch
        assert [e["seconds"] for e in h] == sorted(e["seconds"] for e in h) and h[0]["seconds"] < h[-1]["seconds"]
        assert r["train_seconds"] == h[-1]["seconds"] and r["steps"] == 2 * micro
        assert r["mean_step_s"] == pytest.approx(r["train_seconds"] / r["steps"])
        assert r["seconds_to_target"] == h[0]["seconds"] and r["final"] == h[-1]["metric"]
        assert r["parameters"] == params and r["model_bytes"] == 4 * params
        assert r["bytes_by_count"] == r["combines"] * 4 * params
        assert r["bytes_counted"] is None  # no emulated host's interface here
        assert len(r["loadavg_before"]) == 3 and len(r["loadavg_after"]) == 3
    assert runs["ddp"]["combines"] == 2 * micro  # one allreduce per step
    assert runs["adasum-x1-H4-delay"]["combines"] == 2 * math.ceil(micro / 4)  # every epoch ends with a combine
    summary = saved["summary"]
    assert set(summary) == set(runs)
    for name in ("ddp", "adasum-x1-H4-delay"):
        row = summary[name]
        assert row["reached"] == 1 and row["step_over_local"] == pytest.approx(
            runs[name]["mean_step_s"] / runs["local"]["mean_step_s"])
        assert row["time_over_ddp"] == pytest.approx(runs[name]["seconds_to_target"] /
                                                     runs["ddp"]["seconds_to_target"])
    capsys.readouterr()
    ttt.main(["--plot-only", "--out", root])
    out = capsys.readouterr().out
    assert f"mnist1d, {size} hosts at local" in out and "| adasum-x1-H4-delay |" in out
    merged = json.load(open(os.path.join(root, "results.json")))
    assert merged["mnist1d"]["local"][str(size)]["summary"] == summary
    assert os.path.getsize(os.path.join(root, "time_to_target.png")) > 0
