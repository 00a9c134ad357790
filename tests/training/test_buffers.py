"""Buffers (BatchNorm's running statistics, counters, constant tables) kept alike across ranks by
DistributedOptimizer(module=..., buffers=...): averaged changes or rank 0's, at every boundary."""

from __future__ import annotations

import pytest
import torch

from adasum.torch import DistributedOptimizer

from helpers import ONE_SIZE, TRAINING_SIZES, assert_identical_across_ranks, raw_bytes


class BNNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.lin = torch.nn.Linear(5, 4).double()
            self.bn = torch.nn.BatchNorm1d(4).double()
            self.out = torch.nn.Linear(4, 3).double()
        self.register_buffer("table", torch.linspace(0.1, 1.0, 7, dtype=torch.float32) / 3)  # a constant

    def forward(self, x):
        return self.out(torch.tanh(self.bn(self.lin(x))))


def batch(rank: int, step: int, micro: int):
    g = torch.Generator().manual_seed(1000 * rank + 37 * step + micro + 1)
    # each rank's inputs have their own offset, so its running statistics differ from the others'
    return torch.randn(6, 5, generator=g, dtype=torch.float64) + rank, torch.randn(6, 3, generator=g,
                                                                                  dtype=torch.float64)


def buffers_of(net) -> list[torch.Tensor]:
    return [b.detach().clone() for b in net.buffers()]


def train(comm, net, opt, windows: int, accumulate: int, before_boundary=None):
    for step in range(windows):
        for micro in range(accumulate):
            x, y = batch(comm.Get_rank(), step, micro)
            torch.nn.functional.mse_loss(net(x), y).backward()
            if micro == accumulate - 1 and before_boundary is not None:
                before_boundary()
            opt.step()
            opt.zero_grad()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", ["adasum", "mean"])
@pytest.mark.parametrize("overlap", [False, True])
@TRAINING_SIZES
def test_average_keeps_buffers_alike_as_the_mean_of_the_changes(comm, op, overlap):
    net = BNNet()
    table = raw_bytes(net.table)
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), op=op, accumulation_steps=2,
                               overlap=overlap, module=net)
    assert opt.buffers == "average"
    size = comm.Get_size()
    seen = []

    def before():  # every rank's buffers as the window ends, and the values kept at the last boundary
        seen.append(comm.allgather(buffers_of(net)))

    kept = buffers_of(net)
    for step in range(3):
        train(comm, net, opt, 1, 2, before)
        everyone = seen[-1]
        for i, (name, buf) in enumerate(net.named_buffers()):
            if buf.is_floating_point():
                want = kept[i] + sum(r[i] - kept[i] for r in everyone) / size
                torch.testing.assert_close(buf, want, rtol=0, atol=1e-14)
            else:  # num_batches_tracked: an integer, advanced by the window's two forwards
                assert buf.dtype == torch.int64 and int(buf) == 2 * (step + 1), name
        kept = buffers_of(net)
        assert_identical_across_ranks(comm, kept + list(net.parameters()))
    # the ranks' statistics did differ before each boundary
    assert any(not torch.equal(seen[-1][0][1], r[1]) for r in seen[-1])
    assert raw_bytes(net.table) == table  # a buffer nobody changed keeps its bits
    net.eval()
    out = net(torch.linspace(-1, 1, 20, dtype=torch.float64).reshape(4, 5))
    assert_identical_across_ranks(comm, [out])


@pytest.mark.mpi(min_size=2)
@ONE_SIZE
def test_broadcast_takes_rank_0s_buffers_at_each_boundary(comm):
    net = BNNet()
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), module=net, buffers="broadcast")
    seen = []
    for step in range(3):
        train(comm, net, opt, 1, 1, lambda: seen.append(comm.bcast(buffers_of(net), root=0)))
        assert [raw_bytes(b) for b in net.buffers()] == [raw_bytes(b) for b in seen[-1]]
        assert_identical_across_ranks(comm, list(net.buffers()))


@pytest.mark.mpi(min_size=2)
@ONE_SIZE
def test_buffers_of_an_iterable_and_the_default_without_module(comm):
    net = BNNet()
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), module=net.bn.buffers())
    train(comm, net, opt, 2, 1)
    assert_identical_across_ranks(comm, list(net.bn.buffers()))
    # without module the buffers are each rank's own
    net = BNNet()
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1))
    assert opt.buffers is None
    train(comm, net, opt, 2, 1)
    means = comm.allgather(raw_bytes(net.bn.running_mean))
    assert len(set(means)) == comm.Get_size()


@pytest.mark.mpi(min_size=2)
@ONE_SIZE
def test_buffers_the_module_replaces_are_followed(comm):
    net = BNNet()
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), module=net)
    train(comm, net, opt, 1, 1)
    net.bn.running_mean = net.bn.running_mean.clone()  # a new tensor under the same name, as module.to() makes
    net.table = net.table.to(torch.float64)
    train(comm, net, opt, 2, 1)
    assert net.table.dtype == torch.float64
    assert_identical_across_ranks(comm, list(net.buffers()))


@pytest.mark.mpi(min_size=2)
@ONE_SIZE
def test_ranks_that_disagree_on_buffers_raise_on_every_rank(comm):
    last = comm.Get_size() - 1
    net = BNNet()
    mode = "broadcast" if comm.Get_rank() == last else "average"
    with pytest.raises(ValueError, match=rf"ranks disagree on buffers of DistributedOptimizer: rank {last} has "
                                         r"'broadcast', rank 0 has 'average'"):
        DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), module=net, buffers=mode)
    extra = torch.zeros(4 if comm.Get_rank() == last else 3)
    with pytest.raises(ValueError, match=rf"buffer shapes or dtypes of rank\(s\) {last} differ"):
        DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), module=[*net.buffers(), extra])


def test_buffer_arguments_are_checked():
    net = BNNet()
    sgd = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="buffers must be 'average', 'broadcast' or None, got 'mean'"):
        DistributedOptimizer(sgd, module=net, buffers="mean")
    with pytest.raises(ValueError, match="buffers='broadcast' needs the model: pass module=model"):
        DistributedOptimizer(sgd, buffers="broadcast")
    with pytest.raises(TypeError, match="module: entry 0 is a str, not a tensor"):
        DistributedOptimizer(sgd, module=["x"])
    with pytest.raises(TypeError, match="complex dtype"):
        DistributedOptimizer(sgd, module=[torch.zeros(2, dtype=torch.complex64)])
