"""examples/train.py on a small slice of MNIST-1D: it trains, reports its metrics, and resumes from a
checkpoint written mid-window to bitwise the parameters of an uninterrupted run."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from adasum.torch import read_checkpoint

from helpers import TRAINING_SIZES, raw_bytes

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# 400 signals: 320 for training (10 micro-batches of 32 on one rank), 80 for testing. Generated once and
# kept in the temporary directory for the later runs (generating means importing scipy and matplotlib).
CACHE = os.path.join(tempfile.gettempdir(), "adasum-test-mnist1d-400.npz")
SMALL = ["--num-samples", "400", "--batch-size", "32", "--no-progress", "--channels", "8", "--data-cache", CACHE]


def _train_module():
    spec = importlib.util.spec_from_file_location("adasum_example_train", EXAMPLES / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _model_bytes(path) -> list[bytes]:
    state = read_checkpoint(path)["model"]
    return [raw_bytes(t.reshape(-1)) for t in state.values()]


def test_example_trains_and_writes_metrics(tmp_path):
    out = tmp_path / "metrics.json"
    metrics = _train_module().main(SMALL + ["--epochs", "4", "--lr", "2e-2", "--batch-size", "16", "--channels",
                                            "16", "--metrics-json", str(out)])
    written = json.loads(out.read_text())
    assert written == metrics
    assert {"test_accuracy", "test_loss", "epochs", "op", "world_size", "accumulation_steps",
            "skipped_updates", "seconds"} <= set(written)
    assert written["epochs"] == 4 and written["op"] == "adasum" and written["world_size"] == 1
    assert written["skipped_updates"] == 0 and written["seconds"] > 0
    # Ten classes: chance is 10 %; four short epochs on 320 signals do far better (45 %).
    assert written["test_accuracy"] > 0.3 and written["train_loss"] < 1.5


def test_example_rerun_on_a_finished_checkpoint_reports_its_metrics(tmp_path):
    """Running the same --checkpoint command again after the run finished trains nothing and writes the
    metrics of the checkpoint's last epoch, not a training loss of 0.0."""
    train = _train_module()
    ckpt, first, again = tmp_path / "run.pt", tmp_path / "first.json", tmp_path / "again.json"
    common = SMALL + ["--epochs", "1", "--checkpoint", str(ckpt)]
    want = train.main(common + ["--metrics-json", str(first)])
    before = _model_bytes(ckpt)
    got = train.main(common + ["--metrics-json", str(again)])
    assert want["train_loss"] > 0.5  # one short epoch from random weights: about ln(10) = 2.3
    written = json.loads(again.read_text())
    assert written["train_loss"] == want["train_loss"], "the rerun reports a training loss it did not have"
    untimed = {k: v for k, v in want.items() if "seconds" not in k}
    assert {k: v for k, v in written.items() if "seconds" not in k} == untimed == \
        {k: v for k, v in got.items() if "seconds" not in k}
    assert _model_bytes(ckpt) == before  # nothing trained, nothing rewritten


@pytest.mark.parametrize("op", ["adasum", "mean"])
def test_example_resumes_bitwise_from_a_mid_window_checkpoint(tmp_path, op):
    train = _train_module()
    common = SMALL + ["--epochs", "2", "--op", op, "--accumulation-steps", "3", "--optimizer", "sgd"]
    straight, resumed = tmp_path / "straight.pt", tmp_path / "resumed.pt"
    want = train.main(common + ["--checkpoint", str(straight)])
    # Epoch 1 has windows of 3, 3, 3 and 1 micro-batches; stopping after 12 leaves 2 in a window.
    assert train.main(common + ["--checkpoint", str(resumed), "--stop-after", "12"]) is None
    extra = read_checkpoint(resumed)["extra"]
    assert (extra["epoch"], extra["micro"]) == (1, 2)
    got = train.main(common + ["--checkpoint", str(resumed)])
    assert _model_bytes(resumed) == _model_bytes(straight)
    assert got["test_accuracy"] == want["test_accuracy"] and got["test_loss"] == want["test_loss"]


def test_example_elastic_without_a_failure_is_the_plain_run(tmp_path):
    """--elastic with no rank dying (and commits inside epochs that close no window early): bitwise the
    plain run, with its counts of resets and replayed micro-batches at zero. Under an MPI without ULFM
    (this suite's MPICH) it says so once and trains all the same."""
    train = _train_module()
    common = SMALL + ["--epochs", "2", "--accumulation-steps", "2", "--optimizer", "sgd"]
    plain, elastic = tmp_path / "plain.pt", tmp_path / "elastic.pt"
    want = train.main(common + ["--checkpoint", str(plain)])
    got = train.main(common + ["--checkpoint", str(elastic), "--elastic", "--checkpoint-every", "4"])
    assert _model_bytes(elastic) == _model_bytes(plain)
    assert got["test_loss"] == want["test_loss"] and got["train_loss"] == want["train_loss"]
    assert (got["resets"], got["replayed_micro_batches"], got["world_size"]) == (0, 0, 1)


@pytest.mark.mpi(min_size=1)
@TRAINING_SIZES
def test_example_on_every_rank(comm):
    """One epoch on all ranks: every rank ends with the same metrics and rank 0 writes them."""
    tmp = comm.bcast(tempfile.mkdtemp(prefix="adasum-train-") if comm.Get_rank() == 0 else None, root=0)
    try:
        out = os.path.join(tmp, "metrics.json")
        metrics = _train_module().main(SMALL + ["--epochs", "1", "--op", "mean", "--accumulation-steps", "2",
                                                "--metrics-json", out])
        assert metrics["world_size"] == comm.Get_size()
        everyone = comm.allgather({k: v for k, v in metrics.items() if "seconds" not in k})
        assert everyone == [everyone[0]] * comm.Get_size()
        comm.Barrier()
        assert json.loads(Path(out).read_text())["test_loss"] == metrics["test_loss"]
    finally:
        comm.Barrier()
        if comm.Get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
