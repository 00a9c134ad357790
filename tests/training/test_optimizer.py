"""DistributedOptimizer under MPI, at any world size: against the serial reference, across ranks, through
accumulation windows, non-finite updates, loss scaling, clipping, broadcasts and checkpoints.

Every rank builds every rank's data from shared seeds, so each rank can compute the expected result alone.
"""

from __future__ import annotations

import contextlib
import logging
import os

import numpy as np
import pytest
import torch
from mpi4py import MPI

import adasum
from adasum.rule.reference import reference_allreduce, reference_hierarchical
from adasum.torch import (BoundaryScheduler, DistributedOptimizer, broadcast_optimizer_state,
                          broadcast_parameters, load_checkpoint, save_checkpoint)

from helpers import ONE_SIZE, REFERENCE_SIZES, TRAINING_SIZES, assert_identical_across_ranks, raw_bytes, rel_l2, world_nodes
from torch_helpers import batch, loss_of, tiny_model, train
from torch_helpers import inner as make_inner  # tests name their parameter inner

OPS = ["adasum", "sum", "mean"]








def params_f64(model) -> list[np.ndarray]:
    return [p.detach().to(torch.float64).numpy().copy() for p in model.parameters()]


def set_params(model, values) -> None:
    with torch.no_grad():
        for p, v in zip(model.parameters(), values):
            p.copy_(torch.as_tensor(v))






# --- the results -------------------------------------------------------------------------------------------


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("inner", ["sgd", "adam"])
@REFERENCE_SIZES
@pytest.mark.smoke
def test_adasum_is_local_step_then_reference_of_deltas(comm, inner):
    """Each window: every rank's own local step (its own optimizer state), then start + Adasum of deltas."""
    size, rank, k, steps = comm.Get_size(), comm.Get_rank(), 2, 3
    model = tiny_model()
    opt = DistributedOptimizer(make_inner(inner, model.parameters()), op="adasum", accumulation_steps=k)
    train(model, opt, rank, steps, k)

    # The serial simulation: one model and one optimizer per rank, parameters shared after every window.
    sims = [tiny_model() for _ in range(size)]
    sim_opts = [make_inner(inner, m.parameters()) for m in sims]
    current = params_f64(tiny_model())
    for s in range(steps):
        deltas = []
        for r, (m, o) in enumerate(zip(sims, sim_opts)):
            set_params(m, current)
            for j in range(k):
                loss_of(m, *batch(r, s, j)).backward()
            for p in m.parameters():
                p.grad /= k
            o.step()
            o.zero_grad()
            deltas.append([a - b for a, b in zip(params_f64(m), current)])
        current = [c + d for c, d in zip(current, reference_allreduce(deltas, "adasum"))]
    got = params_f64(model)
    for i, (g, want) in enumerate(zip(got, current)):
        assert rel_l2(g, want) < 1e-12, f"parameter {i}"
    assert_identical_across_ranks(comm, list(model.parameters()))




@pytest.mark.mpi(min_size=1)
@REFERENCE_SIZES
def test_hierarchical_adasum_is_local_step_then_reference(comm):
    """Node means of the deltas, then Adasum over nodes (under a plain launch: one node, so the mean)."""
    size, rank = comm.Get_size(), comm.Get_rank()
    model = tiny_model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), hierarchical=True)
    loss_of(model, *batch(rank, 0, 0)).backward()
    opt.step()
    start = params_f64(tiny_model())
    deltas = []
    for r in range(size):
        m = tiny_model()
        loss_of(m, *batch(r, 0, 0)).backward()
        deltas.append([-0.1 * p.grad.numpy() for p in m.parameters()])
    want = [s + d for s, d in zip(start, reference_hierarchical(deltas, world_nodes(comm)))]
    for i, (got, w) in enumerate(zip(params_f64(model), want)):
        assert rel_l2(got, w) < 1e-12, f"parameter {i}"
    with pytest.raises(ValueError, match="hierarchical=True needs op 'adasum', got op 'mean'"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op="mean", hierarchical=True)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("op", ["mean", "sum"])
@REFERENCE_SIZES
def test_sum_mean_equal_one_step_over_the_whole_batch(comm, op):
    """k micro-batches on P ranks = one SGD step on one process over all P·k micro-batches."""
    size, rank, k, steps = comm.Get_size(), comm.Get_rank(), 3, 2
    model = tiny_model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5), op=op,
                               accumulation_steps=k)
    train(model, opt, rank, steps, k)

    ref = tiny_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.5)
    for s in range(steps):
        per_rank = [sum(loss_of(ref, *batch(r, s, j)) for j in range(k)) / k for r in range(size)]
        loss = sum(per_rank) / (size if op == "mean" else 1)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for i, (g, want) in enumerate(zip(params_f64(model), params_f64(ref))):
        assert rel_l2(g, want) < 1e-9, f"parameter {i}"


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("inner", ["sgd", "adam", "adamw"])
@ONE_SIZE
def test_one_rank_is_the_wrapped_optimizer_bitwise(comm, op, inner):
    """On a communicator of one rank the wrapper is the wrapped optimizer, bit for bit."""
    rank = comm.Get_rank()
    a, b = tiny_model(3, torch.float32), tiny_model(3, torch.float32)
    bare = make_inner(inner, a.parameters())
    opt = DistributedOptimizer(make_inner(inner, b.parameters()), op=op, comm=MPI.COMM_SELF)
    for s in range(5):
        for m, o in ((a, bare), (b, opt)):
            loss_of(m, *batch(rank, s, 0, dtype=torch.float32)).backward()
            o.step()
            o.zero_grad()
    assert [raw_bytes(p) for p in a.parameters()] == [raw_bytes(p) for p in b.parameters()]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("op", OPS)
@REFERENCE_SIZES
def test_parameters_identical_across_ranks_after_many_steps(comm, op):
    rank = comm.Get_rank()
    model = tiny_model(0, torch.float32)
    opt = DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), op=op, accumulation_steps=2)
    train(model, opt, rank, 15, 2, dtype=torch.float32)
    assert opt.boundaries == 15 and opt.skipped_updates == 0
    assert_identical_across_ranks(comm, list(model.parameters()))
    if op != "adasum":  # the reduced gradients are the same everywhere, hence so is the optimizer state
        assert_identical_across_ranks(comm, [v.reshape(-1) for st in opt.state.values() for v in st.values()
                                             if isinstance(v, torch.Tensor)])


@pytest.mark.mpi(min_size=1)
@TRAINING_SIZES
def test_start_copy_on_host_gives_the_same_result(comm):
    rank = comm.Get_rank()
    results = []
    for where in ("device", "host"):
        model = tiny_model(0, torch.float32)
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), start_copy=where)
        train(model, opt, rank, 4, 1, dtype=torch.float32)
        results.append([raw_bytes(p) for p in model.parameters()])
    assert results[0] == results[1]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("op", OPS)
@TRAINING_SIZES
def test_parameters_without_gradients_take_part_consistently(comm, op):
    """A branch only even ranks use, and a parameter no rank uses (AdamW would decay it given a zero
    gradient): no hang, the expected update, and the unused parameter untouched everywhere."""
    size, rank = comm.Get_size(), comm.Get_rank()

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(5)
                self.body = torch.nn.Linear(5, 3).double()
                self.branch = torch.nn.Linear(5, 3).double()
                self.never = torch.nn.Parameter(torch.ones(4, dtype=torch.float64))

        def forward(self, x, use_branch):
            return self.body(x) + (self.branch(x) if use_branch else 0)

    def local_grads(net, r):
        net.zero_grad()
        x, y = batch(r, 0, 0)
        torch.nn.functional.mse_loss(net(x, r % 2 == 0), y).backward()
        return [None if p.grad is None else p.grad.clone() for p in net.parameters()]

    net = Net()
    before = params_f64(net)
    opt = DistributedOptimizer(torch.optim.AdamW(net.parameters(), lr=0.1, weight_decay=0.5), op=op)
    local_grads(net, rank)
    opt.step()
    assert net.never.grad is None
    assert raw_bytes(net.never) == raw_bytes(torch.ones(4, dtype=torch.float64))
    assert_identical_across_ranks(comm, list(net.parameters()))

    if op == "adasum":
        # Each rank's AdamW step on its own gradients, then the reference Adasum of the deltas.
        deltas = []
        for r in range(size):
            sim = Net()
            local_grads(sim, r)
            o = torch.optim.AdamW(sim.parameters(), lr=0.1, weight_decay=0.5)
            o.step()
            deltas.append([a - b for a, b in zip(params_f64(sim), before)])
        want = [b + d for b, d in zip(before, reference_allreduce(deltas, "adasum"))]
    else:
        # One AdamW step on the reduced gradients; a branch gradient exists where some rank had one.
        per_rank = [local_grads(Net(), r) for r in range(size)]
        sim = Net()
        for i, p in enumerate(sim.parameters()):
            present = [g[i] for g in per_rank if g[i] is not None]
            if present:
                p.grad = sum(present) / (size if op == "mean" else 1)
        torch.optim.AdamW(sim.parameters(), lr=0.1, weight_decay=0.5).step()
        want = params_f64(sim)
    for i, (g, w) in enumerate(zip(params_f64(net), want)):
        assert rel_l2(g, w) < 1e-12, f"parameter {i}"


# --- accumulation ------------------------------------------------------------------------------------------


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("op", OPS)
@ONE_SIZE
def test_no_mpi_call_off_the_boundary(comm, op, overlap):
    """Rank 0 takes the first k-1 micro-steps alone, on a communicator of its own job: any collective there
    would never complete (the test would time out). The traffic counters of that communicator and, with
    overlap, of the overlap thread's must stay at zero (any library call counts its agreement); then every
    rank joins and the window closes normally. With overlap the window follows an overlapped one (the
    first window is observed, the second reduced during backward), and is overlapped itself."""
    size, rank, k = comm.Get_size(), comm.Get_rank(), 4
    dup = comm.Dup()
    model = tiny_model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=op, accumulation_steps=k,
                               comm=dup, overlap=overlap, bucket_bytes=1)
    overlapped = overlap and size > 1

    def counted():
        stack = contextlib.ExitStack()
        counters = [stack.enter_context(adasum.count_traffic(c)) for c in (dup, opt.overlap_comm) if c is not None]
        return stack, counters

    def micro_steps(n):
        for j in range(n):
            loss_of(model, *batch(rank, 0, j)).backward()
            assert opt.finalize_gradients() is False
            assert opt.clip_grad_norm_(1.0) is None
            opt.step()
            opt.zero_grad()
            assert not opt.is_boundary
            assert opt.state_dict()["adasum"]["micro_steps"] == j + 1

    if overlap:
        train(model, opt, rank, 2, k)
        assert opt.boundaries == 2 and opt.overlapped_boundaries == (1 if overlapped else 0)
    stack, counters = counted()
    with stack:
        if rank == 0:
            micro_steps(k - 1)
        comm.Barrier()
        if rank != 0:
            micro_steps(k - 1)
    assert all(t == adasum.Traffic() for t in counters)
    assert all(p.grad is not None for p in model.parameters())  # zero_grad kept the accumulating gradients

    stack, counters = counted()
    with stack:
        loss_of(model, *batch(rank, 0, k - 1)).backward()
        opt.step()
    assert opt.is_boundary
    assert any(t != adasum.Traffic() for t in counters) == (size > 1)  # the boundary reduces
    assert opt.overlapped_boundaries == (2 if overlapped else 0)
    assert_identical_across_ranks(comm, list(model.parameters()))
    opt.close()
    dup.Free()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("how", ["force_boundary", "flush"])
@TRAINING_SIZES
def test_short_last_window_is_averaged_by_its_count(comm, op, how):
    """Micro-batch gradients 1, 2, 3 (times rank + 1) in a window of 4 closed early average to 2, not 6/4.

    Every rank's delta is parallel to the others', so Adasum gives their mean, like op mean."""
    size, rank, k = comm.Get_size(), comm.Get_rank(), 4
    w = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    opt = DistributedOptimizer(torch.optim.SGD([w], lr=1.0), op=op, accumulation_steps=k)
    for j in range(3):
        (w * (j + 1) * (rank + 1)).sum().backward()
        if how == "force_boundary" and j == 2:
            opt.force_boundary()
        opt.step()
        opt.zero_grad()
        assert opt.is_boundary == (how == "force_boundary" and j == 2)
    if how == "flush":
        assert opt.flush() and opt.is_boundary
        opt.zero_grad()
    assert opt.flush() is False  # nothing left to close
    per_rank = [2.0 * (r + 1) for r in range(size)]
    want = -(sum(per_rank) if op == "sum" else sum(per_rank) / size)
    assert torch.allclose(w.detach(), torch.full((3,), want, dtype=torch.float64), rtol=1e-14, atol=0)
    assert opt.boundaries == 1 and w.grad is None

    # The next window is a full one again: gradients 1, 1, 1, 1 average to 1.
    for j in range(k):
        (w * (rank + 1)).sum().backward()
        opt.step()
        opt.zero_grad()
    per_rank = [float(r + 1) for r in range(size)]
    want -= sum(per_rank) if op == "sum" else sum(per_rank) / size
    assert torch.allclose(w.detach(), torch.full((3,), want, dtype=torch.float64), rtol=1e-14, atol=0)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("pattern", ["helper", "flag"])
@ONE_SIZE
def test_scheduler_steps_once_per_boundary(comm, pattern):
    """Windows of 3 over 8 micro-batches, the last window forced short: 3 boundaries, 3 scheduler steps,
    and each window's update uses the learning rate of its own boundary."""
    k = 3
    w = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
    opt = DistributedOptimizer(torch.optim.SGD([w], lr=1.0), op="mean", accumulation_steps=k)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda b: 0.5 ** b)
    helper = BoundaryScheduler(sched, opt)
    trace = []
    for j in range(8):
        w.sum().backward()  # gradient 1 on every micro-batch: each window moves w by -lr
        if j == 7:
            opt.force_boundary()
        opt.step()
        if pattern == "helper":
            assert helper.step() == opt.is_boundary
        elif opt.is_boundary:
            sched.step()
        opt.zero_grad()
        trace.append(w.item())
    assert opt.boundaries == 3
    assert sched.last_epoch == 3
    assert helper.get_last_lr() == [0.125]
    assert trace == [0, 0, -1, -1, -1, -1.5, -1.5, -1.75]
    assert trace == comm.allgather(trace)[0]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("overlap", [False, True])
@ONE_SIZE
def test_nonfinite_on_one_rank_is_skipped_everywhere(comm, op, bad, overlap, caplog):
    size, rank = comm.Get_size(), comm.Get_rank()
    model = tiny_model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), op=op,
                               overlap=overlap, bucket_bytes=64)
    snapshots = []
    inject = {"step": None}

    def poison(grad):  # during backward, so that overlapped buckets see it too
        if inject["step"] == 1 and rank == size - 1:
            grad = grad.clone()
            grad[0, 0] = bad
        return grad

    next(model.parameters()).register_hook(poison)
    with caplog.at_level(logging.WARNING, logger="adasum"):
        for s in range(3):
            inject["step"] = s
            loss_of(model, *batch(rank, s, 0)).backward()
            opt.step()
            opt.zero_grad()
            assert opt.step_was_skipped == (s == 1)
            snapshots.append([raw_bytes(p) for p in model.parameters()])
    assert opt.skipped_updates == 1 and opt.boundaries == 3
    assert snapshots[1] == snapshots[0]  # the skipped update left the parameters as they were
    assert snapshots[2] != snapshots[1]  # and training went on
    assert all(torch.isfinite(p).all() for p in model.parameters())
    # The rank with the bad gradient kept a finite momentum: it did not take its local step.
    assert all(torch.isfinite(st["momentum_buffer"]).all() for st in opt.state.values())
    assert_identical_across_ranks(comm, list(model.parameters()))
    skips = [r for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skips) == (1 if rank == 0 else 0)


@pytest.mark.mpi(min_size=2)
@ONE_SIZE
def test_ranks_that_disagree_on_settings_raise_everywhere(comm):
    model = tiny_model()
    k = 3 if comm.Get_rank() == 1 else 2
    with pytest.raises(ValueError, match=r"accumulation_steps.*rank 1 has 3, rank 0 has 2"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=k)


# --- mixed precision and clipping --------------------------------------------------------------------------


def _amp_run(comm, op, scaler, inject_at=None, windows=4, device="cpu", start_copy="device", amp=True,
             overlap=False):
    """``windows`` windows of 2 micro-batches with Adam on ``device``, under autocast (bfloat16 on the CPU,
    float16 on CUDA) where ``amp``; an Inf in rank P-1's gradients in window ``inject_at``. Returns the
    model, the optimizer and the scale after each window."""
    rank, size, k = comm.Get_rank(), comm.Get_size(), 2
    model = tiny_model(1, torch.float32).to(device)
    opt = DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), op=op, accumulation_steps=k,
                               grad_scaler=scaler, start_copy=start_copy, overlap=overlap, bucket_bytes=64)
    half = torch.bfloat16 if device == "cpu" else torch.float16
    scales = []
    now = {}

    def poison(grad):  # during backward, where an overlapped bucket reads it
        if now.get("at") == (inject_at, 1) and rank == size - 1:
            grad = grad.clone()
            grad[0, 0] = float("inf")
        return grad

    next(model.parameters()).register_hook(poison)
    for s in range(windows):
        for j in range(k):
            now["at"] = (s, j)
            x, y = batch(rank, s, j, dtype=torch.float32)
            with torch.autocast(device, dtype=half, enabled=amp):
                loss = loss_of(model, x.to(device), y.to(device)).float()
            (scaler.scale(loss) if scaler is not None else loss).backward()
            opt.step()
            opt.zero_grad()
        if scaler is not None:
            scales.append(scaler.get_scale())
    return model, opt, scales


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("overlap", [False, True])
@TRAINING_SIZES
def test_grad_scaler_with_autocast(comm, op, overlap):
    """Power-of-two scales unscale exactly, so the scaled run equals the unscaled one bitwise, while the
    scale grows every 2 good windows and backs off, on every rank alike, after an Inf on one rank."""
    plain, _, _ = _amp_run(comm, op, None)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
    scaled, opt, scales = _amp_run(comm, op, scaler, overlap=overlap)
    if op == "adasum" or not overlap:
        assert [raw_bytes(p) for p in plain.parameters()] == [raw_bytes(p) for p in scaled.parameters()]
    assert scales == [2.0 ** 10, 2.0 ** 11, 2.0 ** 11, 2.0 ** 12]
    if overlap and comm.Get_size() > 1:
        assert opt.overlapped_boundaries == 3

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
    _, opt, scales = _amp_run(comm, op, scaler, inject_at=1, overlap=overlap)
    assert opt.skipped_updates == 1
    assert scales == [2.0 ** 10, 2.0 ** 9, 2.0 ** 9, 2.0 ** 10]
    assert comm.allgather(scales) == [scales] * comm.Get_size()


@pytest.mark.mpi(min_size=1)
@ONE_SIZE
def test_grad_scaler_step_on_the_wrapper_is_refused(comm):
    model = tiny_model(1, torch.float32)
    scaler = torch.amp.GradScaler("cpu")
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    scaler.scale(loss_of(model, *batch(0, 0, 0, dtype=torch.float32))).backward()
    with pytest.raises(RuntimeError, match="grad_scaler="):
        scaler.step(opt)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("op", OPS)
@TRAINING_SIZES
def test_clipping_at_the_boundary(comm, op):
    """``clip_grad_norm_`` at the boundary clips the averaged gradient: the reduced one for sum/mean, each
    rank's own before its local step for adasum."""
    size, rank, k, max_norm = comm.Get_size(), comm.Get_rank(), 2, 0.05
    model = tiny_model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), op=op, accumulation_steps=k)
    norms = []
    for j in range(k):
        loss_of(model, *batch(rank, 0, j)).backward()
        norms.append(opt.clip_grad_norm_(max_norm))
        opt.step()
        opt.zero_grad()
    assert norms[0] is None and norms[1] is not None

    start = params_f64(tiny_model())

    def avg_grad(r):
        m = tiny_model()
        for j in range(k):
            loss_of(m, *batch(r, 0, j)).backward()
        return [p.grad.numpy() / k for p in m.parameters()]

    def clipped(g):
        total = np.sqrt(sum(float((x ** 2).sum()) for x in g))
        return [x * min(1.0, max_norm / (total + 1e-6)) for x in g]

    grads = [avg_grad(r) for r in range(size)]
    if op == "adasum":
        deltas = [[-0.5 * x for x in clipped(g)] for g in grads]
        want = [s + d for s, d in zip(start, reference_allreduce(deltas, "adasum"))]
    else:
        g = clipped(reference_allreduce(grads, op))
        want = [s - 0.5 * x for s, x in zip(start, g)]
    for i, (got, w) in enumerate(zip(params_f64(model), want)):
        assert rel_l2(got, w) < 1e-10, f"parameter {i}"


@pytest.mark.mpi(min_size=1)
@TRAINING_SIZES
def test_clip_grad_norm_before_step_without_accumulation(comm):
    """The plain ``torch.nn.utils.clip_grad_norm_`` before ``step()`` clips each rank's own gradient."""
    size, rank, max_norm = comm.Get_size(), comm.Get_rank(), 0.05
    model = tiny_model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), op="mean")
    loss_of(model, *batch(rank, 0, 0)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    opt.step()
    grads = []
    for r in range(size):
        m = tiny_model()
        loss_of(m, *batch(r, 0, 0)).backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm)
        grads.append([p.grad.numpy() for p in m.parameters()])
    want = [s - 0.5 * g for s, g in zip(params_f64(tiny_model()), reference_allreduce(grads, "mean"))]
    for i, (got, w) in enumerate(zip(params_f64(model), want)):
        assert rel_l2(got, w) < 1e-12, f"parameter {i}"


# --- broadcast and checkpoints -----------------------------------------------------------------------------


@pytest.mark.mpi(min_size=1)
@ONE_SIZE
def test_broadcast_parameters_and_optimizer_state(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    root = size - 1

    def net(seed):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.BatchNorm1d(5),
                                       torch.nn.Linear(5, 2).to(torch.bfloat16))

    model = net(rank)  # different on every rank, buffers and an int64 counter included
    model[1].running_mean.fill_(rank)
    model[1].num_batches_tracked.fill_(rank)
    broadcast_parameters(model, root=root)
    want = net(root)
    want[1].running_mean.fill_(root)
    want[1].num_batches_tracked.fill_(root)
    assert ([raw_bytes(t.reshape(-1)) for t in model.state_dict().values()]
            == [raw_bytes(t.reshape(-1)) for t in want.state_dict().values()])

    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (rank + 1))
    if rank == root:
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
    broadcast_optimizer_state(DistributedOptimizer(opt), root=root)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01 * (root + 1))
    states = [v.reshape(-1) for st in opt.state.values() for v in st.values()]
    assert len(states) == 3 * len(list(model.parameters()))
    assert_identical_across_ranks(comm, states)


@pytest.mark.mpi(min_size=2)
@ONE_SIZE
def test_broadcast_of_mismatched_tensors_raises_everywhere(comm):
    shape = (3, 4) if comm.Get_rank() == 1 else (3, 3)
    with pytest.raises(ValueError, match=r"rank 1: tensor 0 is 'w' of shape \(3, 4\)"):
        broadcast_parameters({"w": torch.zeros(shape)})


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("op,inner", [("adasum", "adam"), ("mean", "sgd"), ("sum", "adamw")])
@pytest.mark.parametrize("overlap", [False, True])
@ONE_SIZE
def test_resume_mid_window_is_bitwise_the_uninterrupted_run(comm, shared_dir, op, inner, overlap):
    rank, k, total, stop = comm.Get_rank(), 3, 11, 5  # stops with 2 of 3 micro-batches in the window

    def setup(seed):
        model = tiny_model(seed, torch.float32)
        opt = DistributedOptimizer(make_inner(inner, model.parameters()), op=op, accumulation_steps=k,
                                   overlap=overlap, bucket_bytes=64)
        sched = BoundaryScheduler(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7), opt)
        return model, opt, sched

    def run(model, opt, sched, lo, hi):
        for i in range(lo, hi):
            loss_of(model, *batch(rank, 0, i, dtype=torch.float32)).backward()
            if i == total - 1:
                opt.force_boundary()
            opt.step()
            sched.step()
            opt.zero_grad()

    straight = setup(0)
    run(*straight, 0, total)

    first = setup(0)
    run(*first, 0, stop)
    path = os.path.join(shared_dir, "ckpt.pt")
    save_checkpoint(path, model=first[0], optimizer=first[1], extra={"micro": stop,
                                                                     "scheduler": first[2].state_dict()})
    assert sorted(os.listdir(shared_dir)) == ["ckpt.pt"]  # no temporary file left behind

    resumed = setup(7)  # another initialisation: everything must come from the file
    extra = load_checkpoint(path, model=resumed[0], optimizer=resumed[1])
    resumed[2].load_state_dict(extra["scheduler"])
    assert extra["micro"] == stop and resumed[1].micro_steps == stop % k
    run(*resumed, extra["micro"], total)

    assert [raw_bytes(p) for p in resumed[0].parameters()] == [raw_bytes(p) for p in straight[0].parameters()]
    assert resumed[1].boundaries == straight[1].boundaries == 4
    assert_identical_across_ranks(comm, list(resumed[0].parameters()))


@pytest.mark.mpi(min_size=1)
@ONE_SIZE
def test_load_checkpoint_errors_reach_every_rank(comm, shared_dir):
    model = tiny_model()
    with pytest.raises(ValueError, match="rank 0: cannot load checkpoint"):
        load_checkpoint(os.path.join(shared_dir, "missing.pt"), model=model)
