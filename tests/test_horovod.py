"""adasum.horovod: a training loop written for Horovod's torch API, run through the compatibility module,
gives what the library's own API gives for the same loop, at any world size."""

from __future__ import annotations

import pytest
import torch

import adasum.horovod as hvd
import adasum.torch as at
from adasum.reference import reference_allreduce

from helpers import assert_identical_across_ranks, raw_bytes


def horovod_style_training(dist_opt, passes: int = 2, steps: int = 3, seed_rank: bool = True):
    """Horovod's calling convention: zero_grad, ``passes`` backward passes, one step()."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234 + (hvd.rank() if seed_rank else 0))  # ranks start apart: broadcast fixes it
        model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05 * hvd.size(), momentum=0.9)
    opt = dist_opt(opt, model)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    g = torch.Generator().manual_seed(hvd.rank())
    for _ in range(steps):
        opt.zero_grad()
        for _ in range(passes):
            x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
            torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("compression", [hvd.Compression.none, hvd.Compression.fp16])
def test_horovod_script_runs_and_matches_the_library(comm, passes, compression):
    hvd.init()
    assert (hvd.rank(), hvd.size()) == (comm.Get_rank(), comm.Get_size())
    assert 0 <= hvd.local_rank() < hvd.local_size() <= hvd.size()

    def ported(opt, model):
        return hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), op=hvd.Adasum,
                                        backward_passes_per_step=passes, compression=compression)

    def native(opt, model):
        return at.DistributedOptimizer(opt, op="adasum", compression=compression, overlap=False)

    a = horovod_style_training(ported, passes)
    b = horovod_style_training(native, passes)
    assert [raw_bytes(p) for p in a.parameters()] == [raw_bytes(p) for p in b.parameters()]
    assert_identical_across_ranks(comm, list(a.parameters()))


@pytest.mark.mpi(min_size=1)
def test_allreduce_ops(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    per_rank = [torch.arange(6, dtype=torch.float64).reshape(2, 3) * (r + 1) - r for r in range(size)]
    mine = per_rank[rank]
    torch.testing.assert_close(hvd.allreduce(mine), sum(per_rank) / size)
    torch.testing.assert_close(hvd.allreduce(mine, op=hvd.Sum), sum(per_rank))
    torch.testing.assert_close(hvd.allreduce(mine, average=True), sum(per_rank) / size)
    expected = reference_allreduce([[t.numpy()] for t in per_rank])[0]
    torch.testing.assert_close(hvd.allreduce(mine, op=hvd.Adasum), torch.from_numpy(expected))
    half = hvd.allreduce(mine.float(), op=hvd.Sum, compression=hvd.Compression.fp16)
    assert half.dtype == torch.float32
    torch.testing.assert_close(half, sum(per_rank).float(), rtol=2e-3, atol=2e-3)
    t = mine.clone()
    assert hvd.allreduce_(t, op=hvd.Sum) is t or torch.equal(t, sum(per_rank))
    torch.testing.assert_close(t, sum(per_rank))


def test_unsupported_horovod_arguments_raise():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        hvd.DistributedOptimizer(opt, gradient_predivide_factor=2.0)
    with pytest.raises(ValueError, match="named_parameters"):
        hvd.DistributedOptimizer(opt, named_parameters=[("w", model.weight)])
