"""A rank that never arrives is named: the stall inspector's warning and timeout. At 2 ranks (one rank named),
3 (ranks named as a list) and 4 (a message left on a freed communicator needs a
rank the next one lacks): each test waits out a timeout or a late rank, and at 5 or 8 ranks the inspector
would only name more of them through the same code."""

from __future__ import annotations

import logging
import platform
import re
import time

import numpy as np
import pytest

import adasum
from adasum.rule.reference import reference_allreduce

pytestmark = [pytest.mark.mpi, pytest.mark.world_size(2, 3, 4)]


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


@pytest.mark.parametrize("op", ["adasum", "sum"])
@pytest.mark.parametrize("first", [True, False], ids=["first-call", "later-call"])
def test_a_rank_that_never_calls_is_named_and_the_others_raise(comm, quick_stalls, first, op):
    """A first call on a communicator waits in the library's duplicate of it, a later one in the agreement
    (made inside the compiled small call or the compiled small plain call, where they run): both name the
    rank that is not there."""
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1:
        pytest.skip("needs a rank to wait for")
    dup = comm.Dup()
    dup.Set_name("stalled")
    if not first:
        adasum.adasum_allreduce(_x(rank), op=op, comm=dup)
    if rank == 0:
        dup.Barrier()  # the bug: rank 0 is somewhere else
    else:
        started = time.monotonic()
        others = ", ".join(map(str, range(1, size)))
        what = "making the library's duplicate of it" if first else f"op '{op}', 2 tensors, 64 bytes"
        with adasum.count_traffic(dup) as t, pytest.raises(
                adasum.AdasumStallError,
                match=rf"^rank {rank}: call #{1 if first else 2} on communicator 'stalled' \({what}\) has "
                      rf"waited \d+\.\d s for rank 0, which has not entered it; waiting in it: ranks? {others}$"):
            adasum.adasum_allreduce(_x(rank), op=op, comm=dup)
        if op == "sum" and not first:
            assert t.compiled_calls == (1 if _compiled_small_calls() else 0)
        assert 0.9 < time.monotonic() - started < 10
        dup.Barrier()  # rank 0 gets out
        with pytest.raises(adasum.AdasumStallError, match="an earlier call timed out there"):
            adasum.adasum_allreduce(_x(rank), op=op, comm=dup)
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


def _compiled_small_calls() -> bool:
    """Whether small host calls run as one compiled call here (native_mpi on): the platforms the extension
    binds MPI on, with the compiled kernels in use."""
    return (platform.system() == "Linux" and platform.machine() in ("x86_64", "aarch64")
            and adasum.kernels_backend() == "c")


def _one_path(comm, native: bool, op: str) -> dict:
    """A result, a disagreement, a late rank and a missing rank, on a communicator of their own, with the
    agreement waited for by the compiled kernels (``native``: inside the compiled small call of ``op``) or
    through mpi4py; what each rank saw."""
    size, rank, last = comm.Get_size(), comm.Get_rank(), comm.Get_size() - 1
    compiled = 1 if native and _compiled_small_calls() else 0
    seen = {}
    old = adasum.configure(native_mpi=native, small_message_bytes=1 << 20, stall_warning=0.3, stall_timeout=1.0)
    try:
        dup = comm.Dup()
        dup.Set_name("agree")
        adasum.adasum_allreduce(_x(rank), op=op, comm=dup)  # makes the plan the compiled small call needs
        with adasum.count_traffic(dup) as t:
            seen["result"] = [a.tobytes() for a in adasum.adasum_allreduce(_x(rank), op=op, comm=dup)]
        assert t.compiled_calls == compiled, f"rank {rank}: {t.compiled_calls} compiled calls"
        bad = _x(rank)
        if rank == last:
            bad[1] = bad[1][:-1]
        with adasum.count_traffic(dup) as t, pytest.raises(adasum.AdasumMismatchError) as mismatch:
            adasum.adasum_allreduce(bad, op=op, comm=dup)
        seen["mismatch"] = str(mismatch.value)
        # the odd rank has no plan of its shapes: Adasum's compiled call takes kept plans only, sum's any
        assert t.compiled_calls == (0 if rank == last and op == "adasum" else compiled)
        if rank == 0:
            time.sleep(0.6)  # past the first patience (0.3 s), within the timeout
        with adasum.count_traffic(dup) as t:
            seen["late"] = [a.tobytes() for a in adasum.adasum_allreduce(_x(rank), op=op, comm=dup)]
        assert t.compiled_calls == compiled
        if rank == 0:
            dup.Barrier()  # never enters the next call
        else:
            with adasum.count_traffic(dup) as t, pytest.raises(adasum.AdasumStallError) as stalled:
                adasum.adasum_allreduce(_x(rank), op=op, comm=dup)
            seen["stall"] = re.sub(r"\d+\.\d s", "T s", str(stalled.value))
            assert t.compiled_calls == compiled
            dup.Barrier()
    finally:
        adasum.configure(old)
    return seen


@pytest.mark.parametrize("op", ["adasum", "mean"])
def test_the_compiled_and_the_python_agreement_wait_alike(comm, op):
    """The agreement's wait has a compiled implementation (small calls, small plain calls, and the agreement
    of every call with native_mpi on) and one through mpi4py: the same result, the same disagreement error,
    a late rank waited for and a missing rank named in the same words, whichever path each call takes."""
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1:
        pytest.skip("needs ranks to agree with")
    python, native = _one_path(comm, False, op), _one_path(comm, True, op)
    assert native == python
    if op == "adasum":
        want = reference_allreduce([_x(r) for r in range(size)])
    else:
        want = [sum(_x(r)[i] for r in range(size)) / size for i in range(2)]
    for got in (python["result"], python["late"]):
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.frombuffer(g), w, rtol=1e-12)
    assert re.fullmatch(rf"\(raised on rank {rank}\) tensor 1 differs: rank {size - 1} has shape \(2,\) float64, "
                        r"rank 0 has shape \(3,\) float64", python["mismatch"]), python["mismatch"]
    if rank > 0:
        assert re.fullmatch(rf"rank {rank}: call #5 on communicator 'agree' \(op '{op}', 2 tensors, 64 bytes\) "
                            r"has waited T s for rank 0, which has not entered it; waiting in it: ranks? [\d, ]+",
                            python["stall"]), python["stall"]
    comm.Barrier()
    _check_world_still_works(comm)


@pytest.mark.world_size(2)  # no communication
def test_stall_settings_are_validated_and_read_from_the_environment():
    with pytest.raises(ValueError, match="stall_timeout must be a positive number of seconds"):
        adasum.configure(stall_timeout=0)
    from adasum.settings import from_environment

    s = from_environment({"ADASUM_STALL_WARNING": "5", "ADASUM_STALL_TIMEOUT": "30"})
    assert (s.stall_warning, s.stall_timeout) == (5.0, 30.0)
    s = from_environment({"ADASUM_STALL_WARNING": "off"})
    assert (s.stall_warning, s.stall_timeout) == (None, None)
    assert from_environment({}).stall_warning == 60.0


@pytest.mark.mpi(min_size=4)
def test_a_message_left_on_a_freed_communicator_does_not_reach_the_next_one(comm):
    """An "I am waiting" message that no rank received (its sender waited in a call the receiver entered
    late) stays in the receiver's queue under its communicator's context; once that communicator is freed,
    MPI may give the context to the next communicator it makes, here one without the sender's rank. The
    inspector of a call there receives it as the message its probe matched and ignores it: the call (its
    duplicate's making waited on for the late ranks) completes, with the right result."""
    from mpi4py import MPI

    from adasum.runtime.stall import STALL_TAG

    rank = comm.Get_rank()
    old_comm = comm.Dup()
    if rank == 3:  # what a waiting rank 3 announces: call 0, rank 3 (a rank the next communicator lacks)
        old_comm.Send([np.array([0, 1, 1, 8, 3], dtype=np.int64), MPI.INT64_T], 0, STALL_TAG)
    old_comm.Barrier()
    old_comm.Free()
    small = comm.Split(0 if rank < 3 else MPI.UNDEFINED, rank)
    old = adasum.configure(stall_warning=0.05, stall_timeout=None)
    try:
        if small != MPI.COMM_NULL:
            if rank != 0:
                time.sleep(0.5)  # rank 0 waits long enough to look at the messages waiting for it
            x = [np.full(4, small.Get_rank() + 1.0)]
            got = adasum.adasum_allreduce(x, op="sum", comm=small)
            np.testing.assert_array_equal(got[0], np.full(4, 6.0))
            small.Free()
    finally:
        adasum.configure(old)
        comm.Barrier()
