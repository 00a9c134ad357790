"""``adasum.torch.elastic.ElasticDDP`` where the world does not change: it trains as the DDP model with the
same hook does, and its ``rejoin()`` (what an elastic reset calls) makes a new DDP model and hook state that
go on bitwise as if nothing happened, the old state released. The deaths themselves: tests/elastic/."""

from __future__ import annotations

import pytest
import torch

from adasum.torch.ddp import AdasumState, DeltaState, adasum_delta_hook, adasum_hook
from adasum.torch.elastic import ElasticDDP

from helpers import ONE_SIZE, assert_identical_across_ranks, raw_bytes

pytestmark = [pytest.mark.mpi(min_size=2), ONE_SIZE]


def make():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    return net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)


def hook(form: str, opt):
    return (AdasumState(), adasum_hook) if form == "grad" else (DeltaState(opt), adasum_delta_hook)


def steps(model, opt, form: str, rank: int, first: int, last: int) -> None:
    for step in range(first, last):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        if form == "grad":
            opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("form", ["grad", "delta"])
def test_rejoin_goes_on_bitwise(pg, comm, form):
    net, opt = make()
    model = ElasticDDP(net, lambda: hook(form, opt))
    steps(model, opt, form, comm.Get_rank(), 0, 3)
    old_ddp, old_state = model.ddp, model.hook_state
    model.rejoin()
    assert model.ddp is not old_ddp and model.hook_state is not old_state and old_state.closed
    steps(model, opt, form, comm.Get_rank(), 3, 6)
    model.close()

    plain, plain_opt = make()
    ddp = torch.nn.parallel.DistributedDataParallel(plain)
    state, fn = hook(form, plain_opt)
    ddp.register_comm_hook(state, fn)
    steps(ddp, plain_opt, form, comm.Get_rank(), 0, 6)
    state.close()
    assert [raw_bytes(p) for p in net.parameters()] == [raw_bytes(p) for p in plain.parameters()]
    assert_identical_across_ranks(comm, list(net.parameters()))
    assert model.state_dict().keys() == net.state_dict().keys()  # the module's own, no "module." prefix


def test_comm_hook_must_be_a_function(pg, comm):
    net, _ = make()
    with pytest.raises(TypeError, match=r"comm_hook must be a function of no arguments .* adasum_hook takes "
                                        r"state, bucket"):
        ElasticDDP(net, adasum_hook)


def test_restart_process_group_follows_the_world(pg, comm):
    """A default group of another size than the current world (as after the world grew back) is destroyed
    and started again on the world; one that matches is kept."""
    import torch.distributed as dist

    import adasum.torch as at
    from adasum.torch.elastic import restart_process_group

    kept = dist.group.WORLD
    restart_process_group()
    assert dist.group.WORLD is kept
    dist.destroy_process_group()
    alone = comm.Split(comm.Get_rank(), 0)
    at.init_process_group("gloo", comm=alone)  # each rank a group of its own
    assert dist.get_world_size() == 1
    restart_process_group("gloo")  # a backend given, as ElasticDDP gives its own
    assert (dist.get_rank(), dist.get_world_size()) == (comm.Get_rank(), comm.Get_size())
    alone.Free()
