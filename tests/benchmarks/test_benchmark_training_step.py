"""benchmarks/training_step.py --quick runs every variant (local, adasum and mean with and without
overlap and compression, torch DDP over gloo) on both models, and its report writes a table and a PNG."""

from __future__ import annotations

import importlib.util
import json
import os
import tempfile

import pytest

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks",
                     "training_step.py")
_spec = importlib.util.spec_from_file_location("benchmark_training_step", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


@pytest.mark.mpi(min_size=1)
@pytest.mark.world_size(2)
@pytest.mark.timeout(300)
def test_quick_run_and_report(comm, capsys):
    root = comm.bcast(tempfile.mkdtemp() if comm.Get_rank() == 0 else None, root=0)
    path = os.path.join(root, f"np{comm.Get_size()}.json")
    bench.main(["--quick", "--json", path])
    comm.Barrier()
    if comm.Get_rank() == 0:
        results = json.load(open(path))
        assert results["size"] == comm.Get_size()
        for name in ("mlp", "transformer"):
            m = results["models"][name]
            assert set(m["median_s"]) == set(bench.VARIANTS)
            assert all(t > 0 for t in m["median_s"].values())
            assert m["overhead_s"]["local"] == 0
            assert all(len(r) == 2 for r in m["rounds_s"].values())
        png = os.path.join(root, "steps.png")
        bench.main(["--report", path, "--png", png])
        out = capsys.readouterr().out
        assert "adasum-overlap-bf16" in out and "ddp" in out and os.path.getsize(png) > 0


@pytest.mark.mpi(min_size=1)
@pytest.mark.world_size(1)
@pytest.mark.timeout(300)
def test_scaling_report_tabulates_and_plots_runs(comm, capsys):
    """benchmarks/scaling.py --plot-only merges runs named {rate}-{hosts}h.json and 1h.json into a table of
    step / limit and step / DDP per rate and host count, and a plot."""
    spec = importlib.util.spec_from_file_location("benchmark_scaling", os.path.join(os.path.dirname(_PATH),
                                                                                   "scaling.py"))
    scaling = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(scaling)
    root = comm.bcast(tempfile.mkdtemp() if comm.Get_rank() == 0 else None, root=0)
    run = os.path.join(root, "1gbit-2h.json")
    bench.main(["--quick", "--models", "mlp", "--variants", "local,adasum-overlap,ddp", "--json", run])
    comm.Barrier()
    if comm.Get_rank() == 0:
        results = json.load(open(run))
        limit = results["models"]["mlp"]["limit_s"]
        assert limit["fp32"] > 0 and limit["16bit"] > 0
        os.link(run, os.path.join(root, "1h.json"))
        scaling.main(["--plot-only", "--out", root])
        text = open(os.path.join(root, "tables.md")).read()
        med = results["models"]["mlp"]["median_s"]
        want = f"| adasum-overlap | {1e3 * med['adasum-overlap']:.0f} | " \
               f"{med['adasum-overlap'] / limit['fp32']:.2f} | {med['adasum-overlap'] / med['ddp']:.2f} |"
        assert "mlp, 2 hosts at 1gbit" in text and want in text, text
        rounds = results["models"]["mlp"]["rounds_s"]  # --quick: 2 rounds, whose median is their mean
        r = sorted(a / b for a, b in zip(rounds["adasum-overlap"], rounds["local"]))
        assert f"| mlp | 1gbit | 2 | adasum-overlap | {(r[0] + r[1]) / 2:.2f} [{r[0]:.2f}, {r[1]:.2f}] |" in text, text
        assert os.path.getsize(os.path.join(root, "scaling.png")) > 0
        assert set(json.load(open(os.path.join(root, "results.json")))) == {"local", "1gbit"}


@pytest.mark.mpi(min_size=1)
@pytest.mark.world_size(2)
@pytest.mark.timeout(300)
def test_local_steps_variants_time_whole_windows(comm, capsys):
    """Variants ``-H<N>`` and ``-H<N>-delay`` train with ``local_steps=N`` (and ``delay=1``); their turns are
    whole windows: ``--quick``'s 2 steps rounded up to 4 for H = 4, kept at 2 for the others."""
    root = comm.bcast(tempfile.mkdtemp() if comm.Get_rank() == 0 else None, root=0)
    path = os.path.join(root, "local.json")
    variants = ["local", "adasum", "adasum-H4", "adasum-H4-delay", "mean-H4-delay", "ddp"]
    bench.main(["--quick", "--models", "mlp", "--variants", ",".join(variants), "--json", path])
    comm.Barrier()
    if comm.Get_rank() == 0:
        results = json.load(open(path))
        assert results["local_steps"] == {"adasum-H4": [4, 0], "adasum-H4-delay": [4, 1], "mean-H4-delay": [4, 1]}
        assert results["turn_steps"] == {"local": 2, "adasum": 2, "adasum-H4": 4, "adasum-H4-delay": 4,
                                         "mean-H4-delay": 4, "ddp": 2}
        m = results["models"]["mlp"]
        assert list(m["median_s"]) == variants and all(t > 0 for t in m["median_s"].values())
        assert all(len(r) == 2 for r in m["rounds_s"].values())
        out = capsys.readouterr().out
        assert "adasum-H4-delay" in out and "mean-H4-delay" in out
