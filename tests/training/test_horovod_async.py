"""adasum.horovod's asynchronous calls (handles on the communication thread), join() with uneven data, and
the error classes Horovod scripts catch."""

from __future__ import annotations

import time

import pytest
import torch

import adasum
import adasum.horovod as hvd


from helpers import ONE_SIZE, TRAINING_SIZES


@pytest.fixture
def stall_timeout():
    old = adasum.configure(stall_timeout=20.0)
    yield
    adasum.configure(old)


def _mine(rank: int, shape=(4, 3), dtype=torch.float64) -> torch.Tensor:
    return (torch.arange(12, dtype=torch.float64).reshape(shape) * (rank + 1) - 3 * rank).to(dtype)


@pytest.mark.mpi(min_size=2)
@TRAINING_SIZES
def test_async_calls_give_what_the_synchronous_calls_give(comm):
    hvd.init()
    size, rank = comm.Get_size(), comm.Get_rank()
    x = _mine(rank)
    handles = {
        "allreduce": hvd.allreduce_async(x, op=hvd.Sum, name="a"),
        "average_int": hvd.allreduce_async(x.to(torch.int32)),
        "allgather": hvd.allgather_async(x[:rank + 1]),
        "broadcast": hvd.broadcast_async(x, root_rank=size - 1),
        "alltoall": hvd.alltoall_async(torch.arange(2 * size, dtype=torch.float32) + 100 * rank),
        "reducescatter": hvd.reducescatter_async(torch.ones(2 * size, 3), op=hvd.Sum),
        "grouped": hvd.grouped_allreduce_async([x, x[0]], op=hvd.Average),
        "grouped_allgather": hvd.grouped_allgather_async([x, x[1:]]),
    }
    inplace = x.clone()
    h_inplace = hvd.allreduce_async_(inplace, op=hvd.Max)
    assert not all(hvd.poll(h) for h in handles.values())  # they run on the thread, not in the call
    results = {k: hvd.synchronize(h) for k, h in handles.items()}
    assert hvd.synchronize(h_inplace) is inplace
    assert torch.equal(results["allreduce"], hvd.allreduce(x, op=hvd.Sum))
    assert torch.equal(results["average_int"], hvd.allreduce(x.to(torch.int32)))
    assert results["average_int"].dtype == torch.int32
    assert torch.equal(results["allgather"], hvd.allgather(x[:rank + 1]))
    assert torch.equal(results["broadcast"], _mine(size - 1))
    assert torch.equal(results["alltoall"], hvd.alltoall(torch.arange(2 * size, dtype=torch.float32) + 100 * rank))
    assert torch.equal(results["reducescatter"], torch.full((2, 3), float(size)))
    assert all(torch.equal(a, b) for a, b in zip(results["grouped"], hvd.grouped_allreduce([x, x[0]])))
    assert all(torch.equal(a, b) for a, b in zip(results["grouped_allgather"], hvd.grouped_allgather([x, x[1:]])))
    assert torch.equal(inplace, hvd.allreduce(x, op=hvd.Max))
    with pytest.raises(ValueError, match="is not a handle of a pending call"):
        hvd.synchronize(handles["allreduce"])


@pytest.mark.mpi(min_size=2)
@ONE_SIZE
def test_a_pending_name_cannot_be_reused_until_synchronized(comm):
    """Rank 0 makes its call before a barrier, the others after it: the handles' communicator never meets
    the barrier's. A second pending call with the same name raises ValueError where it is made."""
    hvd.init()
    rank = comm.Get_rank()
    x = torch.ones(3)
    handle = None
    for turn in (0, 1):
        if (rank == 0) == (turn == 0):
            handle = hvd.allreduce_async(x, name="twice", op=hvd.Sum)
            with pytest.raises(ValueError, match=f"rank {rank}: allreduce_async: the name 'twice' is in use"):
                hvd.allreduce_async(x, name="twice")
        hvd.barrier()
    assert torch.equal(hvd.synchronize(handle), torch.full((3,), float(comm.Get_size())))
    assert torch.equal(hvd.synchronize(hvd.allreduce_async(x, name="twice", op=hvd.Sum)),
                       torch.full((3,), float(comm.Get_size())))


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@ONE_SIZE
def test_an_async_mismatch_raises_on_every_rank_at_synchronize(comm, stall_timeout):
    hvd.init()
    rank = comm.Get_rank()
    handle = hvd.allreduce_async(torch.ones(3 + (rank == 1)))
    with pytest.raises(hvd.HorovodInternalError, match=rf"\(raised on rank {rank}\).*allreduce calls differ"):
        hvd.synchronize(handle)
    handle = hvd.allgather_async(torch.ones(2)) if rank == 0 else hvd.broadcast_async(torch.ones(2), root_rank=0)
    with pytest.raises(ValueError, match="different calls: rank 0 is in adasum.horovod.allgather, rank 1 is "
                                         "in adasum.horovod.broadcast"):
        hvd.synchronize(handle)
    assert torch.equal(hvd.synchronize(hvd.allreduce_async(torch.ones(2), op=hvd.Sum)),
                       torch.full((2,), float(comm.Get_size())))


def test_horovod_internal_error_is_what_a_failed_collective_raises():
    assert issubclass(hvd.HorovodInternalError, RuntimeError)
    assert issubclass(adasum.AdasumMismatchError, hvd.HorovodInternalError)
    assert issubclass(adasum.AdasumMismatchError, ValueError)
    assert issubclass(adasum.AdasumStallError, hvd.HorovodInternalError)
    assert not issubclass(TypeError, hvd.HorovodInternalError)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("asynchronous", [False, True])
@TRAINING_SIZES
def test_join_answers_the_other_ranks_allreduces_with_zeros(comm, stall_timeout, asynchronous):
    """Rank 0 runs out of data after one step, the others make two more; Horovod's answer for rank 0's
    part is zeros, and Average still divides by the whole size."""
    hvd.init()
    size, rank = comm.Get_size(), comm.Get_rank()
    others = hvd.add_process_set(list(range(1, size)))
    x = _mine(rank)
    ints = torch.arange(5, dtype=torch.int64) * (rank + 7)
    assert torch.equal(hvd.allreduce(x, op=hvd.Sum), sum(_mine(r) for r in range(size)))
    if rank != 0:
        for _ in range(2):
            if asynchronous:
                a, b = hvd.synchronize(hvd.allreduce_async(x)), hvd.synchronize(hvd.allreduce_async(ints, op=hvd.Sum))
                grouped = hvd.synchronize(hvd.grouped_allreduce_async([x, ints]))
            else:
                a, b = hvd.allreduce(x), hvd.allreduce(ints, op=hvd.Sum)
                grouped = hvd.grouped_allreduce([x, ints])
            torch.testing.assert_close(a, hvd.allreduce(x, op=hvd.Sum, process_set=others) / size)
            assert torch.equal(b, sum(torch.arange(5, dtype=torch.int64) * (r + 7) for r in range(1, size)))
            torch.testing.assert_close(grouped[0], a)
            assert torch.equal(grouped[1], torch.div(b, size, rounding_mode="trunc"))
    last = hvd.join()
    assert last != 0 and comm.allgather(last) == [last] * size
    assert hvd.remove_process_set(others)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("other", ["allgather", "broadcast", "alltoall", "barrier", "allgather_object",
                                   "allreduce_max"])
@TRAINING_SIZES
def test_join_against_another_call_raises_on_the_ranks_that_made_it(comm, stall_timeout, other):
    """Uneven data: rank 0 joined, the others make a call that join() does not answer: they raise
    HorovodInternalError at once, rank 0 goes on waiting until they join too; nothing hangs."""
    hvd.init()
    size, rank = comm.Get_size(), comm.Get_rank()
    calls = {"allgather": lambda: hvd.allgather(torch.ones(2, 3)),
             "broadcast": lambda: hvd.broadcast(torch.ones(3), root_rank=1),
             "alltoall": lambda: hvd.alltoall(torch.ones(size)), "barrier": hvd.barrier,
             "allgather_object": lambda: hvd.allgather_object({"x": 1}),
             "allreduce_max": lambda: hvd.allreduce(torch.ones(3), op=hvd.Max)}
    start = time.monotonic()
    if rank == 0:
        last = hvd.join()
    else:
        name = "allreduce" if other == "allreduce_max" else other
        with pytest.raises(hvd.HorovodInternalError, match=rf"\(raised on rank {rank}\) {name} while rank\(s\) "
                                                           r"\[0\] have called join\(\)"):
            calls[other]()
        last = hvd.join()
    assert time.monotonic() - start < 15
    assert last != 0 and comm.allgather(last) == [last] * size
    assert torch.equal(hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), float(size)))


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@ONE_SIZE
def test_join_against_the_librarys_own_call_raises_on_every_rank(comm, stall_timeout):
    """A joined rank answers only adasum.horovod's calls: against the library's allreduce every rank raises,
    naming both calls."""
    hvd.init()
    rank = comm.Get_rank()
    with pytest.raises(hvd.HorovodInternalError, match="the ranks are in different calls: rank 1 is in "
                                                       "adasum_allreduce .*rank 0 is in adasum.horovod.join"):
        hvd.join() if rank == 0 else adasum.adasum_allreduce(torch.ones(3))
    assert torch.equal(hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), float(comm.Get_size())))
    # rank 0's join() left its part on the handles' communicator waiting: it answers the others' next
    # asynchronous allreduce there with NaN (never zeros that look valid), the one after by raising its
    # failure; then join() works again
    if rank != 0:
        assert torch.isnan(hvd.synchronize(hvd.allreduce_async(torch.ones(2)))).all()
        with pytest.raises(hvd.HorovodInternalError, match="rank 0: join\\(\\) failed on this rank"):
            hvd.synchronize(hvd.allreduce_async(torch.ones(2)))
    last = hvd.join()
    assert comm.allgather(last) == [last] * comm.Get_size()
