"""FSDP2's delta form across replicas (``adasum.torch.fsdp.ReplicaDeltas``) at 4 ranks, meshes 2×2 and 4×1:
local optimizer steps on the shards (momentum kept per replica), the deltas combined per whole parameter,
against a serial reference; with local steps; plain SGD against the gradient hook; step counts that differ."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.mpi, pytest.mark.world_size(4), pytest.mark.fsdp]

pytest.importorskip("torch.distributed.fsdp")

from adasum.rule.reference import tree_combine  # noqa: E402
from adasum.torch.fsdp import ReplicaDeltas, adasum_replicas  # noqa: E402

from helpers import assert_identical_across_ranks  # noqa: E402
from fsdp_helpers import LR, MESHES, STEPS, assert_close, batch, fresh, full, make_mesh, shard, train  # noqa: E402


def delta_reference(shape, op: str, momentum: float) -> list[np.ndarray]:
    """The serial reference of the delta form: each replica's optimizer (its own momentum) steps its copy
    from the common parameters on its ranks' mean gradient; the replicas' deltas are combined per whole
    parameter (float32 at each level) and every copy continues from start + combined delta."""
    replicas, shards = shape
    copies = [fresh() for _ in range(replicas)]
    opts = [torch.optim.SGD(c.parameters(), lr=LR, momentum=momentum) for c in copies]
    for step in range(STEPS):
        start = [p.detach().clone() for p in copies[0].parameters()]
        deltas = []
        for g, (model, opt) in enumerate(zip(copies, opts)):
            grads = []
            for rank in range(g * shards, (g + 1) * shards):
                model.zero_grad()
                x, y = batch(step, rank)
                torch.nn.functional.mse_loss(model(x), y).backward()
                grads.append([p.grad.to(torch.float64) for p in model.parameters()])
            with torch.no_grad():
                for p, layer in zip(model.parameters(), zip(*grads)):
                    p.grad = (sum(layer) / shards).to(p.dtype)
            opt.step()
            deltas.append([(p.detach() - s).to(torch.float64).numpy() for p, s in zip(model.parameters(), start)])
        with torch.no_grad():
            for i, s in enumerate(start):
                layer = [d[i] for d in deltas]
                combined = tree_combine(layer, dtype="float32") if op == "adasum" else np.mean(layer, axis=0)
                new = s + torch.from_numpy(combined.reshape(s.shape)).to(s.dtype)
                for model in copies:
                    list(model.parameters())[i].copy_(new)
    return [p.detach().to(torch.float64).numpy() for p in copies[0].parameters()]


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("op", ["adasum", "mean"])
def test_deltas_against_serial_reference(pg, comm, shape, op):
    mesh = make_mesh(shape)
    model = shard(fresh(), mesh["shard"])
    opt = ReplicaDeltas(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), model, mesh, op=op)
    train(model, opt, comm.Get_rank())
    opt.close()
    got = full(model)
    assert_close(got, delta_reference(shape, op, 0.9), 1e-5)
    assert_identical_across_ranks(comm, got)
    with pytest.raises(RuntimeError, match="after close"):
        opt.step()


@pytest.mark.world_size(2)
@pytest.mark.smoke
def test_deltas_of_two_replicas_of_one_shard_against_serial_reference(pg, comm):
    """The same on a mesh 2×1 at 2 ranks (each replica one unsharded rank): the smoke test of ReplicaDeltas."""
    test_deltas_against_serial_reference(pg, comm, (2, 1), "adasum")


def test_deltas_of_plain_sgd_are_the_gradient_hook(pg, comm):
    """Adasum(c·a, c·b) = c·Adasum(a, b): with SGD without momentum the delta form gives the gradient
    form's model."""
    mesh = make_mesh((2, 2))
    deltas = shard(fresh(), mesh["shard"])
    opt = ReplicaDeltas(torch.optim.SGD(deltas.parameters(), lr=LR), deltas, mesh)
    train(deltas, opt, comm.Get_rank())
    grads = shard(fresh(), mesh["shard"])
    hooks = adasum_replicas(grads, mesh)
    train(grads, torch.optim.SGD(grads.parameters(), lr=LR), comm.Get_rank())
    hooks.close()
    opt.close()
    assert_close(full(deltas), full(grads), 1e-6)


def local_reference(h: int, steps: int) -> list[np.ndarray]:
    """2×2, SGD with momentum, ``h`` local steps per combine: each replica steps its copy ``h`` times on its
    ranks' mean gradients, then the window's deltas are combined (a last short window too)."""
    copies = [fresh() for _ in range(2)]
    opts = [torch.optim.SGD(c.parameters(), lr=LR, momentum=0.9) for c in copies]
    for lo in range(0, steps, h):
        start = [p.detach().clone() for p in copies[0].parameters()]
        for step in range(lo, min(lo + h, steps)):
            for g, (model, opt) in enumerate(zip(copies, opts)):
                grads = []
                for rank in (2 * g, 2 * g + 1):
                    model.zero_grad()
                    x, y = batch(step, rank)
                    torch.nn.functional.mse_loss(model(x), y).backward()
                    grads.append([p.grad.to(torch.float64) for p in model.parameters()])
                with torch.no_grad():
                    for p, layer in zip(model.parameters(), zip(*grads)):
                        p.grad = (sum(layer) / 2).to(p.dtype)
                opt.step()
        with torch.no_grad():
            for i, s in enumerate(start):
                layer = [(list(c.parameters())[i].detach() - s).to(torch.float64).numpy() for c in copies]
                new = s + torch.from_numpy(tree_combine(layer, dtype="float32").reshape(s.shape)).to(s.dtype)
                for c in copies:
                    list(c.parameters())[i].copy_(new)
    return [p.detach().to(torch.float64).numpy() for p in copies[0].parameters()]


def test_deltas_with_local_steps(pg, comm):
    """``local_steps=3`` over 8 steps: two windows of 3, and a last one of 2 that flush() combines."""
    mesh = make_mesh((2, 2))
    model = shard(fresh(), mesh["shard"])
    opt = ReplicaDeltas(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), model, mesh, local_steps=3)
    train(model, opt, comm.Get_rank())
    assert opt.windows == 2
    opt.flush()
    assert opt.windows == 3
    got = full(model)
    opt.close()
    assert_close(got, local_reference(3, STEPS), 1e-5)
    assert_identical_across_ranks(comm, got)


def test_deltas_step_counts_that_differ_raise_everywhere(pg, comm):
    mesh = make_mesh((2, 2))
    model = shard(fresh(), mesh["shard"])
    opt = ReplicaDeltas(torch.optim.SGD(model.parameters(), lr=LR), model, mesh, local_steps=4)
    train(model, opt, comm.Get_rank(), steps=2)
    if comm.Get_rank() == 2:
        opt.step()  # one step more on one rank (no backward: FSDP's own collectives stay matched)
    with pytest.raises(RuntimeError, match=r"the ranks' windows differ .*rank 2 has \{'combine': 1, 'local steps': 3\}, "
                                           r"rank 0 has \{'combine': 1, 'local steps': 2\}"):
        opt.flush()
    opt.close()


def test_deltas_local_steps_that_differ_are_refused_at_construction(pg, comm):
    """A rank with another ``local_steps`` would leave the window's combine while its replica partners
    wait in FSDP's collectives: every rank raises at construction, naming the counts."""
    mesh = make_mesh((2, 2))
    model = shard(fresh(), mesh["shard"])
    steps = 3 if comm.Get_rank() == 1 else 2
    with pytest.raises(ValueError, match=r"rank 1: local_steps=3, rank 0 has local_steps=2"):
        ReplicaDeltas(torch.optim.SGD(model.parameters(), lr=LR), model, mesh, local_steps=steps)


def test_deltas_replicas_that_start_apart_are_refused(pg, comm):
    """Replicas that start from different parameters (each rank restored its own mid-window weights) would
    stay apart window after window: the first step raises on every rank instead, changing nothing."""
    mesh = make_mesh((2, 2))
    model = shard(fresh(), mesh["shard"])
    if comm.Get_rank() >= 2:  # replica 1 holds other weights
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().add_(0.01)
    opt = ReplicaDeltas(torch.optim.SGD(model.parameters(), lr=LR), model, mesh)
    before = [p.to_local().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"the replicas start from different parameters \(replicas \[1\]"):
        opt.step()
    assert all(torch.equal(p.to_local(), b) for p, b in zip(model.parameters(), before))
    opt.close()


def test_deltas_and_the_hook_are_one_or_the_other(pg, comm):
    mesh = make_mesh((2, 2))
    model = shard(fresh(), mesh["shard"])
    hooks = adasum_replicas(model, mesh)
    with pytest.raises(ValueError, match="already runs the hook of adasum_replicas: the delta form takes"):
        ReplicaDeltas(torch.optim.SGD(model.parameters(), lr=LR), model, mesh)
    hooks.close()
    ReplicaDeltas(torch.optim.SGD(model.parameters(), lr=LR), model, mesh).close()
