"""The error paths end alike on every rank: two different kinds of call never match each other, an argument
that one rank cannot take and an object the root cannot pickle raise the same clear error everywhere, the
explanation of a difference is watched by the stall inspector, copying a hook state makes no collective call,
and a refused call leaves no plan behind. Afterwards the library works on the same communicator."""

from __future__ import annotations

import copy
import pickle
import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")  # the DDP hook and the Horovod façade: the module needs torch

import adasum  # noqa: E402
import adasum.horovod as hvd  # noqa: E402
from adasum import AdasumMismatchError  # noqa: E402
from adasum.rule.reference import tree_combine  # noqa: E402
from adasum.torch.ddp import AdasumState, adasum_hook  # noqa: E402

from torch_helpers import GradBucket  # noqa: E402

pytestmark = [pytest.mark.mpi(min_size=2), pytest.mark.timeout(60)]


@pytest.fixture
def stall_timeout():
    """Where a rank could wait for ever, it raises after 5 s instead (the tests expect no wait at all)."""
    old = adasum.configure(stall_timeout=5.0)
    yield
    adasum.configure(old)


def _still_works(comm):
    """A good Adasum call and a good sum on ``comm`` give the serial reference's result on every rank."""
    rank, size = comm.Get_rank(), comm.Get_size()
    vectors = [np.arange(1.0, 7.0) * (r + 1) + (r % 2) * np.array([1, -1, 0, 2, 0, -3.0]) for r in range(size)]
    out = adasum.adasum_allreduce([torch.from_numpy(vectors[rank].copy())], comm=comm)
    np.testing.assert_allclose(out[0].numpy(), tree_combine(vectors), rtol=1e-12)
    total = adasum.adasum_allreduce(np.full(3, rank + 1.0), op="sum", comm=comm)
    np.testing.assert_array_equal(total, np.full(3, size * (size + 1) / 2))


def _quick(started: float) -> None:
    assert time.monotonic() - started < 4.0  # at once: no rank waited for a stall timeout


# --- two kinds of call -----------------------------------------------------------------------------------------

_CALLS = {
    "adasum_allreduce": (lambda: adasum.adasum_allreduce([np.ones(4)]), "adasum_allreduce"),
    "sum": (lambda: adasum.adasum_allreduce(np.ones(3), op="sum"), "adasum_allreduce"),
    "barrier": (hvd.barrier, "adasum.horovod.barrier"),
    "broadcast_object": (lambda: hvd.broadcast_object({"a": 1}, root_rank=0), "adasum.horovod.broadcast_object"),
    "allgather_object": (lambda: hvd.allgather_object(3), "adasum.horovod.allgather_object"),
    "hvd.allreduce": (lambda: hvd.allreduce(torch.ones(3)), "adasum.horovod.allreduce"),
    "hvd.broadcast": (lambda: hvd.broadcast(torch.ones(3), root_rank=0), "adasum.horovod.broadcast"),
}


@pytest.mark.parametrize("first, other", [("adasum_allreduce", "barrier"), ("sum", "broadcast_object"),
                                          ("barrier", "hvd.broadcast"), ("allgather_object", "hvd.allreduce"),
                                          ("adasum_allreduce", "hvd.broadcast")])
def test_ranks_in_different_calls_raise_everywhere_naming_both(comm, stall_timeout, first, other):
    """Rank 0 in one collective, the other ranks in another: no call matches the other's; every rank raises
    one error naming both calls and the ranks."""
    rank = comm.Get_rank()
    mine, theirs = _CALLS[first], _CALLS[other]
    call, _ = mine if rank == 0 else theirs
    started = time.monotonic()
    with pytest.raises(AdasumMismatchError) as raised:
        call()
    _quick(started)
    text = str(raised.value)
    assert text.startswith(f"(raised on rank {rank}) the ranks are in different calls: ")
    assert f"rank 1 is in {theirs[1]}" in text and f"rank 0 is in {mine[1]}" in text
    _still_works(comm)


# --- the Horovod façade's argument checks ------------------------------------------------------------------------

_FACADE = {
    "allgather": lambda t: hvd.allgather(t),
    "broadcast": lambda t: hvd.broadcast(t, root_rank=0),
    "broadcast_": lambda t: hvd.broadcast_(t, root_rank=0),
    "allreduce_": lambda t: hvd.allreduce_(t),
}


@pytest.mark.parametrize("name", sorted(_FACADE))
def test_a_non_tensor_on_one_rank_is_refused_everywhere(comm, stall_timeout, name):
    rank, bad = comm.Get_rank(), comm.Get_size() - 1
    arg = [1.0, 2.0] if rank == bad else torch.ones(2)
    started = time.monotonic()
    what = r"the tensor argument is a builtins\.list, not a torch\.Tensor"
    with pytest.raises(ValueError, match=rf"^\(raised on rank {rank}\) {name.rstrip('_')}: rank {bad}: {what}$"):
        _FACADE[name](arg)
    _quick(started)
    # the next calls of the façade meet each other
    got = hvd.allgather(torch.full((1, 2), float(rank)))
    assert torch.equal(got, torch.arange(comm.Get_size(), dtype=torch.float32).repeat_interleave(2).view(-1, 2))
    _still_works(comm)


class _Unpicklable:
    def __reduce__(self):
        raise TypeError("this object refuses to be pickled")


@pytest.mark.parametrize("root", ["first", "last"])
def test_broadcast_object_that_does_not_pickle_raises_everywhere(comm, stall_timeout, root):
    rank = comm.Get_rank()
    root = 0 if root == "first" else comm.Get_size() - 1
    started = time.monotonic()
    with pytest.raises(TypeError, match=rf"^rank {root}: broadcast_object: the object does not pickle "
                                        r"\(TypeError: this object refuses to be pickled\)$"):
        hvd.broadcast_object(_Unpicklable() if rank == root else None, root_rank=root)
    _quick(started)
    assert hvd.broadcast_object({"rank": rank} if rank == root else None, root_rank=root) == {"rank": root}
    _still_works(comm)


# --- the explanation of a difference, and hook states ------------------------------------------------------------

def test_ddp_hook_states_that_differ_in_compression_raise_everywhere(comm, stall_timeout):
    """fp16 on rank 0, full precision on the others: the fp16 wire's scale exchange meets the others'
    allreduce, and every rank raises at once, naming both."""
    rank = comm.Get_rank()
    state = AdasumState(compression="fp16" if rank == 0 else None)
    grads = [torch.ones(4) * (rank + 1), torch.ones(2)]
    started = time.monotonic()
    # the hook's thread raised it; its future is failed with the error's type and text (as DDP reads it)
    with pytest.raises(RuntimeError, match=r"AdasumMismatchError: .*the ranks are in different calls: rank 1 is in "
                                           r"adasum_allreduce .* rank 0 is in the fp16 wire's scales"):
        adasum_hook(state, GradBucket(grads)).wait()
    _quick(started)
    # the same states once they agree: the hook's communicator is usable
    state = AdasumState(op="sum", compression="fp16")
    adasum_hook(state, GradBucket(grads)).wait()
    want = comm.Get_size() * (comm.Get_size() + 1) / 2
    assert torch.equal(grads[0], torch.full((4,), want)) and torch.equal(grads[1], torch.full((2,), 1.0 * comm.Get_size()))
    _still_works(comm)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copying_a_hook_state_on_one_rank_makes_no_collective_call(comm, stall_timeout, how):
    rank = comm.Get_rank()
    state = AdasumState(op="sum")
    if rank == 0:
        done = []
        worker = threading.Thread(target=lambda: done.append(copy.deepcopy(state) if how == "deepcopy"
                                                              else pickle.loads(pickle.dumps(state))),
                                  daemon=True)
        worker.start()
        worker.join(10.0)
        assert done, "copying the state blocked"
        assert done[0].op == "sum"
    _still_works(comm)
    # a copy made on every rank reduces in the hook (its communicator found at its first reduction)
    twin = copy.deepcopy(state) if how == "deepcopy" else pickle.loads(pickle.dumps(state))
    grads = [torch.full((3,), rank + 1.0)]
    adasum_hook(twin, GradBucket(grads)).wait()
    assert torch.equal(grads[0], torch.full((3,), comm.Get_size() * (comm.Get_size() + 1) / 2))
    _still_works(comm)


# --- plans ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("op", ["adasum", "sum"])
def test_a_refused_call_leaves_no_plan_behind(comm, stall_timeout, op):
    """Call 1: the last rank passes a sparse tensor, the others a dense one of the same shape; call 2: every
    rank a sparse one; call 3 a good one. The first two are refused on every rank, the third works."""
    rank, bad = comm.Get_rank(), comm.Get_size() - 1
    dense = torch.ones(4) * (rank + 1)
    first = [dense.to_sparse() if rank == bad else dense]
    with pytest.raises(TypeError, match=rf"^rank {bad}: tensor 0 is a sparse tensor"):
        adasum.adasum_allreduce(first, op=op)
    started = time.monotonic()
    with pytest.raises(TypeError, match=r"^rank 0: tensor 0 is a sparse tensor"):
        adasum.adasum_allreduce([dense.to_sparse()], op=op)
    _quick(started)
    got = adasum.adasum_allreduce([dense], op=op)[0]
    if op == "sum":
        assert torch.equal(got, torch.full((4,), comm.Get_size() * (comm.Get_size() + 1) / 2))
    else:
        np.testing.assert_allclose(got.numpy(), tree_combine([np.ones(4) * (r + 1) for r in range(comm.Get_size())]),
                                   rtol=1e-6)
    _still_works(comm)


@pytest.mark.parametrize("native", [True, False], ids=["compiled", "python"])
@pytest.mark.parametrize("op", ["adasum", "sum", "mean"])
def test_a_sparse_tensor_after_a_dense_call_of_its_shape_is_refused_everywhere(comm, stall_timeout, op, native):
    """A plan kept for a dense tensor is not the plan of a sparse one of the same shape (sum and mean find
    it, and their paths, compiled or not, refuse the sparse tensor before any data moves)."""
    rank = comm.Get_rank()
    dense = torch.ones(4) * (rank + 1)
    old = adasum.configure(native_mpi=native)
    try:
        adasum.adasum_allreduce([dense], op=op)
        adasum.adasum_allreduce([dense], op=op)
        for call in (adasum.adasum_allreduce, adasum.adasum_allreduce_inplace):
            with pytest.raises(TypeError, match=r"^rank 0: tensor 0 is a sparse tensor"):
                call([dense.to_sparse()], op=op)
    finally:
        adasum.configure(old)
    _still_works(comm)
