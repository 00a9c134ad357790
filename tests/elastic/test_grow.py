"""Growing back under Open MPI with ULFM (``ADASUM_ELASTIC_REPLACE=1``): ranks SIGKILLed, the survivors
start as many processes as died at the next commit, and the job ends at its launch size.

Five jobs (the elastic stage's time is short): one death whose first newcomer dies before it joined; two
deaths at once with local steps; rank 0's death and then its replacement's, through ``hvd.elastic``; a
spawn without a free slot; a replacement that dies before the commit after the growth (a failed attempt). Each test launches tests/elastic/worker.py (tests/elastic/jobs.py) and checks
what rank 0 of the final world wrote: the world back at its launch size with the newcomers in it, every rank bitwise equal, and
equal to the reference run in which the dead ranks left at the commit their death rolled back to and came
back at the next one with rank 0's state; where growing back fails, the smaller world's end, equal to the
reference in which they never came back. Without Open MPI (the main suite's MPICH) they are skipped.
"""

from __future__ import annotations

import json

import pytest

from jobs import LAUNCH_TIMEOUT, MPIEXEC, OPEN_MPI, launch, run_job

pytestmark = [
    pytest.mark.skipif(not OPEN_MPI or not MPIEXEC.exists(),
                       reason="needs Open MPI with ULFM (scripts/run-elastic-tests.sh makes the environment)"),
    pytest.mark.timeout(LAUNCH_TIMEOUT + 30),
]
REPLACE = {"ADASUM_ELASTIC_REPLACE": "1", "ADASUM_ELASTIC_REPLACE_TIMEOUT": "90"}


def check_grown(result: dict, ranks: int, resets: int | None, grows: int) -> None:
    """Back at ``ranks`` ranks after ``resets`` resets (None: one or two, for two deaths at once that one
    shrink or two may see), every rank equal, and equal to the reference."""
    assert result["size"] == ranks and sorted(result["survivors"]) == list(range(ranks)), result["survivors"]
    assert result["newcomers"] >= 1
    assert result["grows"] == [grows] * ranks and len(set(result["resets"])) == 1
    assert result["resets"][0] == resets or resets is None and result["resets"][0] in (1, 2)
    assert result["equal"], "the ranks' parameters differ"
    assert all(result["reference_equal"]), result["reference_equal"]  # bitwise the reference run
    losses = result["losses"][0]
    assert len(losses) == 4 and losses[-1] < 0.5 * losses[0] and all(r == losses for r in result["losses"])
    assert all(r == losses for r in result["reference_losses"]), (losses, result["reference_losses"])


def report(name: str, result: dict, killed: list[float]) -> None:
    """One line for the log: from the last kill to the world back at its launch size."""
    back = max(t for t in result["grown_at"] if t is not None)
    print(f"{name}: back at {result['size']} ranks {back - max(killed):.1f} s after the last kill, "
          f"job {result['seconds']:.1f} s")


@pytest.mark.parametrize("name, ranks, args, resets", [
    ("local-steps, two at once", 4, ["--local-steps", "4", "--kill", "1@1.6", "--kill", "3@1.6"], None),
])
def test_the_world_grows_back(tmp_path, name, ranks, args, resets):
    """Each death is followed by a growth at the next commit (deaths at once: one spawn replaces them)."""
    result, killed = launch(tmp_path, ranks, *args, env=REPLACE)
    check_grown(result, ranks, resets, resets or 1)
    if "two at once" in name:
        assert result["newcomers"] == 2
    report(f"np={ranks} grows back: {name}", result, killed)


def test_the_world_grows_back_after_the_roots_death_and_again_through_horovod(tmp_path):
    """Rank 0 dies; the survivors renumber from 0, the newcomer joins as rank 3 through ``hvd.elastic.run``;
    then that newcomer dies too (two deaths one after the other), and the next one takes its place:
    ``hvd.size()``/``hvd.rank()`` follow."""
    result, killed = launch(tmp_path, 4, "--api", "hvd", "--kill", "0@1.1", "--kill", "0@2.6", env=REPLACE)
    check_grown(result, 4, 2, 2)
    assert result["survivors"] == [1, 2, 3, 0] and result["hvd_size"] == 4 and result["objects"] == [0, 1, 2, 3]
    report("np=4 grows back after rank 0's death, then its replacement's (hvd)", result, killed)


def test_after_one_death_a_newcomer_that_dies_before_it_joined_is_replaced(tmp_path):
    """Rank 2 dies. The first newcomer calls a collective before ``run``: refused, with what to do instead;
    the uncaught error ends it before it joined. The survivors see it gone, warn, go on at 3 ranks and start
    another at the next commit, which joins: bitwise the reference whose rank comes back one commit after
    the first one following the death."""
    proc = run_job(tmp_path, 4, "--newcomer-fails-once", "--rejoin", "later", "--kill", "2@1.1", env=REPLACE)
    output = proc.stdout + proc.stderr
    assert (tmp_path / "result.json").exists(), f"no result (exit {proc.returncode}):\n{output[-4000:]}"
    result = json.loads((tmp_path / "result.json").read_text())
    check_grown(result, 4, 1, 1)
    assert sorted(result["survivors"]) == [0, 1, 2, 3] and result["survivors"][3] == 2 and result["newcomers"] == 1
    refused = [line for line in output.splitlines() if line.startswith("adasum.runtime.errors.AdasumNotJoinedError")]
    assert len(refused) == 1 and "the broadcast's tensors: this process was started in place of a rank that " \
        "died and has not joined the job yet" in refused[0] and "is_newcomer()" in refused[0], output[-4000:]
    warned = [line for line in output.splitlines() if "growing back from 3 to 4 ranks failed" in line]
    assert len(warned) == 1 and "before it joined" in warned[0] and "trying again" in warned[0], output[-4000:]
    report("np=4 one death, a newcomer dies before it joined", result,
           [float(p.read_text()) for p in tmp_path.glob("result.json.killed.*")])


def test_a_spawn_without_a_free_slot_leaves_the_smaller_world(tmp_path):
    """Launched on 4 slots without --oversubscribe, the dead rank's slot stays taken: every spawn fails at
    once; the survivors warn once per attempt, with the reason, and end at 3 ranks after 2 attempts,
    bitwise the reference in which rank 2 never comes back."""
    proc = run_job(tmp_path, 4, "--rejoin", "never", "--kill", "2@1.2", slots=4,
                   env=dict(REPLACE, ADASUM_ELASTIC_REPLACE_ATTEMPTS="2"))
    output = proc.stdout + proc.stderr
    assert (tmp_path / "result.json").exists(), f"no result (exit {proc.returncode}):\n{output[-4000:]}"
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["size"] == 3 and result["newcomers"] == 0 and result["grows"] == [0] * 3
    assert result["equal"] and all(result["reference_equal"]), result
    warned = [line for line in output.splitlines() if "growing back from 3 to 4 ranks failed" in line]
    assert len(warned) == 2, output[-4000:]
    assert "attempt 1 of 2" in warned[0] and "no free slot" in warned[0] and "trying again" in warned[0]
    assert "no more attempts" in warned[1]


def test_a_replacement_that_dies_before_the_next_commit_counts_as_a_failed_attempt(tmp_path):
    """Rank 2 dies; the world grows back at the next commit; its replacement dies too, before the commit
    after that. With one attempt allowed that counts as the failed one: rank 0 says so, no process is
    started again, and the job ends at 3 ranks, bitwise the reference in which rank 2 never came back (the
    replacement's work was rolled back with its death)."""
    proc = run_job(tmp_path, 4, "--rejoin", "never", "--kill", "2@1.1", "--kill", "2@1.5",
                   env=dict(REPLACE, ADASUM_ELASTIC_REPLACE_ATTEMPTS="1"))
    output = proc.stdout + proc.stderr
    assert (tmp_path / "result.json").exists(), f"no result (exit {proc.returncode}):\n{output[-4000:]}"
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["size"] == 3 and result["grows"] == [1] * 3, result
    assert result["equal"] and all(result["reference_equal"]), result
    counted = [line for line in output.splitlines() if "before the first commit after the world grew back" in line]
    assert len(counted) == 1 and "attempt 1 of 1; no more attempts" in counted[0], output[-4000:]
    assert output.count("the world grew back from 3 to 4 ranks") == 1, output[-4000:]
    # Each shrink names the dead: rank 2 of the launch, then the newcomer (rank 3 of the grown world).
    assert "a rank died (rank 2 of the 4); the world shrank from 4 to 3" in output, output[-4000:]
    assert "a rank died (rank 3 of the 4); the world shrank from 4 to 3" in output, output[-4000:]
