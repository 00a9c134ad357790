"""DistributedOptimizer(local_steps=H, outer_lr=, outer_momentum=): H local steps per combine, against the
same steps and combine written by hand (each rank's own H-step delta, ``adasum.adasum_allreduce``), the
outer optimizer's formula, no MPI call between combines, bad input, non-finite combines, mid-window
checkpoints, and DDP's ``no_sync()`` recipe."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import adasum
from adasum.runtime.context import context_for
from adasum.torch import BoundaryScheduler, DistributedOptimizer, load_checkpoint, save_checkpoint

from helpers import ONE_SIZE, TRAINING_SIZES, assert_identical_across_ranks, raw_bytes
from torch_helpers import batch, inner, loss_of, tiny_model, train

pytestmark = pytest.mark.timeout(300)












def by_hand(comm, name: str, op: str, windows: int, h: int, k: int, outer_lr=1.0, mu=0.0, **reduce):
    """The same training written out: ``h`` plain steps of the torch optimizer on this rank's averaged
    gradients, this rank's delta, the reduction with ``adasum.adasum_allreduce``, the outer formula."""
    model = tiny_model()
    opt = inner(name, model.parameters())
    params = list(model.parameters())
    v = None
    for w in range(windows):
        start = [p.detach().clone() for p in params]
        for s in range(w * h, (w + 1) * h):
            for j in range(k):
                loss_of(model, *batch(comm.Get_rank(), s, j)).backward()
            for p in params:
                p.grad.div_(k)
            opt.step()
            opt.zero_grad()
        deltas = [p.detach() - s0 for p, s0 in zip(params, start)]
        if comm.Get_size() > 1:
            deltas = adasum.adasum_allreduce(deltas, op=op, **reduce)
        with torch.no_grad():
            if outer_lr == 1.0 and mu == 0.0:
                new = [s0 + d for s0, d in zip(start, deltas)]
            else:
                g = [-d for d in deltas]
                if mu:
                    v = [mu * (torch.zeros_like(x) if v is None else v[i]) + x for i, x in enumerate(g)]
                    new = [s0 - outer_lr * (x + mu * vi) for s0, x, vi in zip(start, g, v)]
                else:
                    new = [s0 - outer_lr * x for s0, x in zip(start, g)]
            for p, n in zip(params, new):
                p.copy_(n)
    return model, v


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", ["adasum", "mean"])
@pytest.mark.parametrize("name", ["sgd", "adam"])
@TRAINING_SIZES
@pytest.mark.smoke
def test_combine_is_start_plus_reduction_of_each_ranks_own_h_step_delta(comm, op, name):
    h, k, windows = 3, 2, 2
    model = tiny_model()
    opt = DistributedOptimizer(inner(name, model.parameters()), op=op, accumulation_steps=k, local_steps=h)
    sched = BoundaryScheduler(torch.optim.lr_scheduler.StepLR(opt.optimizer, 1, gamma=1.0), opt)
    marks = []
    for s in range(windows * h):
        marks += train(model, opt, comm.Get_rank(), range(s, s + 1), k)
        assert opt.took_local_step
        sched.step()
    assert marks == [False, False, True] * windows  # is_boundary: a combine happened
    assert opt.boundaries == windows and sched.last_epoch == windows
    assert_identical_across_ranks(comm, list(model.parameters()))
    want, _ = by_hand(comm, name, op, windows, h, k)
    assert [raw_bytes(p) for p in model.parameters()] == [raw_bytes(p) for p in want.parameters()]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", ["adasum", "mean"])
@TRAINING_SIZES
def test_outer_nesterov_is_the_formula_over_three_windows(comm, op):
    h, k, windows, lr, mu = 2, 1, 3, 0.7, 0.9
    model = tiny_model()
    opt = DistributedOptimizer(inner("sgd", model.parameters()), op=op, local_steps=h, outer_lr=lr,
                               outer_momentum=mu)
    train(model, opt, comm.Get_rank(), range(windows * h), k)
    want, v = by_hand(comm, "sgd", op, windows, h, k, lr, mu)
    assert [raw_bytes(p) for p in model.parameters()] == [raw_bytes(p) for p in want.parameters()]
    buf = opt.state_dict()["adasum"]["outer_momentum_buffer"]
    assert [raw_bytes(b) for b in buf] == [raw_bytes(b) for b in v]
    assert_identical_across_ranks(comm, list(model.parameters()) + buf)


@pytest.mark.mpi(min_size=2)
@TRAINING_SIZES
def test_outer_lr_alone_scales_the_combined_delta(comm):
    model = tiny_model()
    opt = DistributedOptimizer(inner("adam", model.parameters()), local_steps=2, outer_lr=0.5)
    train(model, opt, comm.Get_rank(), range(4), 1)
    want, _ = by_hand(comm, "adam", "adasum", 2, 2, 1, 0.5, 0.0)
    assert [raw_bytes(p) for p in model.parameters()] == [raw_bytes(p) for p in want.parameters()]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", ["adasum", "mean"])
@ONE_SIZE
def test_no_mpi_call_between_combines(comm, op):
    h, k = 4, 2
    model = tiny_model()
    opt = DistributedOptimizer(inner("sgd", model.parameters()), op=op, accumulation_steps=k, local_steps=h)
    ctx = context_for(comm)
    for w in range(2):
        calls = ctx.calls
        with adasum.count_traffic(comm) as quiet:
            train(model, opt, comm.Get_rank(), range(w * h, w * h + h - 1), k)
        assert ctx.calls == calls, "an MPI call between combines"
        assert (quiet.sent_bytes, quiet.scalar_bytes, quiet.allreduce_bytes, quiet.messages) == (0, 0, 0, 0)
        with adasum.count_traffic(comm) as loud:
            assert train(model, opt, comm.Get_rank(), range(w * h + h - 1, w * h + h), k) == [True]
        assert ctx.calls > calls and loud.sent_bytes + loud.allreduce_bytes > 0


BAD = [("local_steps", 0), ("local_steps", 2.0), ("local_steps", True), ("outer_lr", 0.0), ("outer_lr", -1.0),
       ("outer_momentum", 1.0), ("outer_momentum", -0.1), ("delay", 2), ("delay", -1)]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("key,value", BAD, ids=[f"{k}={v!r}" for k, v in BAD])
@ONE_SIZE
def test_bad_input_raises_on_every_rank_naming_rank_and_value(comm, key, value):
    bad = comm.Get_size() - 1
    kwargs = {key: value} if comm.Get_rank() == bad else {}
    model = tiny_model()
    with pytest.raises(ValueError, match=rf"rank {bad}: {key} must be .*got {value!r}"):
        DistributedOptimizer(inner("sgd", model.parameters()), **kwargs)


@pytest.mark.mpi(min_size=2)
@ONE_SIZE
def test_ranks_that_disagree_and_overlap_raise_on_every_rank(comm):
    last = comm.Get_size() - 1
    model = tiny_model()
    with pytest.raises(ValueError, match=rf"ranks disagree on local_steps of DistributedOptimizer: rank {last} "
                                         r"has 3, rank 0 has 2"):
        DistributedOptimizer(inner("sgd", model.parameters()), local_steps=3 if comm.Get_rank() == last else 2)
    with pytest.raises(ValueError, match=r"ranks disagree on outer_momentum"):
        DistributedOptimizer(inner("sgd", model.parameters()), outer_momentum=0.5 if comm.Get_rank() else 0.0)
    with pytest.raises(ValueError, match=r"rank 0: overlap=True .* construct the optimizer with overlap=False"):
        DistributedOptimizer(inner("sgd", model.parameters()), local_steps=2, overlap=True)


@pytest.mark.mpi(min_size=2)
@ONE_SIZE
def test_nonfinite_combine_skipped_on_every_rank_start_restored(comm, caplog):
    """One rank's local steps overflow to Inf (its gradients stay finite): the combined delta is not finite,
    every rank keeps the window's start, and training goes on."""
    model = torch.nn.Linear(3, 2).float()
    torch.nn.init.constant_(model.weight, 1.0)
    torch.nn.init.constant_(model.bias, 0.0)
    big = comm.Get_rank() == comm.Get_size() - 1
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=3e38 if big else 0.1), local_steps=2)
    start = [p.detach().clone() for p in model.parameters()]
    x = torch.ones(4, 3)
    with caplog.at_level(logging.WARNING, logger="adasum"):
        for _ in range(2):
            model(x).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
    assert opt.is_boundary and opt.step_was_skipped and opt.skipped_updates == 1
    assert [raw_bytes(p) for p in model.parameters()] == [raw_bytes(s) for s in start]
    if comm.Get_rank() == 0:
        assert "combine 1 skipped on every rank" in caplog.text


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("how", ["state_dict", "checkpoint"])
@ONE_SIZE
def test_checkpoint_mid_window_resumes_bitwise(comm, shared_dir, how):
    h, k, rank = 3, 2, comm.Get_rank()

    def make(seed=0):
        model = tiny_model(seed)
        return model, DistributedOptimizer(inner("adam", model.parameters()), accumulation_steps=k, local_steps=h,
                                           outer_lr=0.7, outer_momentum=0.9)

    model, opt = make()
    train(model, opt, rank, range(0, 10), k)  # 3 windows and one local step
    loss_of(model, *batch(rank, 10, 0)).backward()  # and one micro-batch of the next local step
    opt.step()
    assert opt.state_dict()["adasum"]["local_steps_taken"] == 1 and opt.micro_steps == 1
    if how == "checkpoint":
        save_checkpoint(f"{shared_dir}/ck.pt", model=model, optimizer=opt)
    else:
        # state dicts hold references to live tensors (torch's optimizers' too): copies, as a file would
        saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    loss_of(model, *batch(rank, 10, 1)).backward()
    opt.step()
    opt.zero_grad()
    train(model, opt, rank, range(11, 15), k)

    again, opt2 = make(seed=1)  # other values, to be overwritten
    if how == "checkpoint":
        load_checkpoint(f"{shared_dir}/ck.pt", model=again, optimizer=opt2)
    else:
        again.load_state_dict(saved_model)
        opt2.load_state_dict(saved_opt)
    loss_of(again, *batch(rank, 10, 1)).backward()
    opt2.step()
    opt2.zero_grad()
    train(again, opt2, rank, range(11, 15), k)
    assert opt2.boundaries == opt.boundaries == 5
    assert [raw_bytes(p) for p in again.parameters()] == [raw_bytes(p) for p in model.parameters()]
    assert_identical_across_ranks(comm, list(again.parameters()))


@pytest.mark.mpi(min_size=2)
@ONE_SIZE
def test_flush_and_force_boundary_combine_a_short_window(comm):
    model = tiny_model()
    opt = DistributedOptimizer(inner("sgd", model.parameters()), local_steps=4)
    assert train(model, opt, comm.Get_rank(), range(2), 1) == [False, False]
    assert opt.flush() and opt.is_boundary and opt.boundaries == 1
    assert_identical_across_ranks(comm, list(model.parameters()))
    assert not opt.flush()
    loss_of(model, *batch(comm.Get_rank(), 5, 0)).backward()
    opt.force_boundary()
    opt.step()
    assert opt.is_boundary and opt.boundaries == 2
    assert_identical_across_ranks(comm, list(model.parameters()))


@pytest.mark.mpi(min_size=2)
@TRAINING_SIZES
def test_ddp_no_sync_recipe_is_distributed_optimizer_with_local_steps(comm, pg):
    """DDP users: every backward inside ``model.no_sync()`` (DDP reduces nothing), DistributedOptimizer with
    ``local_steps`` does the combine (docs/frameworks.md)."""
    model = tiny_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model, forward_sync_buffers=False)
    opt = DistributedOptimizer(inner("adam", ddp.parameters()), accumulation_steps=2, local_steps=3)
    ctx = context_for(comm)
    calls = ctx.calls
    for s in range(6):
        for j in range(2):
            with ddp.no_sync():
                loss_of(ddp, *batch(comm.Get_rank(), s, j)).backward()
            opt.step()
            opt.zero_grad()
        if s == 1:
            assert ctx.calls == calls  # nothing on MPI during the local steps
    want, _ = by_hand(comm, "adam", "adasum", 2, 3, 2)
    assert [raw_bytes(p) for p in model.parameters()] == [raw_bytes(p) for p in want.parameters()]


@pytest.mark.mpi(min_size=2)
@TRAINING_SIZES
def test_hierarchical_combine(comm):
    model = tiny_model()
    opt = DistributedOptimizer(inner("adam", model.parameters()), local_steps=2, hierarchical=True)
    train(model, opt, comm.Get_rank(), range(4), 1)
    want, _ = by_hand(comm, "adam", "adasum", 2, 2, 1, hierarchical=True)
    assert [raw_bytes(p) for p in model.parameters()] == [raw_bytes(p) for p in want.parameters()]


@pytest.mark.mpi(min_size=2)
@ONE_SIZE
def test_grad_scaler_backs_off_at_the_combine_on_every_rank(comm):
    """One rank's gradients overflow at its first local step: it skips that step alone; the combine goes on,
    and every rank backs the scale off once, there."""
    model = tiny_model().float()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1000)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), local_steps=2, grad_scaler=scaler)
    rank, last = comm.Get_rank(), comm.Get_size() - 1
    for s in range(2):
        x, y = batch(rank, s, 0)
        loss = loss_of(model, x.float(), y.float())
        if s == 0 and rank == last:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        opt.step()
        opt.zero_grad()
        assert scaler.get_scale() == (2.0 ** 10 if s == 0 else 2.0 ** 9)
    assert opt.is_boundary and not opt.step_was_skipped
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert_identical_across_ranks(comm, list(model.parameters()))


def by_hand_delayed(comm, op: str, windows: int, h: int, outer_lr=1.0, mu=0.0):
    """``delay=1`` written out (adasum/torch/delayed.py): each rank continues from G + its own delta while its
    window's combine travels; the combine moves G at the end of the next window; the last window drains."""
    model = tiny_model()
    opt = inner("adam", model.parameters())
    params = list(model.parameters())
    glob, pending, v = None, None, None

    def outer(g0, combined):
        nonlocal v
        if outer_lr == 1.0 and mu == 0.0:
            return [s0 + c for s0, c in zip(g0, combined)]
        g = [-c for c in combined]
        if mu:
            v = [mu * (torch.zeros_like(x) if v is None else v[i]) + x for i, x in enumerate(g)]
            return [s0 - outer_lr * (x + mu * vi) for s0, x, vi in zip(g0, g, v)]
        return [s0 - outer_lr * x for s0, x in zip(g0, g)]

    def combine(d):
        return adasum.adasum_allreduce(d, op=op) if comm.Get_size() > 1 else d

    for w in range(windows):
        start = [p.detach().clone() for p in params]
        for s in range(w * h, (w + 1) * h):
            loss_of(model, *batch(comm.Get_rank(), s, 0)).backward()
            opt.step()
            opt.zero_grad()
        d = [p.detach() - s0 for p, s0 in zip(params, start)]
        if pending is not None:
            glob = outer(glob, combine(pending))
        with torch.no_grad():
            if glob is None:
                glob = start
            else:
                for p, x, g in zip(params, d, glob):
                    p.copy_(x + g)
        pending = d
        if w == windows - 1:  # the last window is forced: drained
            glob = outer(glob, combine(pending))
            with torch.no_grad():
                for p, g in zip(params, glob):
                    p.copy_(g)
    return model


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op,outer", [("adasum", (1.0, 0.0)), ("mean", (1.0, 0.0)), ("adasum", (0.7, 0.9))])
@TRAINING_SIZES
@pytest.mark.smoke
def test_delay_merges_each_combine_one_window_late(comm, op, outer):
    h, windows = 2, 4
    model = tiny_model()
    opt = DistributedOptimizer(inner("adam", model.parameters()), op=op, local_steps=h, delay=1,
                               outer_lr=outer[0], outer_momentum=outer[1])
    marks = train(model, opt, comm.Get_rank(), range((windows - 1) * h), 1)
    assert marks == [False, True] * (windows - 1)
    loss_of(model, *batch(comm.Get_rank(), (windows - 1) * h, 0)).backward()
    opt.step()
    opt.zero_grad()
    loss_of(model, *batch(comm.Get_rank(), (windows - 1) * h + 1, 0)).backward()
    opt.force_boundary()  # the end of the data: drained, every rank identical
    opt.step()
    assert opt.is_boundary and opt.boundaries == windows
    assert_identical_across_ranks(comm, list(model.parameters()))
    want = by_hand_delayed(comm, op, windows, h, *outer)
    assert [raw_bytes(p) for p in model.parameters()] == [raw_bytes(p) for p in want.parameters()]
    assert not opt.flush()
    opt.close()


@pytest.mark.mpi(min_size=2)
@ONE_SIZE
def test_delay_flush_drains_and_state_resumes_bitwise(comm):
    rank = comm.Get_rank()

    def make(seed=0):
        model = tiny_model(seed)
        return model, DistributedOptimizer(inner("adam", model.parameters()), local_steps=2, delay=1,
                                           outer_momentum=0.5)

    model, opt = make()
    train(model, opt, rank, range(5), 1)  # two combines out (one merged), one local step into the third window
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    train(model, opt, rank, range(5, 7), 1)
    assert opt.flush() and opt.is_boundary
    assert_identical_across_ranks(comm, list(model.parameters()))
    again, opt2 = make(seed=1)
    again.load_state_dict(saved_model)
    opt2.load_state_dict(saved_opt)
    train(again, opt2, rank, range(5, 7), 1)
    assert opt2.flush()
    assert [raw_bytes(p) for p in again.parameters()] == [raw_bytes(p) for p in model.parameters()]


@pytest.mark.mpi(min_size=2)
@TRAINING_SIZES
def test_delay_flush_after_a_full_window_merges_the_combine_in_flight(comm):
    model = tiny_model()
    opt = DistributedOptimizer(inner("adam", model.parameters()), local_steps=2, delay=1)
    assert train(model, opt, comm.Get_rank(), range(6), 1) == [False, True] * 3
    assert opt.flush() and opt.is_boundary and opt.boundaries == 4  # nothing left to send: the merge alone
    assert_identical_across_ranks(comm, list(model.parameters()))
    want = by_hand_delayed(comm, "adasum", 3, 2)
    assert [raw_bytes(p) for p in model.parameters()] == [raw_bytes(p) for p in want.parameters()]
    opt.close()


OUTERS = {"nesterov": lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True),
          "adam": lambda ps: torch.optim.Adam(ps, lr=0.05)}


def by_hand_outer(comm, op: str, windows: int, h: int, make_outer):
    """DiLoCo written out: ``h`` plain SGD steps, this rank's delta, its reduction, then the outer torch
    optimizer stepped from the window's start on the pseudo-gradient -(combined delta)."""
    model = tiny_model()
    params = list(model.parameters())
    opt, outer = inner("sgd", params), make_outer(params)
    for w in range(windows):
        start = [p.detach().clone() for p in params]
        for s in range(w * h, (w + 1) * h):
            loss_of(model, *batch(comm.Get_rank(), s, 0)).backward()
            opt.step()
            opt.zero_grad()
        deltas = adasum.adasum_allreduce([p.detach() - s0 for p, s0 in zip(params, start)], op=op)
        with torch.no_grad():
            for p, s0, d in zip(params, start, deltas):
                p.copy_(s0)
                p.grad = -d
        outer.step()
        opt.zero_grad()
    return model


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", ["adasum", "mean"])
@pytest.mark.parametrize("outer", sorted(OUTERS))
@TRAINING_SIZES
def test_any_torch_optimizer_is_the_outer_optimizer(comm, op, outer):
    """``outer_optimizer=``: at each combine the user's torch optimizer steps from the window's start on the
    pseudo-gradient, bitwise DiLoCo written out; its state travels in the state dict; Nesterov SGD as the
    outer optimizer is the built-in outer SGD's formula."""
    h, windows = 2, 3
    model = tiny_model()
    outer_opt = OUTERS[outer](model.parameters())
    opt = DistributedOptimizer(inner("sgd", model.parameters()), op=op, local_steps=h, outer_optimizer=outer_opt)
    train(model, opt, comm.Get_rank(), range(windows * h), 1)
    want = by_hand_outer(comm, op, windows, h, OUTERS[outer])
    assert [raw_bytes(p) for p in model.parameters()] == [raw_bytes(p) for p in want.parameters()]
    assert_identical_across_ranks(comm, list(model.parameters()))
    saved = opt.state_dict()["adasum"]["outer_momentum_buffer"]["outer_optimizer"]
    assert len(saved["state"]) == len(list(model.parameters()))
    assert all(p.grad is None for p in model.parameters())  # the pseudo-gradients are not left behind
    if outer == "nesterov":
        builtin = tiny_model()
        ref = DistributedOptimizer(inner("sgd", builtin.parameters()), op=op, local_steps=h, outer_lr=0.7,
                                   outer_momentum=0.9)
        train(builtin, ref, comm.Get_rank(), range(windows * h), 1)
        for a, b in zip(model.parameters(), builtin.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)


@pytest.mark.mpi(min_size=2)
@TRAINING_SIZES
def test_outer_optimizer_with_delay_is_the_builtin_where_they_agree(comm):
    """``delay=1`` with ``outer_optimizer=SGD(lr=1)``: each merge steps the common point G, not the parameters,
    and leaves the parameters where the window left them: bitwise the built-in plain outer step."""
    runs = []
    for outer in (True, False):
        model = tiny_model()
        extra = {"outer_optimizer": torch.optim.SGD(model.parameters(), lr=1.0)} if outer else {}
        opt = DistributedOptimizer(inner("adam", model.parameters()), local_steps=2, delay=1, **extra)
        train(model, opt, comm.Get_rank(), range(7), 1)
        mid = [raw_bytes(p) for p in model.parameters()]  # inside a window: G + this rank's own delta
        opt.flush()
        runs.append((mid, [raw_bytes(p) for p in model.parameters()]))
    assert runs[0] == runs[1]
    assert_identical_across_ranks(comm, list(model.parameters()))


@pytest.mark.mpi(min_size=2)
@ONE_SIZE
def test_outer_optimizer_refusals_on_every_rank(comm):
    model = tiny_model()
    other = tiny_model()
    last = comm.Get_size() - 1
    cases = [dict(outer_lr=0.5), dict(outer_on=other), dict(not_an_optimizer=True)]
    for case in cases:
        outer = torch.optim.SGD((case.get("outer_on") or model).parameters(), lr=0.5)
        if case.get("not_an_optimizer"):
            outer = object()
        settings = {k: v for k, v in case.items() if k == "outer_lr"}
        mine = outer if comm.Get_rank() == last else torch.optim.SGD(model.parameters(), lr=0.5)
        with pytest.raises(ValueError, match=f"rank {last}: .*outer"):
            DistributedOptimizer(inner("sgd", model.parameters()), local_steps=2, outer_optimizer=mine,
                                 **(settings if comm.Get_rank() == last else {}))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("delay", [0, 1])
@TRAINING_SIZES
def test_one_nonfinite_delta_skips_one_combine(comm, delay):
    """One rank's delta of one window is not finite (its learning rate is NaN for one local step, its
    gradients finite): that one combine is skipped on every rank and training goes on; with ``delay=1``
    that rank does not carry the NaN into its next window (it continues from the common point)."""
    model = tiny_model()
    opt = DistributedOptimizer(inner("sgd", model.parameters()), local_steps=2, delay=delay)
    skipped = []
    for s in range(16):
        loss_of(model, *batch(comm.Get_rank(), s, 0)).backward()
        bad = s == 5 and comm.Get_rank() == comm.Get_size() - 1
        for g in opt.param_groups:
            g["lr"] = float("nan") if bad else 0.1
        opt.step()
        opt.zero_grad()
        if opt.is_boundary:
            skipped.append(opt.step_was_skipped)
    opt.flush()
    assert opt.skipped_updates == 1 and skipped.count(True) == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert_identical_across_ranks(comm, list(model.parameters()))
