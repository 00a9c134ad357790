"""The window's rules on every path of DistributedOptimizer: parameters tracked by identity (freeze, unfreeze
and add a group at every position of a window, ``delay`` 0 and 1) against the same training written by hand,
ranks whose parameters differ, a skipped ``step()`` found at the latest by ``flush()``, a mid-window state
loaded into other settings, ``close()`` combining what is open and refusing every later call."""

from __future__ import annotations

import pytest
import torch

import adasum
from adasum.torch import DistributedOptimizer

from helpers import ONE_SIZE, TRAINING_SIZES, assert_identical_across_ranks, raw_bytes

pytestmark = pytest.mark.timeout(300)

H = 3  # local steps per window


def model3() -> torch.nn.Module:
    """Three layers of one shape: matching parameters by position instead of identity goes unnoticed."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4), torch.nn.Tanh(),
                                   torch.nn.Linear(4, 4)).double()


def micro(model, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(100 * rank + step + 1)
    x, y = torch.randn(5, 4, generator=g, dtype=torch.float64), torch.randn(5, 4, generator=g, dtype=torch.float64)
    torch.nn.functional.mse_loss(model(x), y).backward()


def change(model, event: str, opt) -> None:
    """``freeze``: the last layer stops training; ``unfreeze``: it starts; ``add``: its group is added."""
    last = model[4]
    if event == "freeze":
        last.requires_grad_(False)
    elif event == "unfreeze":
        last.requires_grad_(True)
    else:
        opt.add_param_group({"params": list(last.parameters())})


def initial(model, event: str) -> list[torch.Tensor]:
    """The parameters the optimizer starts with, the last layer set up for ``event``."""
    if event == "unfreeze":
        model[4].requires_grad_(False)
    if event == "add":
        return [p for layer in (model[0], model[2]) for p in layer.parameters()]
    return list(model.parameters())


def train(comm, event: str, when: int, steps: int, delay: int) -> torch.nn.Module:
    model = model3()
    opt = DistributedOptimizer(torch.optim.SGD(initial(model, event), lr=0.2), local_steps=H, delay=delay)
    for s in range(steps):
        if s == when:
            change(model, event, opt)
        micro(model, comm.Get_rank(), s)
        opt.step()
        opt.zero_grad()
    opt.flush()
    return model


def by_hand(comm, event: str, when: int, steps: int) -> torch.nn.Module:
    """The defined result, written out (delay=0): each parameter's delta since the window's start, or since
    the local step it joined the window at, combined with ``adasum.adasum_allreduce``; a parameter frozen
    inside a window keeps its place in it."""
    model = model3()
    sgd = torch.optim.SGD(initial(model, event), lr=0.2)
    members: list[torch.Tensor] = []
    start: dict[int, torch.Tensor] = {}
    taken = 0

    def combine() -> None:
        deltas = [p.detach() - start[id(p)] for p in members]
        combined = adasum.adasum_allreduce(deltas, comm=comm)
        with torch.no_grad():
            for p, d in zip(members, combined):
                p.copy_(start[id(p)] + d)
        members.clear()

    for s in range(steps):
        if s == when:
            change(model, event, sgd)
        for p in (p for g in sgd.param_groups for p in g["params"] if p.requires_grad):
            if all(p is not m for m in members):
                members.append(p)
                start[id(p)] = p.detach().clone()
        micro(model, comm.Get_rank(), s)
        sgd.step()
        sgd.zero_grad()
        taken += 1
        if taken == H:
            combine()
            taken = 0
    if taken:
        combine()
    return model


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("delay", [0, 1])
@pytest.mark.parametrize("event", ["freeze", "unfreeze", "add"])
@TRAINING_SIZES
def test_parameters_change_at_every_position_of_a_window(comm, event, delay):
    """At every position of two windows (before their first, second and third local step), for
    ``delay`` 0 and 1: every rank ends with the same parameters, and for ``delay=0`` with the defined
    result, bitwise."""
    for when in range(2 * H):
        got = train(comm, event, when, 3 * H + 1, delay)
        assert_identical_across_ranks(comm, list(got.parameters()))
        assert all(torch.isfinite(p).all() for p in got.parameters())
        if delay == 0:
            want = by_hand(comm, event, when, 3 * H + 1)
            assert [raw_bytes(p) for p in got.parameters()] == [raw_bytes(p) for p in want.parameters()], \
                f"{event} before local step {when}"


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("delay", [0, 1])
@TRAINING_SIZES
def test_delay_one_freeze_then_unfreeze_lands_on_the_common_point(comm, delay):
    """With ``delay=1`` a parameter frozen at a combine boundary lands on the common point once its last
    combine is merged, and joins again from there when unfrozen."""
    model = model3()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2), local_steps=H, delay=delay)
    for s in range(5 * H):
        if s == H:
            model[4].requires_grad_(False)
        if s == 3 * H:
            model[4].requires_grad_(True)
        micro(model, comm.Get_rank(), s)
        opt.step()
        opt.zero_grad()
        if s == 3 * H - 1:  # two windows after the freeze: the frozen layer has landed on G everywhere
            assert_identical_across_ranks(comm, list(model[4].parameters()))
    opt.flush()
    assert_identical_across_ranks(comm, list(model.parameters()))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("delay", [0, 1])
@ONE_SIZE
def test_ranks_that_train_fewer_parameters_raise_on_every_rank(comm, delay):
    """Rank 0 freezes the first layer at a boundary, the others nothing: the next combine raises on every
    rank before any byte of the combine is sent, naming the counts, every rank back at the window's start."""
    model = model3()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2), local_steps=H, delay=delay)
    before = [p.detach().clone() for p in model.parameters()]
    if comm.Get_rank() == 0:
        model[0].requires_grad_(False)
    with pytest.raises(RuntimeError, match=r"the ranks' windows hold other parameters: rank [1-9]\d*'s 6, rank "
                                           r"0's 4; the window's parameter 0 is the optimizer's parameter 0 "):
        for s in range(H):
            micro(model, comm.Get_rank(), s)
            opt.step()
            opt.zero_grad()
    assert [raw_bytes(p) for p in model.parameters()] == [raw_bytes(p) for p in before]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("delay", [0, 1])
@ONE_SIZE
def test_ranks_that_train_other_parameters_raise_on_every_rank(comm, delay):
    """Rank 0 freezes the first layer, the others the last (all of one shape): the next combine raises on
    every rank, naming the optimizer's parameters, and every rank is back at the window's start."""
    model = model3()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2), local_steps=H, delay=delay)
    for s in range(H):
        micro(model, comm.Get_rank(), s)
        opt.step()
        opt.zero_grad()
    opt.flush()
    before = [p.detach().clone() for p in model.parameters()]
    (model[0] if comm.Get_rank() == 0 else model[4]).requires_grad_(False)
    with pytest.raises(RuntimeError, match=r"the window's parameter 0 is the optimizer's parameter 0 \(shape "
                                           r"\(4, 4\), float64\) on rank 1 and the optimizer's parameter 2 "):
        for s in range(H):
            micro(model, comm.Get_rank(), H + s)
            opt.step()
            opt.zero_grad()
    assert [raw_bytes(p) for p in model.parameters()] == [raw_bytes(p) for p in before]


def skipping_loop(comm, opt, model, steps: int, skip: int) -> None:
    for s in range(steps):
        if comm.Get_rank() == 0 and s == skip:
            continue  # rank 0 skips this micro-batch: no backward, no step()
        micro(model, comm.Get_rank(), s)
        opt.step()
        opt.zero_grad()
    opt.flush()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("settings", [{"local_steps": H}, {"local_steps": H, "delay": 1},
                                      {"accumulation_steps": 2}, {"accumulation_steps": 2, "overlap": True}],
                         ids=["local-steps", "delay", "accumulation", "overlap"])
@ONE_SIZE
def test_a_skipped_step_raises_on_every_rank_at_the_latest_at_flush(comm, settings):
    model = model3()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2), **settings)
    with pytest.raises(RuntimeError, match=r"the ranks' windows differ \(a rank skipped or added a step\(\).*"
                                           r"rank 0 has \{'combine': \d+, 'micro-batches': \d+"):
        skipping_loop(comm, opt, model, 4 * H, 2)


@pytest.mark.mpi(min_size=2)
@ONE_SIZE
def test_flush_with_nothing_open_passes_where_the_ranks_agree(comm):
    model = model3()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2), accumulation_steps=2)
    for s in range(4):
        micro(model, comm.Get_rank(), s)
        opt.step()
        opt.zero_grad()
    assert opt.flush() is False and opt.boundaries == 2
    assert_identical_across_ranks(comm, list(model.parameters()))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("saved, loaded", [({"local_steps": 3}, {}), ({"local_steps": 3, "delay": 1}, {}),
                                           ({"local_steps": 3, "delay": 1}, {"local_steps": 3}),
                                           ({"local_steps": 3}, {"local_steps": 2})])
@ONE_SIZE
def test_a_mid_window_state_loads_only_into_the_same_settings(comm, saved, loaded):
    model = model3()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2), **saved)
    for s in range(H + 1):  # delay=1: one combine in flight, one local step taken
        micro(model, comm.Get_rank(), s)
        opt.step()
        opt.zero_grad()
    state = opt.state_dict()
    other = model3()
    target = DistributedOptimizer(torch.optim.SGD(other.parameters(), lr=0.2), **loaded)
    before = [raw_bytes(p) for p in other.parameters()]
    with pytest.raises(ValueError, match=rf"rank {comm.Get_rank()}: the state was taken inside a window of local "
                                         r"steps .* Load it into an optimizer with the same local-steps settings"):
        target.load_state_dict(state)
    assert [raw_bytes(p) for p in other.parameters()] == before and target.boundaries == 0
    opt.flush()
    target.load_state_dict(opt.state_dict())  # every window combined: loads anywhere
    assert_identical_across_ranks(comm, list(model.parameters()))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("settings", [{"local_steps": H}, {"local_steps": H, "delay": 1}, {"overlap": True}, {}],
                         ids=["local-steps", "delay", "overlap", "plain"])
@ONE_SIZE
def test_close_combines_what_is_open_and_every_later_call_raises(comm, settings):
    model = model3()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2), **settings)
    for s in range(H + 1):
        micro(model, comm.Get_rank(), s)
        opt.step()
        opt.zero_grad()
    opt.close()
    assert opt.closed
    assert_identical_across_ranks(comm, list(model.parameters()))
    micro(model, comm.Get_rank(), 99)
    for call in (opt.step, opt.flush, opt.zero_grad, opt.force_boundary, opt.finalize_gradients):
        with pytest.raises(RuntimeError, match=rf"rank {comm.Get_rank()}: .* after close\(\)"):
            call()
    opt.close()  # again: nothing
    assert "adasum" in opt.state_dict()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("settings", [{"local_steps": 2}, {"local_steps": 3, "delay": 1}, {"outer_lr": 0.7}],
                         ids=["local-steps", "delay", "outer"])
@ONE_SIZE
def test_a_frozen_parameter_with_a_zero_gradient_is_not_stepped(comm, settings):
    """Frozen after a flush, its gradient kept as zeros (``zero_grad(set_to_none=False)``): Adam would move it
    through its moments; it stays where it was, on every rank."""
    model = model3()
    opt = DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), **settings)
    for s in range(12):
        if s == 6:
            opt.flush()
            model[0].requires_grad_(False)
            frozen = [p.detach().clone() for p in model[0].parameters()]
        micro(model, comm.Get_rank(), s)
        opt.step()
        opt.zero_grad(set_to_none=False)
    opt.flush()
    assert [raw_bytes(p) for p in model[0].parameters()] == [raw_bytes(p) for p in frozen]
    assert_identical_across_ranks(comm, list(model.parameters()))


def bn_model() -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3)).double()


def bn_step(model, opt, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(100 * rank + step)
    model(torch.randn(6, 4, generator=g, dtype=torch.float64)).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("settings", [{}, {"local_steps": 2}], ids=["boundary", "local-steps"])
@TRAINING_SIZES
def test_flush_keeps_the_module_buffers_alike(comm, settings):
    """Forward passes after the last window (a micro-batch under no_sync(), as Lightning's accumulation runs
    one) change each rank's BatchNorm statistics: flush() makes them alike again."""
    model = bn_model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), module=model, **settings)
    bn_step(model, opt, comm.Get_rank(), 0)
    with opt.no_sync():
        model(torch.randn(6, 4, dtype=torch.float64) + comm.Get_rank()).sum().backward()
    opt.flush()
    assert_identical_across_ranks(comm, list(model.parameters()) + list(model.buffers()))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("settings", [{"accumulation_steps": 2}, {"local_steps": 2}, {"local_steps": 2, "delay": 1}],
                         ids=["accumulation", "local-steps", "delay"])
@ONE_SIZE
def test_a_mid_window_checkpoint_with_batchnorm_resumes_bitwise(comm, shared_dir, settings):
    """Each rank's own BatchNorm statistics and the values the next average is taken against travel with
    the optimizer's state: the resumed run is bitwise the run without a stop."""
    import os

    from adasum.torch import load_checkpoint, save_checkpoint

    def build():
        model = bn_model()
        return model, DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                           module=model, **settings)

    model, opt = build()
    for s in range(7):
        bn_step(model, opt, comm.Get_rank(), s)
    opt.flush()
    want = [raw_bytes(t) for t in model.state_dict().values()]
    opt.close()
    model, opt = build()
    for s in range(3):  # stop inside a window
        bn_step(model, opt, comm.Get_rank(), s)
    path = os.path.join(shared_dir, "bn.pt")
    save_checkpoint(path, model=model, optimizer=opt)
    opt.close(combine=False)
    model, opt = build()
    load_checkpoint(path, model=model, optimizer=opt)
    for s in range(3, 7):
        bn_step(model, opt, comm.Get_rank(), s)
    opt.flush()
    assert [raw_bytes(t) for t in model.state_dict().values()] == want


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", ["mean", "sum"])
@pytest.mark.parametrize("compression", [None, "bf16"])
@ONE_SIZE
def test_a_sum_or_mean_step_makes_one_agreement_besides_its_data(comm, op, compression):
    """The window's agreement rides on the reduction's own: a step that closes a window makes one agreement
    and the data's collective on the optimizer's communicator (the bf16 sum travels as point-to-point
    messages: the agreement alone), an accumulating step none."""
    model = model3()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2), op=op, compression=compression,
                               accumulation_steps=2, comm=comm)
    counts = []
    for s in range(4):
        micro(model, comm.Get_rank(), s)
        with adasum.count_traffic(comm) as t:
            opt.step()
        opt.zero_grad()
        counts.append(t.collectives)
    closing = 2 if compression is None else 1
    assert counts == [0, closing, 0, closing]
    assert_identical_across_ranks(comm, list(model.parameters()))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", ["mean", "sum"])
@ONE_SIZE
def test_a_skipped_sum_or_mean_step_raises_on_every_rank_naming_the_counts(comm, op):
    """Rank 0 skips one micro-batch: the next boundary's reduction carries the window's ledger and every
    rank raises naming the ranks' counts, its parameters at the window's start."""
    model = model3()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2), op=op, accumulation_steps=2,
                               comm=comm)
    with pytest.raises(RuntimeError, match=r"the ranks' windows differ \(a rank skipped or added a step\(\).*"
                                           r"rank 0 has \{'combine': \d+, 'micro-batches': \d+"):
        skipping_loop(comm, opt, model, 8, 2)
    assert_identical_across_ranks(comm, list(model.parameters()))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", ["adasum", "mean", "sum"])
@pytest.mark.parametrize("local_steps", [1, 2])
@ONE_SIZE
def test_a_combining_step_costs_the_librarys_own_call(comm, op, local_steps):
    """A step that combines makes the collectives of the library's own call on the same tensors and
    nothing more: the window's agreement rides on the call's (one small agreement besides the data)."""
    from torch_helpers import batch, inner, loss_of, tiny_model

    model = tiny_model()
    opt = DistributedOptimizer(inner("sgd", model.parameters()), comm=comm, op=op, local_steps=local_steps)
    rank = comm.Get_rank()
    for s in range(3 * local_steps):
        loss_of(model, *batch(rank, s, 0)).backward()
        if s == 3 * local_steps - 1:
            with adasum.count_traffic(comm) as step:
                opt.step()
            assert opt.is_boundary
        else:
            opt.step()
        opt.zero_grad()
    tensors = [p.detach().clone() for p in model.parameters()]
    with adasum.count_traffic(comm) as call:
        adasum.adasum_allreduce_inplace(tensors, op=op, comm=comm)
    assert (step.collectives, step.scalar_bytes) == (call.collectives, call.scalar_bytes)
    # sum/mean (without local steps) carry one more element per parameter: which ranks had its gradient
    have = len(tensors) * tensors[0].element_size() if op != "adasum" and local_steps == 1 else 0
    assert step.allreduce_bytes + step.sent_bytes == call.allreduce_bytes + call.sent_bytes + have


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", ["mean", "sum"])
@ONE_SIZE
def test_a_step_that_fails_after_the_reduction_is_named_on_every_rank_until_a_state_is_loaded(comm, op):
    """sum/mean: the wrapped step runs after the reduction, so a step that raises on one rank raises there
    alone while the others apply the update. Every later step raises on every rank naming that rank and why
    the models differ (not a mismatch of counts), until every rank loads a state; then training goes on."""
    from torch_helpers import batch, loss_of, tiny_model

    class Flaky(torch.optim.SGD):
        fail = False

        def step(self, closure=None):
            if self.fail:
                raise FloatingPointError("injected")
            return super().step(closure)

    rank, last = comm.Get_rank(), comm.Get_size() - 1
    model = tiny_model()
    inner_opt = Flaky(model.parameters(), lr=0.1)
    opt = DistributedOptimizer(inner_opt, comm=comm, op=op)
    loss_of(model, *batch(rank, 0, 0)).backward()
    opt.step()
    opt.zero_grad()
    saved, weights = opt.state_dict(), {k: v.clone() for k, v in model.state_dict().items()}
    loss_of(model, *batch(rank, 1, 0)).backward()
    inner_opt.fail = rank == last
    if rank == last:
        with pytest.raises(FloatingPointError):
            opt.step()
    else:
        opt.step()
    inner_opt.fail = False
    opt.zero_grad()
    for s in (2, 3):
        loss_of(model, *batch(rank, s, 0)).backward()
        with pytest.raises(RuntimeError, match=f"rank {last}: its update 2 failed after the reduction "
                                               r"\(FloatingPointError: injected\).*load a state"):
            opt.step()
        opt.zero_grad()
    model.load_state_dict(weights)
    opt.load_state_dict(saved)
    for s in (4, 5):
        loss_of(model, *batch(rank, s, 0)).backward()
        opt.step()
        opt.zero_grad()
    assert opt.boundaries == 3
    assert_identical_across_ranks(comm, list(model.parameters()))
