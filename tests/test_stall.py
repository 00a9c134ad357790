"""A rank that never arrives is named: the stall inspector's warning and timeout, at any world size."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

import adasum
from adasum.reference import reference_allreduce

pytestmark = pytest.mark.mpi


@pytest.fixture
def quick_stalls():
    old = adasum.configure(stall_warning=0.3, stall_timeout=1.0)
    yield
    adasum.configure(old)


def _x(rank: int) -> list[np.ndarray]:
    return [np.full(5, rank + 1.0), np.arange(3.0) * (rank + 1)]


def _check_world_still_works(comm) -> None:
    size, rank = comm.Get_size(), comm.Get_rank()
    want = reference_allreduce([_x(r) for r in range(size)])
    for got, w in zip(adasum.adasum_allreduce(_x(rank), comm=comm), want):
        np.testing.assert_allclose(got, w, rtol=1e-12)


@pytest.mark.parametrize("first", [True, False], ids=["first-call", "later-call"])
def test_a_rank_that_never_calls_is_named_and_the_others_raise(comm, quick_stalls, first):
    """A first call on a communicator waits in the library's duplicate of it, a later one in the agreement:
    both name the rank that is not there."""
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1:
        pytest.skip("needs a rank to wait for")
    dup = comm.Dup()
    dup.Set_name("stalled")
    if not first:
        adasum.adasum_allreduce(_x(rank), comm=dup)
    if rank == 0:
        dup.Barrier()  # the bug: rank 0 is somewhere else
    else:
        started = time.monotonic()
        others = ", ".join(map(str, range(1, size)))
        what = "making the library's duplicate of it" if first else "op 'adasum', 2 tensors, 64 bytes"
        with pytest.raises(adasum.AdasumStallError,
                           match=rf"^rank {rank}: call #{1 if first else 2} on communicator 'stalled' \({what}\) has "
                                 rf"waited \d+\.\d s for rank 0, which has not entered it; waiting in it: "
                                 rf"ranks? {others}$"):
            adasum.adasum_allreduce(_x(rank), comm=dup)
        assert 0.9 < time.monotonic() - started < 10
        dup.Barrier()  # rank 0 gets out
        with pytest.raises(adasum.AdasumStallError, match="an earlier call timed out there"):
            adasum.adasum_allreduce(_x(rank), comm=dup)
    comm.Barrier()
    _check_world_still_works(comm)  # the user's communicator and the library on it are fine


def test_ranks_on_different_communicators_name_each_other(comm, quick_stalls):
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1:
        pytest.skip("needs two groups of ranks")
    a, b = comm.Dup(), comm.Dup()
    a.Set_name("a")
    b.Set_name("b")
    last = size - 1
    mine = b if rank == last else a
    missing = ", ".join(map(str, range(last))) if rank == last else str(last)
    with pytest.raises(adasum.AdasumStallError, match=rf"on communicator '{'b' if rank == last else 'a'}' .* for "
                                                      rf"ranks? {missing}, which ha(s|ve) not entered it"):
        adasum.adasum_allreduce(_x(rank), comm=mine)
    comm.Barrier()
    _check_world_still_works(comm)


def test_a_late_rank_is_warned_about_and_the_call_completes(comm, caplog):
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1:
        pytest.skip("needs a rank to wait for")
    old = adasum.configure(stall_warning=0.3, stall_timeout=None)
    try:
        dup = comm.Dup()
        if rank == 0:
            time.sleep(1.2)
        with caplog.at_level(logging.WARNING, logger="adasum"):
            out = adasum.adasum_allreduce(_x(rank), comm=dup)
        want = reference_allreduce([_x(r) for r in range(size)])
        for got, w in zip(out, want):
            np.testing.assert_allclose(got, w, rtol=1e-12)
        warned = [r.getMessage() for r in caplog.records if "has not entered it" in r.getMessage()]
        if rank == 1:  # the lowest waiting rank logs it, once
            assert len(warned) == 1 and "for rank 0, which has not entered it" in warned[0], warned
        else:
            assert not warned, warned
        # later calls drain the late rank's old messages and work
        for _ in range(70):
            out = adasum.adasum_allreduce(_x(rank), comm=dup)
        for got, w in zip(out, want):
            np.testing.assert_allclose(got, w, rtol=1e-12)
        dup.Free()
    finally:
        adasum.configure(old)


def test_stall_settings_are_validated_and_read_from_the_environment():
    with pytest.raises(ValueError, match="stall_timeout must be a positive number of seconds"):
        adasum.configure(stall_timeout=0)
    from adasum.settings import from_environment

    s = from_environment({"ADASUM_STALL_WARNING": "5", "ADASUM_STALL_TIMEOUT": "30"})
    assert (s.stall_warning, s.stall_timeout) == (5.0, 30.0)
    s = from_environment({"ADASUM_STALL_WARNING": "off"})
    assert (s.stall_warning, s.stall_timeout) == (None, None)
    assert from_environment({}).stall_warning == 60.0
