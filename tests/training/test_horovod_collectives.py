"""adasum.horovod's alltoall, reducescatter, grouped calls, process sets, and the optimizer's Horovod
behaviours (names, broadcast_optimizer_state's zero gradients, Compression objects, the synchronize warning)."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch

import adasum.horovod as hvd


from helpers import ONE_SIZE, TRAINING_SIZES


def _rows_of(rank: int, n: int, cols: int = 3) -> torch.Tensor:
    return torch.arange(n * cols, dtype=torch.float64).reshape(n, cols) + 1000 * rank


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.int32, torch.bool])
@TRAINING_SIZES
def test_alltoall_with_and_without_splits(comm, dtype):
    size, rank = comm.Get_size(), comm.Get_rank()
    splits = [[(r + s) % 3 for s in range(size)] for r in range(size)]  # rank r sends splits[r][s] rows to s
    per_rank = [_rows_of(r, sum(splits[r]) + 1).to(dtype) for r in range(size)]  # one row never sent
    out, received = hvd.alltoall(per_rank[rank], torch.tensor(splits[rank], dtype=torch.int32))
    expected = []
    for r in range(size):
        start = sum(splits[r][:rank])
        expected.append(per_rank[r][start:start + splits[r][rank]])
    assert torch.equal(out, torch.cat(expected))
    assert received.dtype == torch.int32 and received.tolist() == [splits[r][rank] for r in range(size)]
    even = _rows_of(rank, 2 * size).to(dtype)
    assert torch.equal(hvd.alltoall(even), torch.cat([_rows_of(r, 2 * size).to(dtype)[2 * rank:2 * rank + 2]
                                                      for r in range(size)]))


@pytest.mark.mpi(min_size=2)
@TRAINING_SIZES
def test_alltoall_backward_sends_the_gradient_back(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    splits = torch.tensor([rank + 1] * size, dtype=torch.int32)
    x = _rows_of(rank, (rank + 1) * size + 2).requires_grad_()  # the last 2 rows are not sent
    out, received = hvd.alltoall(x, splits)
    weights = torch.arange(out.numel(), dtype=torch.float64).reshape(out.shape) * (rank + 1)
    (weights * out).sum().backward()
    # row j of what rank r sent to rank s is row (start + j) of rank s's output weights
    theirs = []
    for s in range(size):
        rows_s = [(r + 1) for r in range(size)]
        w = torch.arange(sum(rows_s) * 3, dtype=torch.float64).reshape(-1, 3) * (s + 1)
        start = sum(rows_s[:rank])
        theirs.append(w[start:start + rank + 1])
    expected = torch.cat(theirs + [torch.zeros(2, 3, dtype=torch.float64)])
    assert torch.equal(x.grad, expected)


@pytest.mark.mpi(min_size=2)
@ONE_SIZE
def test_alltoall_argument_errors_raise_on_every_rank(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    with pytest.raises(ValueError, match=f"rank {size - 1}: alltoall without splits needs a first dimension "
                                         f"that is a multiple of the number of ranks \\({size}\\)"):
        hvd.alltoall(torch.ones(size + (rank == size - 1)))
    with pytest.raises(ValueError, match="rank 0: alltoall's splits must be a tensor of int32"):
        hvd.alltoall(torch.ones(size), torch.ones(size, dtype=torch.float32 if rank == 0 else torch.int32))
    with pytest.raises(ValueError, match="adding up to at most the first dimension"):
        hvd.alltoall(torch.ones(size - 1), torch.ones(size, dtype=torch.int32))
    with pytest.raises(hvd.HorovodInternalError, match="alltoall calls differ"):
        hvd.alltoall(torch.ones(size, 2 + rank))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", [hvd.Sum, hvd.Average])
@pytest.mark.parametrize("dtype", [torch.float64, torch.int32])
@TRAINING_SIZES
def test_reducescatter(comm, op, dtype):
    size, rank = comm.Get_size(), comm.Get_rank()
    rows = 2 * size + 1  # the first rank gets one more row
    per_rank = [_rows_of(r, rows).to(dtype) for r in range(size)]
    total = sum(per_rank)
    if op == hvd.Average:
        total = torch.div(total, size, rounding_mode="trunc") if dtype == torch.int32 else total / size
    counts = [2 + (r == 0) for r in range(size)]
    start = sum(counts[:rank])
    out = hvd.reducescatter(per_rank[rank], op=op)
    assert out.dtype == dtype
    torch.testing.assert_close(out, total[start:start + counts[rank]], rtol=1e-15, atol=0)
    grouped = hvd.grouped_reducescatter([per_rank[rank], per_rank[rank][:size]], op=op)
    assert torch.equal(grouped[0], out)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", [hvd.Sum, hvd.Average])
@TRAINING_SIZES
def test_reducescatter_backward_is_horovods(comm, op):
    size, rank = comm.Get_size(), comm.Get_rank()
    x = _rows_of(rank, 2 * size).requires_grad_()
    out = hvd.reducescatter(x, op=op)
    out.backward(torch.full_like(out, float(rank + 1)))
    gathered = torch.cat([torch.full((2, 3), float(r + 1), dtype=torch.float64) for r in range(size)])
    assert torch.equal(x.grad, gathered * (size if op == hvd.Sum else 1))


@pytest.mark.mpi(min_size=2)
@ONE_SIZE
def test_reducescatter_refuses_adasum_and_scalars_on_every_rank(comm):
    rank = comm.Get_rank()
    with pytest.raises(NotImplementedError, match="rank 0: reducescatter does not take op=Adasum"):
        hvd.reducescatter(torch.ones(4), op=hvd.Adasum if rank == 0 else hvd.Sum)
    with pytest.raises(ValueError, match="needs tensors of at least 1 dimension"):
        hvd.reducescatter(torch.tensor(1.0))


@pytest.mark.mpi(min_size=2)
@TRAINING_SIZES
def test_grouped_calls_and_their_gradients(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    xs = [_rows_of(rank, 2).requires_grad_(), _rows_of(rank, rank + 1, cols=2).requires_grad_()]
    summed = hvd.grouped_allreduce(xs[:1] + [xs[1][:1]], op=hvd.Sum)
    assert torch.equal(summed[0], sum(_rows_of(r, 2) for r in range(size)))
    gathered = hvd.grouped_allgather(xs)
    assert torch.equal(gathered[1], torch.cat([_rows_of(r, r + 1, cols=2) for r in range(size)]))
    (summed[0].sum() + (gathered[1] * (rank + 1)).sum()).backward()
    assert torch.equal(xs[0].grad, torch.full((2, 3), float(size), dtype=torch.float64))
    mean_weight = sum(r + 1 for r in range(size)) / size  # allgather's gradient: the ranks' average
    assert torch.equal(xs[1].grad, torch.full((rank + 1, 2), mean_weight, dtype=torch.float64))
    ts = [torch.ones(3) * (rank + 1), torch.arange(4, dtype=torch.int64)]
    assert hvd.grouped_allreduce_(ts, op=hvd.Sum) is ts
    assert torch.equal(ts[1], torch.arange(4, dtype=torch.int64) * size)


@pytest.mark.mpi(min_size=2)
@TRAINING_SIZES
def test_process_sets_are_sub_communicators(comm):
    hvd.init()
    size, rank = comm.Get_size(), comm.Get_rank()
    evens, odds = [r for r in range(size) if r % 2 == 0], [r for r in range(size) if r % 2]
    even_set, odd_set = hvd.add_process_set(evens), hvd.add_process_set(hvd.ProcessSet(odds))
    mine, ranks = (even_set, evens) if rank % 2 == 0 else (odd_set, odds)
    assert mine.included() and mine.size() == len(ranks) and mine.rank() == ranks.index(rank)
    assert torch.equal(hvd.allreduce(torch.ones(2) * rank, op=hvd.Sum, process_set=mine),
                       torch.full((2,), float(sum(ranks))))
    assert torch.equal(hvd.allgather(torch.tensor([rank]), process_set=mine), torch.tensor(ranks))
    assert torch.equal(hvd.broadcast(torch.tensor([rank]), root_rank=ranks[-1], process_set=mine),
                       torch.tensor([ranks[-1]]))
    handle = hvd.allreduce_async(torch.ones(1), op=hvd.Sum, process_set=mine)
    assert hvd.synchronize(handle).item() == len(ranks)
    assert hvd.broadcast_object({"r": rank}, root_rank=ranks[0], process_set=mine) == {"r": ranks[0]}
    other = odd_set if mine is even_set else even_set
    with pytest.raises(ValueError, match=f"rank {rank} is not in the process set"):
        hvd.allreduce(torch.ones(1), process_set=other)
    assert hvd.remove_process_set(odd_set) and hvd.remove_process_set(even_set)
    with pytest.raises(ValueError, match="is not registered"):
        hvd.allreduce(torch.ones(1), process_set=mine)
    with pytest.raises(ValueError, match=r"add_process_set calls differ.*rank 1 passes ranks=\(1,\)"):
        hvd.add_process_set([0] if rank != 1 else [1])


@pytest.mark.mpi(min_size=2)
@TRAINING_SIZES
def test_distributed_optimizer_on_a_process_set(comm):
    """The ranks of the set average their gradients; a rank outside it steps on its own."""
    size, rank = comm.Get_size(), comm.Get_rank()
    hvd.init()
    first = hvd.add_process_set([0, 1])
    model = torch.nn.Linear(3, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters(), process_set=first)
    (model(torch.ones(1, 3)) * (rank + 1)).sum().backward()
    opt.step()
    expected = -1.5 if rank < 2 else -(rank + 1.0)
    assert torch.equal(model.weight.detach(), torch.full((1, 3), expected))
    hvd.remove_process_set(first)


def test_named_parameters_are_checked_as_horovod_does():
    net1, net2 = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(itertools.chain(net1.parameters(), net2.parameters()), lr=0.1)
    with pytest.raises(ValueError, match=r"unique; found duplicates: \['bias', 'weight'\]"):
        hvd.DistributedOptimizer(opt, named_parameters=itertools.chain(net1.named_parameters(),
                                                                       net2.named_parameters()))
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    opt = torch.optim.SGD([{"params": model[0].parameters()}, {"params": model[1].parameters()}], lr=0.1)
    unnamed = hvd.DistributedOptimizer(opt)
    assert list(unnamed._parameter_names.values()) == ["allreduce.noname.0.0", "allreduce.noname.0.1",
                                                      "allreduce.noname.1.0", "allreduce.noname.1.1"]


@pytest.mark.mpi(min_size=2)
@TRAINING_SIZES
def test_broadcast_optimizer_state_fills_zero_gradients(comm):
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    trained = torch.nn.Parameter(torch.ones(3) * comm.Get_rank())
    opt = hvd.DistributedOptimizer(torch.optim.SGD([frozen, trained], lr=0.1, momentum=0.9))
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert frozen.grad is None
    assert torch.equal(trained.grad, torch.zeros(3))
    assert torch.equal(trained.detach(), torch.ones(3) * comm.Get_rank())  # no step was taken


def test_compression_objects_compress_and_decompress():
    for dtype in (torch.float32, torch.float64):
        t = torch.linspace(-2, 2, 7, dtype=dtype)
        small, ctx = hvd.Compression.fp16.compress(t)
        assert small.dtype == torch.float16
        assert torch.equal(hvd.Compression.fp16.decompress(small, ctx), t.half().to(dtype))
    ints = torch.arange(4)
    same, ctx = hvd.Compression.fp16.compress(ints)
    assert same is ints and hvd.Compression.fp16.decompress(same, ctx) is ints
    assert hvd.Compression.none.compress(ints)[0] is ints


@pytest.mark.mpi(min_size=2)
@ONE_SIZE
def test_step_after_synchronize_warns_without_skip_synchronize(comm):
    model = torch.nn.Linear(2, 1)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    for skip in (False, True):
        opt.zero_grad()
        model(torch.ones(1, 2)).sum().backward()
        opt.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if skip:
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
        texts = [str(w.message) for w in caught]
        assert texts == ([] if skip else ["optimizer.step() called without optimizer.skip_synchronize() context "
                                          "after optimizer.synchronize(). This can cause training slowdown. You "
                                          "may want to consider using optimizer.skip_synchronize() context if you "
                                          "use optimizer.synchronize() in your code."])
