"""Elastic training under Open MPI with ULFM: ranks SIGKILLed at chosen steps, the survivors finish.

Each test launches ``mpiexec --with-ft ulfm`` on tests/elastic/worker.py (from the environment of the
running Python: scripts/run-elastic-tests.sh makes it) and checks what rank 0 of the survivors wrote: the
smaller world, one reset per failure on every survivor, bitwise equal parameters, a falling loss. Without
Open MPI (the main suite's MPICH) they are skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mpi4py import MPI

WORKER = Path(__file__).with_name("worker.py")
ROOT = WORKER.parent.parent.parent
MPIEXEC = Path(sys.executable).with_name("mpiexec")
LAUNCH_TIMEOUT = 240  # seconds for one job, start-up of 4-5 torch processes on a loaded 2-core machine included

pytestmark = [
    pytest.mark.skipif(not MPI.Get_library_version().startswith("Open MPI") or not MPIEXEC.exists(),
                       reason="needs Open MPI with ULFM (scripts/run-elastic-tests.sh makes the environment)"),
    pytest.mark.timeout(LAUNCH_TIMEOUT + 30),
]


def launch(tmp_path: Path, ranks: int, *args: str) -> tuple[dict, list[float]]:
    """Run the worker at ``ranks`` ranks; its result and the times the killed ranks died."""
    out = tmp_path / "result.json"
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [str(MPIEXEC), "--oversubscribe", "--with-ft", "ulfm", "-n", str(ranks), sys.executable, str(WORKER),
           "--out", str(out), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    assert out.exists(), f"no result (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    killed = [float(p.read_text()) for p in tmp_path.glob("result.json.killed.*")]
    return json.loads(out.read_text()), killed


def check_survived(result: dict, ranks: int, failures: int) -> None:
    assert result["size"] == ranks - failures
    assert result["resets"] == [failures] * (ranks - failures)  # one reset per failure, on every survivor
    assert result["equal"], "the survivors' parameters differ"
    losses = result["losses"][0]
    assert len(losses) == 4 and losses[-1] < 0.5 * losses[0], losses
    assert all(r == losses for r in result["losses"])
    if failures:
        assert all(s is not None and s < 30 for s in result["recovery_s"])


def report(name: str, result: dict, killed: list[float]) -> None:
    """One line for the log: recovery times (failure seen → training again) and detection delays."""
    if killed:
        seen = [s - max(killed) for s in result["seen_at"] if s is not None]
        print(f"{name}: recovery {max(result['recovery_s']):.2f} s, detected {max(seen):.2f} s after the "
              f"last death, job {result['seconds']:.1f} s")


def test_no_failure_is_bitwise_the_plain_run(tmp_path):
    result, _ = launch(tmp_path, 4, "--plain")
    check_survived(result, 4, 0)
    assert result["plain_equal"] is True


def test_no_failure_with_local_steps_is_bitwise_the_plain_run(tmp_path):
    result, _ = launch(tmp_path, 5, "--plain", "--local-steps", "4")
    check_survived(result, 5, 0)
    assert result["plain_equal"] is True


@pytest.mark.parametrize("ranks, kills, failures", [
    (5, ["2@1.2"], 1),                    # between two commits
    (4, ["0@2.1"], 1),                    # rank 0
    (5, ["3@1.3:step"], 1),               # while the others are inside step()'s combine
    (5, ["1@1.1", "4@2.6"], 2),           # two ranks, one after the other
], ids=["between-commits", "rank-0", "inside-combine", "two-in-turn"])
def test_survivors_finish(tmp_path, ranks, kills, failures):
    result, killed = launch(tmp_path, ranks, *(a for k in kills for a in ("--kill", k)))
    check_survived(result, ranks, failures)
    assert result["sizes_at_reset"] == list(range(ranks - 1, ranks - 1 - failures, -1))
    dead = {int(k.split("@")[0]) for k in kills}
    assert sorted(result["survivors"]) == sorted(set(range(ranks)) - dead)
    report(f"np={ranks} kill {kills}", result, killed)


@pytest.mark.parametrize("ranks, args", [
    (4, ["--local-steps", "4", "--kill", "2@1.6"]),             # inside a window of local steps
    (5, ["--local-steps", "4", "--delay", "1", "--kill", "2@1.5"]),  # a combine in flight on the lane
    (4, ["--overlap", "--kill", "1@1.2:step"]),                 # the overlap engine's lane
], ids=["local-steps", "delay", "overlap"])
def test_survivors_finish_with_options(tmp_path, ranks, args):
    result, killed = launch(tmp_path, ranks, *args)
    check_survived(result, ranks, 1)
    report(f"np={ranks} {' '.join(args[:-2])}", result, killed)


def test_horovod_elastic_api(tmp_path):
    """hvd.elastic.run, TorchState and hvd.DistributedOptimizer; after the reset hvd.size(), hvd.rank() and
    hvd.allgather_object work on the survivors' world."""
    result, killed = launch(tmp_path, 4, "--api", "hvd", "--kill", "3@2.2")
    check_survived(result, 4, 1)
    assert result["hvd_size"] == 3 and result["objects"] == [0, 1, 2]
    report("np=4 hvd", result, killed)
