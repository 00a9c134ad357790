"""The window's rules on the FSDP2 paths, at 4 ranks (a 2×2 mesh: two replicas of two shards): a NaN on one
replica skips the combine on every rank; a rank that skips or adds a ``step()`` or whose local step raises
makes every rank raise instead of leaving the others in a collective; a parameter one replica does not use
raises on both replicas; the one-hook rule holds whether or not the caller keeps the handle."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.mpi, pytest.mark.world_size(4), pytest.mark.fsdp]

pytest.importorskip("torch.distributed.fsdp")

from adasum.torch.fsdp import ReplicaDeltas, adasum_replicas  # noqa: E402

from helpers import assert_identical_across_ranks  # noqa: E402
from fsdp_helpers import LR, batch, fresh, full, make_mesh, shard  # noqa: E402


def one_step(model, opt, step: int, rank: int, poison: bool = False) -> None:
    x, y = batch(step, rank)
    loss = torch.nn.functional.mse_loss(model(x), y)
    if poison:
        loss = loss * float("nan")
    loss.backward()
    opt.step()
    opt.zero_grad()


def local_shards(model) -> list[torch.Tensor]:
    return [p.to_local().detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("op", ["adasum", "mean"])
@pytest.mark.parametrize("local_steps", [1, 2])
def test_deltas_nan_on_one_replica_is_skipped_everywhere(pg, comm, op, local_steps):
    """Rank 3's loss is NaN in the second window. One step per window: every rank skips that combine
    (parameters back at the window's start, counted). Local steps: the replica skips that local step and
    the window combines what it holds. Either way training goes on alike and finite on every rank."""
    mesh = make_mesh((2, 2))
    model = shard(fresh(), mesh["shard"])
    opt = ReplicaDeltas(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), model, mesh, op=op,
                        local_steps=local_steps)
    rank = comm.Get_rank()
    step = 0
    for _ in range(local_steps):
        one_step(model, opt, step, rank)
        step += 1
    assert not opt.step_was_skipped
    before = local_shards(model)
    for i in range(local_steps):
        one_step(model, opt, step, rank, poison=(rank == 3 and i == local_steps - 1))
        step += 1
    skipped = local_steps == 1
    assert opt.step_was_skipped == skipped and opt.skipped_updates == skipped and opt.windows == 2
    assert all(torch.equal(p, b) for p, b in zip(local_shards(model), before)) == skipped
    for _ in range(local_steps):
        one_step(model, opt, step, rank)
        step += 1
    assert not opt.step_was_skipped and opt.skipped_updates == skipped
    got = full(model)
    opt.close()
    assert all(np.isfinite(g).all() for g in got)
    assert not all(np.array_equal(g, b.to(torch.float64).numpy()) for g, b in zip(got, before))
    assert_identical_across_ranks(comm, got)


@pytest.mark.parametrize("local_steps", [1, 3])
def test_deltas_skipped_step_raises_everywhere(pg, comm, local_steps):
    """Rank 1 catches its own error and skips one ``step()``: the others' next combine or forward meets its
    forward's check, and every rank raises naming the counts (nobody waits in FSDP's all-gather)."""
    mesh = make_mesh((2, 2))
    model = shard(fresh(), mesh["shard"])
    opt = ReplicaDeltas(torch.optim.SGD(model.parameters(), lr=LR), model, mesh, local_steps=local_steps)
    rank = comm.Get_rank()
    one_step(model, opt, 0, rank)
    with pytest.raises(RuntimeError, match=r"the ranks' windows differ .*'local steps'"):
        for step in range(1, 4 * local_steps):
            x, y = batch(step, rank)
            torch.nn.functional.mse_loss(model(x), y).backward()
            if not (rank == 1 and step == 1):
                opt.step()
            opt.zero_grad()
    opt.close()


def test_deltas_failed_local_step_raises_everywhere(pg, comm):
    """The wrapped optimizer raises on rank 2 at a step that combines: every rank raises, naming it, with
    the parameters back at the window's start."""

    class Flaky(torch.optim.SGD):
        fail = False

        def step(self, closure=None):
            if self.fail:
                raise FloatingPointError("bad step")
            return super().step(closure)

    mesh = make_mesh((2, 2))
    model = shard(fresh(), mesh["shard"])
    inner = Flaky(model.parameters(), lr=LR)
    opt = ReplicaDeltas(inner, model, mesh)
    rank = comm.Get_rank()
    one_step(model, opt, 0, rank)
    before = local_shards(model)
    inner.fail = rank == 2
    with pytest.raises(RuntimeError, match=r"rank 2: the wrapped optimizer's step raised FloatingPointError: bad step"):
        one_step(model, opt, 1, rank)
    assert all(torch.equal(p, b) for p, b in zip(local_shards(model), before))
    inner.fail = False
    one_step(model, opt, 2, rank)  # the job goes on from the window's start, alike everywhere
    assert_identical_across_ranks(comm, full(model))
    opt.close()


class SometimesSpare(torch.nn.Module):
    """A linear layer with a second one that forward uses on some ranks only."""

    def __init__(self, use_spare: bool):
        super().__init__()
        self.lin = torch.nn.Linear(5, 3)
        self.spare = torch.nn.Linear(3, 3)
        self.use_spare = use_spare

    def forward(self, x):
        out = self.lin(x)
        return out + 0.0 * self.spare(out) if self.use_spare else out


@pytest.mark.parametrize("op", ["adasum", "mean"])
def test_parameter_unused_by_one_replica_raises_on_both(pg, comm, op):
    """Replica 0 does not use a parameter, replica 1 does: replica 0's hook cannot cut its buffer, and
    replica 1's ranks, waiting for it in the reduction, raise too."""
    mesh = make_mesh((2, 2))
    model = fresh()
    model.b = SometimesSpare(use_spare=comm.Get_rank() >= 2)
    shard(model, mesh["shard"])
    hooks = adasum_replicas(model, mesh, op=op)
    x, y = batch(0, comm.Get_rank())
    with pytest.raises(Exception, match=r"rank [01]: (RuntimeError: )?adasum_replicas: FSDP module b handed its hook shape"):
        torch.nn.functional.mse_loss(model(x), y).backward()
    hooks.close()


def test_one_hook_rule_holds_without_the_handle(pg, comm):
    """``adasum_replicas(model, mesh)`` with its handle dropped (as most scripts write it): the hooks stay,
    a second call and the delta form are refused, and training combines across the replicas."""
    mesh = make_mesh((2, 2))
    model = shard(fresh(), mesh["shard"])
    adasum_replicas(model, mesh)
    gc.collect()
    with pytest.raises(ValueError, match=r"already runs the hook of adasum_replicas"):
        adasum_replicas(model, mesh)
    with pytest.raises(ValueError, match=r"already runs the hook of adasum_replicas: the delta form"):
        ReplicaDeltas(torch.optim.SGD(model.parameters(), lr=LR), model, mesh)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(3):
        one_step(model, opt, step, comm.Get_rank())
    assert_identical_across_ranks(comm, full(model))  # without the hook the replicas would drift apart


def _train_wire(form: str, op: str, compression, rank: int, steps: int = 3) -> list[np.ndarray]:
    mesh = make_mesh((2, 2))
    model = shard(fresh(), mesh["shard"])
    inner = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    if form == "hook":
        hooks = adasum_replicas(model, mesh, op=op, compression=compression)
        opt = inner
    else:
        hooks, opt = None, ReplicaDeltas(inner, model, mesh, op=op, compression=compression)
    for step in range(steps):
        one_step(model, opt, step, rank)
    out = full(model)
    if hooks is not None:
        hooks.close()
    return out


@pytest.mark.parametrize("form, op, compression", [("hook", "adasum", "fp16"), ("hook", "mean", "bf16"),
                                                   ("deltas", "adasum", "bf16"), ("deltas", "mean", "fp16")])
def test_sixteen_bit_wire_between_replicas(pg, comm, form, op, compression):
    """compression= on both FSDP2 forms (each op and each 16-bit format once): the replicas end bitwise
    alike, within 16-bit rounding of the float32 wire's model, and not equal to it (the shards did travel in
    16 bits; fp16's per-layer scales are agreed over both groups, so every piece of a layer takes the
    same)."""
    rank = comm.Get_rank()
    exact = _train_wire(form, op, None, rank)
    sixteen = _train_wire(form, op, compression, rank)
    assert_identical_across_ranks(comm, sixteen)
    tol = {"bf16": 2e-2, "fp16": 2e-3}[compression]
    for a, b in zip(sixteen, exact):
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol * float(np.abs(b).max()))
    assert any(not np.array_equal(a, b) for a, b in zip(sixteen, exact))


@pytest.mark.parametrize("form", ["hook", "deltas"])
def test_wire_setting_checked_on_every_rank(pg, comm, form):
    """An unknown compression on one rank, or another compression than rank 0's, raises on every rank,
    naming the rank."""
    mesh = make_mesh((2, 2))
    model = shard(fresh(), mesh["shard"])
    rank = comm.Get_rank()

    def make(compression):
        if form == "hook":
            return adasum_replicas(model, mesh, compression=compression)
        return ReplicaDeltas(torch.optim.SGD(model.parameters(), lr=LR), model, mesh, compression=compression)

    with pytest.raises(ValueError, match=r"rank 2: .*compression must be None, 'fp16' or 'bf16', got 'int8'"):
        make("int8" if rank == 2 else None)
    with pytest.raises(ValueError, match=r"rank 1: compression='bf16', rank 0 has compression=None"):
        make("bf16" if rank == 1 else None)
