"""Elastic training under Open MPI with ULFM: ranks SIGKILLed at chosen steps, the survivors finish.

Each test launches ``mpiexec --with-ft ulfm`` on tests/elastic/worker.py (from the environment of the
running Python: scripts/run-elastic-tests.sh makes it) and checks what rank 0 of the survivors wrote: the
smaller world, one reset per failure on every survivor, parameters bitwise equal across the survivors and
to a reference run in which nobody died (the world changed at the commits the failures rolled back to),
the same losses as that reference, falling. Without Open MPI (the main suite's MPICH) they are skipped.
"""

from __future__ import annotations

import pytest

from jobs import LAUNCH_TIMEOUT, MPIEXEC, OPEN_MPI, launch, run_job

pytestmark = [
    pytest.mark.skipif(not OPEN_MPI or not MPIEXEC.exists(),
                       reason="needs Open MPI with ULFM (scripts/run-elastic-tests.sh makes the environment)"),
    pytest.mark.timeout(LAUNCH_TIMEOUT + 30),
]


def check_survived(result: dict, ranks: int, failures: int, reference: bool = True) -> None:
    assert result["size"] == ranks - failures
    assert result["resets"] == [failures] * (ranks - failures)  # one reset per failure, on every survivor
    assert result["equal"], "the survivors' parameters differ"
    losses = result["losses"][0]
    assert len(losses) == 4 and losses[-1] < 0.5 * losses[0], losses
    assert all(r == losses for r in result["losses"])
    if reference:  # nothing lost, nothing applied twice: bitwise the run whose dead ranks left at the last commit
        assert all(result["reference_equal"]), result["reference_equal"]
        assert all(r == losses for r in result["reference_losses"]), (losses, result["reference_losses"])
    if failures:
        assert all(s is not None and s < 30 for s in result["recovery_s"])


def report(name: str, result: dict, killed: list[float]) -> None:
    """One line for the log: recovery times (failure seen → training again) and detection delays."""
    if killed:
        seen = [s - max(killed) for s in result["seen_at"] if s is not None]
        print(f"{name}: recovery {max(result['recovery_s']):.2f} s, detected {max(seen):.2f} s after the "
              f"last death, job {result['seconds']:.1f} s")


def test_no_failure_is_bitwise_the_plain_run(plain_then_paths):
    result, _, _ = plain_then_paths  # the job goes on with test_paths.py's phases (tests/elastic/conftest.py)
    check_survived(result, 4, 0)
    assert result["plain_equal"] is True


def test_no_failure_with_local_steps_is_bitwise_the_plain_run(tmp_path):
    result, _ = launch(tmp_path, 5, "--plain", "--local-steps", "4")
    check_survived(result, 5, 0)
    assert result["plain_equal"] is True


# The five target scenarios, at 4 ranks (a fold after the death) and those whose recovery meets the most
# of the tree at 5 too (a power of two after it): ``--kill R@E.B[:where]`` (tests/elastic/worker.py). The
# other three ran at 5 as well until growing back (tests/elastic/test_grow.py, at 4) took their time in the
# elastic stage's budget.
SCENARIOS = {
    "between-commits": ["--kill", "2@1.2"],
    "rank-0": ["--kill", "0@2.1"],
    "inside-combine": ["--kill", "3@1.3:step"],  # while the others are inside step()'s combine
    "two-in-turn": ["--kill", "1@1.1", "--kill", "3@2.6"],  # the second after the first reset
    "local-steps": ["--local-steps", "4", "--kill", "2@1.6"],  # inside a window of 4 local steps
}
AT_FIVE = ("inside-combine", "local-steps")


@pytest.mark.parametrize("scenario, ranks", [(s, 4) for s in SCENARIOS] + [(s, 5) for s in AT_FIVE],
                         ids=[f"{s}-4" for s in SCENARIOS] + [f"{s}-5" for s in AT_FIVE])
def test_survivors_finish(tmp_path, scenario, ranks):
    args = SCENARIOS[scenario]
    dead = {int(a.split("@")[0]) for a in args if "@" in a}
    result, killed = launch(tmp_path, ranks, *args)
    check_survived(result, ranks, len(dead))
    assert result["sizes_at_reset"] == list(range(ranks - 1, ranks - 1 - len(dead), -1))
    assert sorted(result["survivors"]) == sorted(set(range(ranks)) - dead)
    report(f"np={ranks} {scenario}", result, killed)


@pytest.mark.parametrize("ranks, args", [
    (5, ["--local-steps", "4", "--delay", "1", "--kill", "2@1.5"]),  # a combine in flight on the lane
    (4, ["--overlap", "--kill", "1@1.2:step"]),                 # the overlap engine's lane
], ids=["delay", "overlap"])
def test_survivors_finish_with_options(tmp_path, ranks, args):
    result, killed = launch(tmp_path, ranks, *args)
    check_survived(result, ranks, 1)
    report(f"np={ranks} {' '.join(args[:-2])}", result, killed)


def test_a_death_inside_a_commit(tmp_path):
    """A rank SIGKILLed inside a commit's flush, which combines half a window of 8 local steps: some
    survivors may have finished that commit and others not; after the reset every survivor goes on from
    rank 0's (the commit it holds is not known beforehand, so there is no reference run to compare with)."""
    result, killed = launch(tmp_path, 4, "--local-steps", "8", "--kill", "2@1.3:commit")
    check_survived(result, 4, 1, reference=False)
    report("np=4 inside a commit", result, killed)


@pytest.mark.parametrize("api", ["native", "hvd"])
def test_a_death_during_the_recovery(tmp_path, api):
    """Rank 1 dies between commits; while the survivors recover from it, rank 3 dies inside the reset
    callbacks: that recovery fails too, and the two that are left recover once more, to the same commit,
    ending bitwise where the reference run (both leaving at that commit) ends."""
    result, killed = launch(tmp_path, 4, "--api", api, "--kill", "1@1.2", "--kill", "3@1.2:reset")
    check_survived(result, 4, 2)
    assert sorted(result["survivors"]) == [0, 2]
    assert result["sizes_at_reset"][-1] == 2
    report(f"np=4 {api} death during the recovery", result, killed)


def test_a_wait_on_several_requests_sees_the_death(tmp_path):
    """A dead rank met by ``Testall`` over several requests is ``MPI_ERR_IN_STATUS``, not
    ``ERR_PROC_FAILED``: it counts as a failure too (tests/elastic/in_status.py)."""
    proc = run_job(tmp_path, 3, script="in_status.py")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("rank ")]
    assert len(lines) == 2 and all(line.endswith("is_failure True") for line in lines), proc.stdout + proc.stderr


def test_horovod_elastic_api(tmp_path):
    """hvd.elastic.run, TorchState and hvd.DistributedOptimizer; after the reset hvd.size(), hvd.rank() and
    hvd.allgather_object work on the survivors' world."""
    result, killed = launch(tmp_path, 4, "--api", "hvd", "--kill", "3@2.2")
    check_survived(result, 4, 1)
    assert result["hvd_size"] == 3 and result["objects"] == [0, 1, 2]
    report("np=4 hvd", result, killed)
