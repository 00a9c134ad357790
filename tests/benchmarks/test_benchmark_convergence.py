"""benchmarks/convergence.py at toy sizes: the grid it builds, the learning-rate rules, the choice of the base
rate, one serial study and one over groups of ranks with a rate that must diverge. Checks the structure and
sanity of the outputs and identities between schedules, not accuracies."""

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

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks", "convergence.py")
_spec = importlib.util.spec_from_file_location("benchmark_convergence", _PATH)
convergence = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(convergence)

PNG = b"\x89PNG\r\n\x1a\n"
# A few seconds: tiny networks, two epochs of MNIST-1D, one of text. lr 1000 must diverge at once.
TINY = ["--set", "mnist1d.num_samples=300", "--set", "mnist1d.channels=4", "--set", "mnist1d.epochs=2",
        "--set", "mnist1d.batch_size=16", "--set", "mnist1d.lrs=[0.05,1000]", "--set", "mnist1d.target=0.3",
        "--set", "mnist1d.levels=[0.2]", "--set", "mnist1d.warmup_epochs=1",
        "--set", "chars.chars=6000", "--set", "chars.valid_chars=400", "--set", "chars.context=16",
        "--set", "chars.width=16", "--set", "chars.layers=1", "--set", "chars.heads=2", "--set", "chars.epochs=1",
        "--set", "chars.batch_size=8", "--set", "chars.lrs=[0.003,1000]", "--set", "chars.target=6.0",
        "--set", "chars.levels=[6.5]", "--set", "chars.warmup_epochs=0.5"]


def test_grid_has_every_schedule_seed_and_reference():
    s = convergence.presets(quick=False)["mnist1d"]
    grid = convergence.grid_configs("mnist1d", s, 3, 0.03)
    assert len({c.name for c in grid}) == len(grid)
    for k, sizes, schedules in s["grid"]:
        for p in sizes:
            for name in schedules:
                assert sorted(c.seed for c in grid if (c.world_size, c.schedule, c.accumulation) == (p, name, k)) \
                    == [0, 1, 2]
        # every accumulation but 1 has its one-rank reference; at k = 1 the sweep provides it
        singles = [c for c in grid if c.world_size == 1 and c.accumulation == k]
        assert len(singles) == (0 if k == 1 else 3)
    assert {c.base_lr for c in grid} == {0.03}
    assert 6 in {c.world_size for c in grid}  # a world size that is not a power of two
    sweep = convergence.sweep_configs("mnist1d", s, 3)
    assert len(sweep) == 3 * len(s["lrs"]) and {c.world_size for c in sweep} == {1}


def test_schedules_scale_the_learning_rate():
    sch = convergence.SCHEDULES
    assert sch["adasum-x1"].factor(16) == 1 and sch["adasum-x2"].factor(16) == 2
    assert sch["mean-sqrtP"].factor(16) == 4 and sch["mean-sqrtP"].factor(6) == pytest.approx(math.sqrt(6))
    assert sch["mean-linear-warmup"].factor(12) == 12 and sch["mean-linear-warmup"].warmup
    assert not sch["mean-sqrtP"].warmup and sch["adasum-x1-warmup"].warmup
    assert {s.op for s in sch.values()} == {"adasum", "adasum-grad", "mean", "sum"}


def test_warmup_rises_linearly_to_the_peak():
    rates = [convergence.learning_rate(0.8, u, 4) for u in range(6)]
    assert rates == pytest.approx([0.2, 0.4, 0.6, 0.8, 0.8, 0.8])
    assert convergence.learning_rate(0.8, 0, 0) == 0.8


def _record(lr, seed, final, diverged=False):
    return {"task": "mnist1d", "base_lr": lr, "seed": seed, "final": final, "epochs_to_target": None,
            "diverged": diverged}


def test_base_rate_is_the_best_median_not_the_best_seed():
    records = [_record(0.1, 0, 0.95), _record(0.1, 1, 0.10, True), _record(0.1, 2, 0.12, True),
               _record(0.03, 0, 0.90), _record(0.03, 1, 0.91), _record(0.03, 2, 0.89)]
    base, rows = convergence.choose_base(records)
    assert base == 0.03
    assert [r["diverged"] for r in rows] == [0, 2]
    assert rows[0]["final"] == {"median": 0.90, "min": 0.89, "max": 0.91}
    # a rate that diverges in most seeds loses even where its last accuracy looks good
    records = [_record(0.1, s, 0.5, diverged=s > 0) for s in range(3)] + [_record(0.01, s, 0.2) for s in range(3)]
    assert convergence.choose_base(records)[0] == 0.01


def test_unknown_settings_are_refused():
    with pytest.raises(SystemExit):
        convergence.parse_args(["--set", "mnist1d.no_such_setting=1"])
    with pytest.raises(SystemExit):
        convergence.parse_args(["--tasks", "imagenet"])


def test_world_sizes_beyond_the_job_are_refused_before_any_work(tmp_path):
    with pytest.raises(ValueError, match=r"world size 2 needs more ranks than the 1"):
        convergence.main([*TINY, "--set", 'mnist1d.grid=[[1,[2],["adasum-x1"]]]', "--tasks", "mnist1d",
                          "--out", str(tmp_path)], world=MPI.COMM_SELF)
    assert not os.listdir(tmp_path)


def _check(study, out, figures=True, diverging=True):
    with open(os.path.join(out, "study.json")) as f:
        saved = json.load(f)
    assert saved["meta"]["complete"] is True
    assert [r["name"] for r in saved["results"]] == [r["name"] for r in study["results"]]
    for t, base in study["base_lr"].items():
        assert base in saved["settings"][t]["lrs"]
        if diverging:  # TINY sweeps lr 1000 too: it must diverge, and never be the base
            assert base != 1000
            assert [r for r in saved["sweep_runs"] if r["task"] == t and r["base_lr"] == 1000]
            assert all(r["diverged"] for r in saved["sweep_runs"] if r["base_lr"] == 1000)
        epochs = saved["settings"][t]["epochs"]
        for r in (r for r in study["results"] if r["task"] == t):
            hist = r["history"]
            assert hist[0]["epoch"] == 0 and hist[0]["updates"] == 0 and hist[0]["train_loss"] is None
            assert [h["epoch"] for h in hist] == sorted(h["epoch"] for h in hist)
            assert r["final"] == hist[-1]["metric"] and r["updates"] == hist[-1]["updates"]
            assert r["lr"] == pytest.approx(base * convergence.SCHEDULES[r["schedule"]].factor(r["world_size"]))
            if not r["diverged"]:
                assert hist[-1]["epoch"] == epochs and all(math.isfinite(h["train_loss"]) for h in hist[1:])
                assert r["updates"] == r["updates_per_epoch"] * epochs
            if r["epochs_to_target"] is not None:
                h = next(h for h in hist if h["epoch"] == r["epochs_to_target"])
                assert (h["metric"] >= saved["settings"][t]["target"]) == convergence.TASKS[t].higher
    # one row per configuration in the summary, every seed in it
    for row in saved["summary"]:
        assert row["seeds"] == list(range(saved["meta"]["seeds"]))
    with open(os.path.join(out, "study.md")) as f:
        text = f.read()
    for t in study["base_lr"]:
        assert f"## {t}" in text and f"(base rate: {study['base_lr'][t]:g})" in text
        ks = {r["accumulation"] for r in study["results"] if r["task"] == t and r["schedule"] != "single"}
        drawn = figures and bool(ks)
        for name in ("study.json", "study.md", f"{t}_epochs.png", *(f"{t}_curves_k{k}.png" for k in ks)):
            path = os.path.join(out, name)
            assert os.path.exists(path) == (drawn or not name.endswith(".png"))
            if drawn and name.endswith(".png"):
                with open(path, "rb") as f:
                    assert f.read(8) == PNG


def test_serial_study_chooses_a_base_rate_and_writes_everything(tmp_path):
    out = str(tmp_path / "conv")
    study = convergence.main([*TINY, "--seeds", "2", "--set", 'mnist1d.grid=[[2,[1],["adasum-x1","mean-x1"]]]',
                              "--set", "chars.grid=[]", "--out", out], world=MPI.COMM_SELF)
    _check(study, out)
    assert sorted({(r["world_size"], r["accumulation"]) for r in study["results"] if r["task"] == "mnist1d"}) \
        == [(1, 1), (1, 2)]
    # The figures and tables can be redrawn from the JSON alone.
    again = str(tmp_path / "again")
    redrawn = convergence.replot(os.path.join(out, "study.json"), again)
    assert redrawn["base_lr"] == study["base_lr"]
    with open(os.path.join(out, "study.md")) as f, open(os.path.join(again, "study.md")) as g:
        assert f.read() == g.read()
    assert os.path.exists(os.path.join(again, "mnist1d_epochs.png"))


@pytest.mark.mpi(min_size=2)
@pytest.mark.world_size(3, 4)  # configurations dealt to one group and a rank left over, and to two groups at once
def test_groups_of_ranks_train_every_configuration(mpi_tmp_path):
    comm = MPI.COMM_WORLD
    out = str(mpi_tmp_path / "conv")
    # warmup_epochs=0: mean ×P + warmup is the mean at P × the rate from the first update, which with SGD
    # is the sum at × 1: the same run.
    study = convergence.main([*TINY, "--set", "mnist1d.warmup_epochs=0", "--set",
                              'mnist1d.grid=[[1,[2],["adasum-x1","mean-linear-warmup","sum-x1"]]]',
                              "--set", 'chars.grid=[[1,[2],["adasum-x1","mean-sqrtP"]]]', "--no-figures",
                              "--out", out])
    if comm.Get_rank() != 0:
        assert study is None
        return
    _check(study, out, figures=False)
    assert {(r["task"], r["world_size"]) for r in study["results"]} == {("mnist1d", 1), ("mnist1d", 2),
                                                                       ("chars", 1), ("chars", 2)}
    by = {r["name"]: r for r in study["results"]}
    base = study["base_lr"]["mnist1d"]
    for seed in range(3):
        sums = by[f"mnist1d-P2-sum-x1-k1-lr{base:g}-s{seed}"]["history"]
        means = by[f"mnist1d-P2-mean-linear-warmup-k1-lr{base:g}-s{seed}"]["history"]
        assert [h["metric"] for h in sums] == pytest.approx([h["metric"] for h in means], abs=0.02)


@pytest.mark.mpi(min_size=2)
@pytest.mark.world_size(2)  # its runs are at world size 2 whatever the job's size
def test_gradient_adasum_with_plain_sgd_is_delta_adasum(mpi_tmp_path):
    """The DDP gradient hook's schedule against DistributedOptimizer's: with SGD without momentum the
    delta is -lr·gradient, and Adasum(c·a, c·b) = c·Adasum(a, b), so the runs agree."""
    comm = MPI.COMM_WORLD
    study = convergence.main([*TINY, "--tasks", "mnist1d", "--set", "mnist1d.momentum=0", "--set",
                              "mnist1d.lrs=[0.05]", "--set",
                              'mnist1d.grid=[[1,[2],["adasum-x1","adasum-grad-x1"]]]', "--seeds", "1",
                              "--no-figures", "--out", str(mpi_tmp_path / "grad")])
    if comm.Get_rank() != 0:
        return
    by = {r["schedule"]: r for r in study["results"] if r["world_size"] == 2}
    grads, deltas = by["adasum-grad-x1"]["history"], by["adasum-x1"]["history"]
    assert by["adasum-grad-x1"]["op"] == "adasum-grad" and len(grads) == len(deltas) > 1
    assert [h["test_loss"] for h in grads] == pytest.approx([h["test_loss"] for h in deltas], rel=1e-4)


_QUICK = os.environ.get("ADASUM_CONVERGENCE_QUICK")


@pytest.mark.skipif(not _QUICK, reason="checks a finished --quick run (scripts/run_tests.py runs one and "
                                       "names its folder in ADASUM_CONVERGENCE_QUICK)")
def test_quick_outputs():
    """The outputs of ``benchmarks/convergence.py --quick``: both tasks, every configuration of the preset
    with 3 seeds, a world size that is not a power of two, and the figures."""
    with open(os.path.join(_QUICK, "study.json")) as f:
        saved = json.load(f)
    study = {k: saved[k] for k in ("sweeps", "base_lr", "results")}
    assert saved["meta"]["seeds"] == 3
    _check(study, _QUICK, diverging=False)
    assert set(study["base_lr"]) == set(convergence.DEFAULT_TASKS)
    for t, s in convergence.presets(quick=True).items():
        if t not in convergence.DEFAULT_TASKS:
            continue
        want = convergence.grid_configs(t, s, 3, study["base_lr"][t])
        names = {r["name"] for r in study["results"]}
        assert {c.name for c in want} <= names
        assert {c.world_size for c in want} & {3, 6}
        assert saved["sweeps"][t] and len(saved["sweeps"][t]) == len(s["lrs"])
