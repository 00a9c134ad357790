"""torch DDP with Adasum: ``adasum.torch.init_process_group`` under mpiexec, the gradient hook against the
collective and against DistributedOptimizer, the weight-delta hook against DistributedOptimizer, across
DDP's options."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed as dist

import adasum
import adasum.torch as at
from adasum.torch.ddp import AdasumState, DeltaState, adasum_delta_hook, adasum_hook

from helpers import ONE_SIZE, TRAINING_SIZES, assert_identical_across_ranks, raw_bytes
from torch_helpers import loss_of


class Net(torch.nn.Module):
    """Two layers; ``unused``: and a third that forward never uses (for find_unused_parameters)."""

    def __init__(self, unused: bool):
        super().__init__()
        self.a = torch.nn.Linear(8, 32)
        self.b = torch.nn.Linear(32, 4)
        if unused:
            self.unused = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def net(unused: bool = False) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Net(unused).double()


def batches(comm, n: int):
    """This rank's shard: its own batches."""
    g = torch.Generator().manual_seed(1000 + comm.Get_rank())
    return [(torch.randn(5, 8, generator=g, dtype=torch.float64), torch.randn(5, 4, generator=g,
                                                                             dtype=torch.float64))
            for _ in range(n)]




@pytest.mark.mpi(min_size=1)
@ONE_SIZE
def test_init_process_group_from_mpi(comm, pg):
    assert (dist.get_rank(), dist.get_world_size()) == (comm.Get_rank(), comm.Get_size())
    assert os.environ["RANK"] == str(comm.Get_rank()) and os.environ["WORLD_SIZE"] == str(comm.Get_size())
    assert os.environ["LOCAL_RANK"] == str(adasum.local_rank(comm))
    assert os.environ["LOCAL_WORLD_SIZE"] == str(adasum.local_size(comm))
    at.init_process_group(comm=comm)  # again: nothing changes
    t = torch.tensor([float(comm.Get_rank())])
    dist.all_reduce(t)
    assert t.item() == sum(range(comm.Get_size()))
    if comm.Get_size() > 1:
        with pytest.raises(RuntimeError, match=r"already initialised as rank \d+ of \d+, but this is rank 0 of 1"):
            at.init_process_group(comm=adasum.runtime.world.MPI.COMM_SELF)


def run_ddp(comm, hook_state, hook, *, steps=4, k=1, opt_fn=None, **ddp_kwargs):
    model = net(ddp_kwargs.get("find_unused_parameters", False))
    ddp = torch.nn.parallel.DistributedDataParallel(model, **ddp_kwargs)
    ddp.register_comm_hook(hook_state(ddp) if callable(hook_state) else hook_state, hook)
    opt = opt_fn(ddp.parameters()) if opt_fn else torch.optim.SGD(ddp.parameters(), lr=0.1)
    def window():
        if hook is adasum_hook:
            opt.step()
        opt.zero_grad()

    ddp_windows(comm, ddp, steps, k, window)
    return model


def ddp_windows(comm, ddp, steps: int, k: int, after_window) -> None:
    """``steps`` windows of ``k`` micro-batches of this rank's batches through ``ddp`` (all but the last of
    a window under ``no_sync()``), calling ``after_window()`` after each."""
    data = batches(comm, steps * k)
    for i in range(steps):
        for j in range(k):
            x, y = data[i * k + j]
            if j < k - 1:
                with ddp.no_sync():
                    loss_of(ddp, x, y).backward()
            else:
                loss_of(ddp, x, y).backward()
        after_window()


def run_optimizer(comm, *, steps=4, k=1, opt_fn=None, op="adasum", unused=False):
    model = net(unused)
    inner = opt_fn(model.parameters()) if opt_fn else torch.optim.SGD(model.parameters(), lr=0.1)
    opt = at.DistributedOptimizer(inner, op=op, accumulation_steps=k)
    for x, y in batches(comm, steps * k):
        loss_of(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    return model


DDP_OPTIONS = [
    {},
    {"gradient_as_bucket_view": True},
    {"static_graph": True},
    {"find_unused_parameters": True},
    {"bucket_cap_mb": 0.0005},  # a bucket per parameter or two
]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("options", DDP_OPTIONS, ids=lambda o: ",".join(o) or "default")
@TRAINING_SIZES
@pytest.mark.smoke
def test_gradient_hook_with_sgd_is_distributed_optimizer(comm, pg, options):
    """Adasum(c·a, c·b) = c·Adasum(a, b): with plain SGD, Adasum of the gradients is Adasum of the deltas."""
    hooked = run_ddp(comm, AdasumState(), adasum_hook, **options)
    plain = run_optimizer(comm, unused="find_unused_parameters" in options)
    assert_identical_across_ranks(comm, list(hooked.parameters()))
    for a, b in zip(hooked.parameters(), plain.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    # each rank trained on its own shard: the hooked model moved away from the start
    assert any(not torch.equal(a, b) for a, b in zip(hooked.parameters(), net().parameters()))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", ["sum", "mean"])
@TRAINING_SIZES
def test_gradient_hook_sum_mean_with_no_sync(comm, pg, op):
    """DDP's no_sync sums a window's gradients, DistributedOptimizer averages them: at twice the rate the
    updates agree."""
    hooked = run_ddp(comm, AdasumState(op=op), adasum_hook, k=2)
    plain = run_optimizer(comm, k=2, op=op, opt_fn=lambda ps: torch.optim.SGD(ps, lr=0.2))
    assert_identical_across_ranks(comm, list(hooked.parameters()))
    for a, b in zip(hooked.parameters(), plain.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("options", DDP_OPTIONS, ids=lambda o: ",".join(o) or "default")
@pytest.mark.parametrize("optimizer", ["sgd-momentum", "adamw"])
@TRAINING_SIZES
def test_delta_hook_is_bitwise_distributed_optimizer(comm, pg, options, optimizer):
    def opt_fn(params):
        if optimizer == "adamw":
            return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)

    model = net("find_unused_parameters" in options)
    ddp = torch.nn.parallel.DistributedDataParallel(model, **options)
    opt = opt_fn(ddp.parameters())
    state = DeltaState(opt)
    ddp.register_comm_hook(state, adasum_delta_hook)
    for x, y in batches(comm, 4):
        loss_of(ddp, x, y).backward()
        opt.zero_grad()
    assert state.updates == 4 and state.skipped_updates == 0
    plain = run_optimizer(comm, opt_fn=opt_fn, unused="find_unused_parameters" in options)
    assert [raw_bytes(p) for p in model.parameters()] == [raw_bytes(p) for p in plain.parameters()]
    with pytest.raises(RuntimeError, match="do not call optimizer.step"):
        opt.step()


@pytest.mark.mpi(min_size=2)
@TRAINING_SIZES
def test_delta_hook_hierarchical_is_bitwise_distributed_optimizer(comm, pg):
    """``hierarchical=True`` reaches the delta hook's combine: the same bits as the optimizer's, and not
    the flat combine's (here one node: the node's mean of the deltas)."""
    def opt_fn(params):
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)

    model = net()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = opt_fn(ddp.parameters())
    ddp.register_comm_hook(DeltaState(opt, hierarchical=True), adasum_delta_hook)
    for x, y in batches(comm, 3):
        loss_of(ddp, x, y).backward()
        opt.zero_grad()
    plain = net()
    wrapped = at.DistributedOptimizer(opt_fn(plain.parameters()), hierarchical=True)
    for x, y in batches(comm, 3):
        loss_of(plain, x, y).backward()
        wrapped.step()
        wrapped.zero_grad()
    assert [raw_bytes(p) for p in model.parameters()] == [raw_bytes(p) for p in plain.parameters()]
    flat = run_optimizer(comm, steps=3, opt_fn=opt_fn)
    assert [raw_bytes(p) for p in flat.parameters()] != [raw_bytes(p) for p in plain.parameters()]


@pytest.mark.mpi(min_size=2)
@ONE_SIZE
def test_delta_hook_skips_nonfinite_on_every_rank(comm, pg):
    model = net()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=0.01)
    state = DeltaState(opt)
    ddp.register_comm_hook(state, adasum_delta_hook)
    for i, (x, y) in enumerate(batches(comm, 3)):
        before = [raw_bytes(p) for p in model.parameters()]
        scale = float("nan") if i == 1 and comm.Get_rank() == comm.Get_size() - 1 else 1.0
        (loss_of(ddp, x, y) * scale).backward()
        opt.zero_grad()
        assert state.step_was_skipped == (i == 1)
        if i == 1:
            assert [raw_bytes(p) for p in model.parameters()] == before
    assert state.skipped_updates == 1
    assert_identical_across_ranks(comm, list(model.parameters()))


@pytest.mark.mpi(min_size=2)
@ONE_SIZE
def test_a_second_delta_state_of_one_optimizer_is_refused(comm, pg):
    model = net()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=0.01)
    state = DeltaState(opt)
    with pytest.raises(ValueError, match="this Adam already has a DeltaState, which steps all its parameters "
                                         "inside backward: one DeltaState per optimizer"):
        DeltaState(opt)
    ddp.register_comm_hook(state, adasum_delta_hook)
    for x, y in batches(comm, 2):  # the first state trains on, untouched
        loss_of(ddp, x, y).backward()
        opt.zero_grad()
    assert state.updates == 2
    assert_identical_across_ranks(comm, list(model.parameters()))
    del ddp, state
    import gc

    gc.collect()
    assert DeltaState(opt).optimizer is opt  # once the first is gone, the optimizer takes a new one


@pytest.mark.mpi(min_size=2)
@ONE_SIZE
def test_hook_mismatch_raises_on_every_rank(comm, pg):
    """One rank's model has another shape: the collective's agreement raises on every rank, no hang."""
    width = 32 if comm.Get_rank() == 0 else 33
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, width).double()
    state = AdasumState()
    g = next(iter(batches(comm, 1)))[0]
    # DDP itself checks shapes at construction; the hook alone is what runs here, on a bucket-like call
    grads = [torch.autograd.grad(model(g).sum(), p)[0] for p in model.parameters()]
    with pytest.raises(adasum.AdasumMismatchError, match="tensor 0 differs"):
        state.wire.adasum_(grads, state.comm)


def test_state_pickles_without_its_communicator():
    state = AdasumState(op="mean", compression="bf16")
    copy = pickle.loads(pickle.dumps(state))
    assert copy.op == "mean" and copy.wire.name == "bf16" and copy.comm is not state.comm


def test_delta_state_leaves_the_optimizer_as_it_was():
    import gc

    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.5)
    state = DeltaState(opt, comm=adasum.runtime.world.MPI.COMM_SELF)
    p.grad = torch.ones(3)
    with pytest.raises(RuntimeError, match="do not call optimizer.step"):
        opt.step()
    del state
    gc.collect()
    opt.step()  # no hook left behind
    assert torch.equal(p.detach(), torch.full((3,), 0.5))

