"""No fault hangs an elastic job (Open MPI with ULFM): an exception on one rank ends the whole job within
seconds, its traceback shown and the exit status non-zero (or, with ``on_error="leave"``, that rank leaves
and the others go on); a rank that stops answering (SIGSTOP) is killed by the others' stall timeout and
they go on; an MPI error that is not of the failure classes (the ``ERR_OTHER`` of Open MPI's nonblocking
collectives) met while a rank dies counts as that death. Also, without MPI jobs, what
``adasum.torch.elastic.run`` makes of each kind of error (``_cause``)."""

from __future__ import annotations

import time

import pytest
from mpi4py import MPI

from jobs import LAUNCH_TIMEOUT, MPIEXEC, OPEN_MPI, launch, run_job
from test_elastic import check_survived, report

needs_ulfm = pytest.mark.skipif(not OPEN_MPI or not MPIEXEC.exists(),
                                reason="needs Open MPI with ULFM (scripts/run-elastic-tests.sh makes the environment)")
pytestmark = pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
ENDS_WITHIN = 30.0  # seconds from the exception to the end of the job (the target)


@needs_ulfm
def test_an_exception_on_one_rank_ends_the_job(tmp_path):
    """Rank 2's training function raises between two steps while the others wait in the next step's
    combine: every rank leaves, the job ends with a non-zero status, rank 2's traceback and, on the others,
    AnotherRankRaised naming it."""
    proc = run_job(tmp_path, 4, "--no-reference", "--kill", "2@1.2:raise")
    ended = time.time()
    output = proc.stdout + proc.stderr
    raised = float((tmp_path / "result.json.killed.2").read_text())
    assert proc.returncode != 0, output[-4000:]
    assert not (tmp_path / "result.json").exists()
    assert "RuntimeError: rank 2: a bug in the training function at epoch 1 batch 2" in output, output[-4000:]
    assert 'raise RuntimeError(f"rank {IDENT[0]}: a bug' in output  # its traceback
    others = [line for line in output.splitlines() if line.startswith("adasum.torch.elastic.AnotherRankRaised")]
    assert len(others) == 3 and all("raised on rank 2 " in line for line in others), output[-4000:]
    assert ended - raised < ENDS_WITHIN, ended - raised
    print(f"np=4 exception on rank 2: the job ended {ended - raised:.1f} s after it, exit {proc.returncode}")


@needs_ulfm
def test_horovod_on_error_leave_drops_the_rank(tmp_path):
    """``hvd.elastic.run(on_error="leave")``: the rank that raised shows its traceback and dies, the others
    go on as after a death, bitwise on the reference run in which that rank left at the last commit."""
    result, killed = launch(tmp_path, 4, "--api", "hvd", "--on-error", "leave", "--kill", "2@1.2:raise")
    check_survived(result, 4, 1)
    assert sorted(result["survivors"]) == [0, 1, 3] and result["hvd_size"] == 3
    report("np=4 hvd on_error=leave", result, killed)


@needs_ulfm
def test_a_stopped_rank_is_killed_by_the_stall_timeout(tmp_path):
    """Rank 2 SIGSTOPs itself between two steps; after the stall timeout (3 s) the ranks waiting for it on
    its host kill it, and the survivors go on as after a death."""
    result, killed = launch(tmp_path, 4, "--stall-timeout", "3", "--kill", "2@1.2:stop")
    check_survived(result, 4, 1)
    assert sorted(result["survivors"]) == [0, 1, 3]
    seen = [s - max(killed) for s in result["seen_at"]]
    assert all(1.5 < s < 3 + ENDS_WITHIN for s in seen), seen  # at the timeout (3 s), not before
    report("np=4 SIGSTOP, stall timeout 3 s", result, killed)


@needs_ulfm
def test_an_mpi_error_while_rank_0_dies_counts_as_that_death(tmp_path):
    """Rank 0 dies; rank 1 meets an ``MPI_ERR_OTHER`` (what ``NBC_Start_round`` gives a survivor waiting in a
    nonblocking collective) instead of a failure class. It must not leave ``run`` alone: it revokes and
    shrinks with the others, the shrink shows rank 0 dead, and all three go on bitwise on the reference."""
    result, killed = launch(tmp_path, 4, "--kill", "0@2.1", "--kill", "1@2.1:mpierror")
    check_survived(result, 4, 1)
    assert sorted(result["survivors"]) == [1, 2, 3]
    report("np=4 rank 0 dies, ERR_OTHER on rank 1", result, killed)


@needs_ulfm
def test_an_mpi_error_with_nobody_dead_ends_the_job(tmp_path):
    """The same ``MPI_ERR_OTHER`` on rank 1 with every rank alive: the shrink finds nobody dead, so it is rank
    1's own error, and the job ends as for an exception (rank 1 raises it, the others AnotherRankRaised)."""
    proc = run_job(tmp_path, 4, "--no-reference", "--kill", "1@1.2:mpierror")
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and not (tmp_path / "result.json").exists(), output[-4000:]
    assert "mpi4py.MPI.Exception: MPI_ERR_OTHER" in output, output[-4000:]
    others = [line for line in output.splitlines() if line.startswith("adasum.torch.elastic.AnotherRankRaised")]
    assert len(others) == 3 and all("raised on rank 1 " in line for line in others), output[-4000:]


def _chained(exc: BaseException, cause: BaseException) -> BaseException:
    try:
        try:
            raise cause
        except BaseException as inner:
            raise exc from inner
    except BaseException as outer:
        return outer


def test_what_run_makes_of_each_error():
    """``run``'s reading of an error: a death (go through the shrink), a maybe (go through the shrink, and
    only where no rank died is it this rank's error) or the training function's own error (the job ends)."""
    pytest.importorskip("torch")
    from adasum.runtime.errors import AdasumStallError
    from adasum.runtime.faults import WorldChanged
    from adasum.torch.elastic import _cause
    import torch.distributed as dist

    assert _cause(WorldChanged("rank 1 died")) == "death"
    if hasattr(MPI, "ERR_PROC_FAILED") and MPI.ERR_PROC_FAILED not in (MPI.ERR_OTHER, MPI.ERR_UNKNOWN):
        assert _cause(MPI.Exception(MPI.ERR_PROC_FAILED)) == "death"
        assert _cause(MPI.Exception(MPI.ERR_REVOKED)) == "death"
    assert _cause(RuntimeError("lane: MPI_ERR_PROC_FAILED: process failure")) == "death"
    assert _cause(RuntimeError("the overlap thread raised WorldChanged: rank 1 died")) == "death"
    assert _cause(MPI.Exception(MPI.ERR_OTHER)) == "maybe"  # NBC_Start_round's error while a rank dies
    assert _cause(MPI.Exception(MPI.ERR_IN_STATUS)) == "maybe"
    assert _cause(RuntimeError("a thread met MPI_ERR_OTHER: known error not in list")) == "maybe"
    assert _cause(AdasumStallError("rank 2 has not entered call #5", silent=[2])) == "maybe"
    assert _cause(_chained(RuntimeError("the step failed"), MPI.Exception(MPI.ERR_OTHER))) == "maybe"
    assert _cause(_chained(RuntimeError("the step failed"), WorldChanged("rank 1 died"))) == "death"
    # a torch process group's errors: gloo knows nothing of deaths, so the shrink finds out
    assert _cause(RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:538] Connection closed by peer "
                               "[127.0.0.1]:41515")) == "maybe"
    assert _cause(dist.DistStoreError("wait timeout after 30000ms")) == "maybe"
    assert _cause(ValueError("a bug")) == "raised"
    assert _cause(KeyboardInterrupt()) == "raised"
    assert _cause(SystemExit(3)) == "raised"


@needs_ulfm
def test_horovod_state_sync_then_restore_gives_rank_0s(tmp_path):
    """Horovod's semantics (its own test_torch_elastic.py): after ``sync()`` a ``restore()`` returns to rank
    0's state; ``hvd.elastic.ElasticSampler`` synced and sharded without overlap (tests/elastic/state_job.py)."""
    proc = run_job(tmp_path, 2, script="state_job.py")
    assert sorted(line for line in proc.stdout.splitlines() if line.endswith(": ok")) == ["rank 0: ok", "rank 1: ok"], \
        (proc.stdout + proc.stderr)[-4000:]


class _World:
    def __init__(self, size: int, rank: int):
        self.size, self.rank = size, rank

    def Get_size(self) -> int:
        return self.size

    def Get_rank(self) -> int:
        return self.rank


def test_elastic_sampler_reshards_what_is_left(monkeypatch):
    """Of 40 samples, 4 ranks process 3 batches of 2 (24 samples); after a reset to 3 ranks the 16 left are
    sharded over the 3 without overlap (padded to 18), and a new epoch starts from the whole set."""
    pytest.importorskip("torch")
    import adasum.torch.elastic.sampler as elastic

    def samplers(size: int, state: dict | None = None) -> list:
        out = []
        for rank in range(size):
            monkeypatch.setattr(elastic, "world", lambda rank=rank: _World(size, rank))
            s = elastic.ElasticSampler(list(range(40)), shuffle=True, seed=5)
            if state is not None:
                s.load_state_dict(state)
            out.append(s)
        return out

    four = samplers(4)
    assert sorted(i for s in four for i in s) == list(range(40))
    order = [i for batch in zip(*(list(s) for s in four)) for i in batch]
    for s in four:
        for b in range(3):
            s.record_batch(b, 2)
    committed = four[0].state_dict()
    assert committed == {"epoch": 0, "processed_num": 24}
    three = samplers(3, committed)
    left = [i for s in three for i in s]
    assert len(left) == 18 and all(len(s) == 6 for s in three)
    assert set(left) == set(order[24:]) and not set(left) & set(order[:24])
    for rank, s in enumerate(three):
        monkeypatch.setattr(elastic, "world", lambda rank=rank: _World(3, rank))
        s.set_epoch(1)
    assert all(len(s) == 14 for s in three) and set(i for s in three for i in s) == set(range(40))
    one = samplers(1, {"epoch": 1, "processed_num": 39})
    assert len(one[0]) == 1 and list(one[0]) == [one[0].remaining_indices[0]]
