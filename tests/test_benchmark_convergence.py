"""benchmarks/convergence.py at a toy size: the configurations it builds, one serial study and one over groups
of ranks, with a learning rate that must diverge. Checks the structure and sanity of the outputs, not timings
or accuracies."""

from __future__ import annotations

import importlib.util
import json
import math
import os

import pytest
from mpi4py import MPI

# Checked without importing them: mnist1d brings scipy, slow to import on every rank of every MPI run.
_missing = [m for m in ("mnist1d", "matplotlib") if importlib.util.find_spec(m) is None]
pytestmark = pytest.mark.skipif(bool(_missing), reason=f"needs {', '.join(_missing)} (the examples extra)")

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "convergence.py")
_spec = importlib.util.spec_from_file_location("benchmark_convergence", _PATH)
convergence = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(convergence)

# A few seconds: a tiny network on 200 signals, two epochs. ×1000 (lr 50) must diverge at once.
TINY = ["--epochs", "2", "--num-samples", "200", "--channels", "4", "--batch-size", "16", "--base-lr", "0.05",
        "--multipliers", "1,1000", "--target", "0.3", "--levels", "0.2"]
PNG = b"\x89PNG\r\n\x1a\n"


def test_configurations_cover_the_grid_once():
    configs = convergence.configurations([1, 2, 4], ["adasum", "mean", "sum"], [1, 2, 4, 8], [1, 4])
    assert len(configs) == 4 * 2 + 2 * 3 * 4 * 2
    assert len({c.name for c in configs}) == len(configs)
    assert {c.op for c in configs if c.world_size == 1} == {convergence.SINGLE}
    assert {c.op for c in configs if c.world_size == 2} == {"adasum", "mean", "sum"}


def test_world_sizes_beyond_the_job_are_refused_before_any_work(tmp_path):
    with pytest.raises(ValueError, match=r"world sizes \[2, 4\] need more ranks than the 1"):
        convergence.main([*TINY, "--world-sizes", "1,2,4", "--out", str(tmp_path / "c")], world=MPI.COMM_SELF)
    assert not os.listdir(tmp_path)


def _check_outputs(records, prefix, world_sizes, multipliers, figures=True, epochs=2):
    with open(prefix + ".json") as f:
        saved = json.load(f)
    assert saved["meta"]["complete"] is True
    assert saved["settings"]["epochs"] == epochs
    assert [r["name"] for r in saved["results"]] == [r["name"] for r in records]
    assert {r["world_size"] for r in records} == set(world_sizes)
    for r in records:
        hist = r["history"]
        assert 1 <= len(hist) - 1 == r["epochs_run"] <= epochs
        assert [h["epoch"] for h in hist] == list(range(len(hist)))  # epoch 0: the untrained model
        assert hist[0]["updates"] == 0 and hist[0]["train_loss"] is None
        assert all(0.0 <= h["test_accuracy"] <= 1.0 for h in hist)
        assert [h["updates"] for h in hist] == sorted(h["updates"] for h in hist)
        assert r["final_accuracy"] == hist[-1]["test_accuracy"]
        assert r["updates"] == hist[-1]["updates"] <= r["updates_per_epoch"] * r["epochs_run"]
        assert r["lr"] == pytest.approx(0.05 * r["multiplier"])
        assert r["global_batch"] == r["world_size"] * 16 * r["accumulation"]
        if r["epochs_to_target"] is not None:
            assert hist[r["epochs_to_target"]]["test_accuracy"] >= 0.3
            assert r["updates_to_target"] == hist[r["epochs_to_target"]]["updates"]
        if r["multiplier"] == 1000:
            assert r["diverged"] and r["divergence"] and r["diverged_epoch"] == r["epochs_run"]
        if not r["diverged"]:
            assert r["epochs_run"] == epochs and all(math.isfinite(h["train_loss"]) for h in hist[1:])
            assert r["divergence"] is None and r["diverged_epoch"] is None
    with open(prefix + ".md") as f:
        table = f.read()
    assert "| ranks | op | accum. | global batch | " + " | ".join(f"×{m}" for m in multipliers) + " |" in table
    assert table.count("div. @") >= len(world_sizes)
    for suffix in ("_accuracy.png", "_lr.png", "_epochs.png"):
        assert os.path.exists(prefix + suffix) == figures
        if figures:
            with open(prefix + suffix, "rb") as f:
                assert f.read(8) == PNG


def test_serial_study_records_divergence_and_writes_everything(tmp_path):
    prefix = str(tmp_path / "conv")
    records = convergence.main([*TINY, "--world-sizes", "1", "--accumulation", "1,2", "--out", prefix],
                               world=MPI.COMM_SELF)
    assert len(records) == 4
    _check_outputs(records, prefix, [1], [1, 1000])
    # The figures and tables can be redrawn from the JSON alone.
    again = str(tmp_path / "again")
    assert convergence.replot(prefix + ".json", again) == json.loads(json.dumps(records))
    with open(prefix + ".md") as f, open(again + ".md") as g:
        assert f.read() == g.read()
    assert os.path.exists(again + "_lr.png")


@pytest.mark.mpi(min_size=2)
def test_groups_of_ranks_train_every_configuration(mpi_tmp_path):
    comm = MPI.COMM_WORLD
    prefix = str(mpi_tmp_path / "conv")
    records = convergence.main([*TINY, "--world-sizes", "1,2", "--multipliers", "1,2,1000", "--accumulation", "1,2",
                                "--no-figures", "--out", prefix])
    if comm.Get_rank() != 0:
        assert records is None
        return
    assert len(records) == 3 * 2 + 3 * 3 * 2
    _check_outputs(records, prefix, [1, 2], [1, 2, 1000], figures=False)
    # With SGD the sum over two ranks is the mean at twice the learning rate: the same run (a check that the
    # op and the learning rate reach the optimizer).
    by = {r["name"]: r for r in records}
    for k in (1, 2):
        sums, means = by[f"P2-sum-x1-k{k}"]["history"], by[f"P2-mean-x2-k{k}"]["history"]
        assert [h["test_accuracy"] for h in sums] == pytest.approx([h["test_accuracy"] for h in means], abs=0.02)
