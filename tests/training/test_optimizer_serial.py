"""DistributedOptimizer on one process: the accumulation rule, arguments, pass-through to the wrapped
optimizer, state dicts and the scheduler helper. (The multi-rank behaviour is in test_optimizer.py.)"""

from __future__ import annotations

import copy

import pytest
import torch
from mpi4py import MPI

from adasum.torch import AccumulationWindow, BoundaryScheduler, DistributedOptimizer

from helpers import raw_bytes


def model_and_opt(k: int = 1, **kwargs):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2).double()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, inner, DistributedOptimizer(inner, accumulation_steps=k, comm=MPI.COMM_SELF, **kwargs)


def backward(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(3, 4, generator=g, dtype=torch.float64)).pow(2).mean().backward()


def test_window_closes_at_k_or_when_forced():
    w = AccumulationWindow(3)
    assert [w.record() for _ in range(3)] == [False, False, True]
    assert w.close() == 3 and w.seen == 0
    assert w.record() is False
    w.force()
    assert w.closes_next and w.record() is True
    assert w.close() == 2 and not w.forced
    one = AccumulationWindow(1)
    assert one.closes_next and one.record()


@pytest.mark.parametrize("bad", [0, -2, 2.5, True, "3"])
def test_accumulation_steps_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match=f"accumulation_steps must be a positive integer, got {bad!r}"):
        model_and_opt(k=bad)


def test_bad_arguments_are_named():
    model, inner, opt = model_and_opt()
    with pytest.raises(ValueError, match="op must be one of 'adasum', 'sum', 'mean', got 'max'"):
        DistributedOptimizer(inner, op="max", comm=MPI.COMM_SELF)
    with pytest.raises(ValueError, match="start_copy must be 'device' or 'host', got 'disk'"):
        DistributedOptimizer(inner, start_copy="disk", comm=MPI.COMM_SELF)
    with pytest.raises(TypeError, match="comm must be an mpi4py intracommunicator, got int"):
        DistributedOptimizer(inner, comm=3)
    with pytest.raises(TypeError, match="already a DistributedOptimizer"):
        DistributedOptimizer(opt, comm=MPI.COMM_SELF)
    with pytest.raises(TypeError, match="torch optimizer with param_groups and step"):
        DistributedOptimizer(model, comm=MPI.COMM_SELF)
    with pytest.raises(TypeError, match="grad_scaler must be a torch.amp.GradScaler, got float"):
        DistributedOptimizer(inner, grad_scaler=1.0, comm=MPI.COMM_SELF)
    with pytest.raises(TypeError, match="must be an adasum.torch.DistributedOptimizer"):
        BoundaryScheduler(torch.optim.lr_scheduler.StepLR(inner, 1), inner)


def test_groups_state_and_defaults_are_the_wrapped_optimizers():
    model, inner, opt = model_and_opt()
    assert opt.param_groups is inner.param_groups
    assert opt.defaults is inner.defaults
    backward(model, 0)
    opt.step()
    assert opt.state is inner.state and len(inner.state) == 2
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    backward(model, 1)
    opt.step()
    sched.step()
    assert inner.param_groups[0]["lr"] == pytest.approx(0.05)
    extra = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    opt.add_param_group({"params": [extra], "lr": 1.0})
    assert inner.param_groups[-1]["params"] == [extra]
    extra.grad = torch.ones(3, dtype=torch.float64)
    opt.step()
    assert torch.equal(extra.detach(), torch.full((3,), -1.0, dtype=torch.float64))
    inner.custom_setting = "kept"
    assert opt.custom_setting == "kept"  # other attributes reach the wrapped optimizer
    with pytest.raises(TypeError, match="save its state_dict"):
        copy.deepcopy(opt)


def test_zero_grad_waits_for_the_boundary():
    model, _, opt = model_and_opt(k=2)
    backward(model, 0)
    first = model.weight.grad.clone()
    opt.step()
    opt.zero_grad()
    assert torch.equal(model.weight.grad, first)  # window open: kept
    backward(model, 1)
    opt.step()
    assert opt.is_boundary
    opt.zero_grad(set_to_none=False)
    assert torch.count_nonzero(model.weight.grad) == 0
    opt.zero_grad()
    assert model.weight.grad is None


def test_state_dict_adds_only_its_own_key_and_round_trips_mid_window():
    model, inner, opt = model_and_opt(k=3)
    for s in range(4):  # one window closed, one micro-batch into the next
        backward(model, s)
        opt.step()
        opt.zero_grad()
    state = opt.state_dict()
    assert set(state) == set(inner.state_dict()) | {"adasum"}
    own = state["adasum"]
    assert own["micro_steps"] == 1 and own["boundaries"] == 1 and own["skipped_updates"] == 0
    assert [raw_bytes(g) for g in own["accumulated_grads"]] == [raw_bytes(p.grad) for p in model.parameters()]

    twin, _, twin_opt = model_and_opt(k=3)
    twin.load_state_dict(model.state_dict())
    twin_opt.load_state_dict(copy.deepcopy(state))  # torch's load_state_dict keeps the tensors it is given
    assert twin_opt.micro_steps == 1 and twin_opt.boundaries == 1
    for m, o in ((model, opt), (twin, twin_opt)):
        for s in (4, 5):
            backward(m, s)
            o.step()
            o.zero_grad()
        assert o.is_boundary
    assert [raw_bytes(p) for p in model.parameters()] == [raw_bytes(p) for p in twin.parameters()]


def test_load_state_dict_takes_a_plain_optimizer_state():
    model, inner, opt = model_and_opt(k=2)
    backward(model, 0)
    inner.step()
    plain = inner.state_dict()
    _, fresh_inner, fresh = model_and_opt(k=2)
    fresh.load_state_dict(plain)
    assert fresh.micro_steps == 0 and fresh.boundaries == 0 and fresh.skipped_updates == 0
    assert torch.equal(fresh_inner.state_dict()["state"][0]["momentum_buffer"],
                       plain["state"][0]["momentum_buffer"])


def test_load_state_dict_checks_the_accumulated_gradients():
    model, _, opt = model_and_opt(k=2)
    backward(model, 0)
    opt.step()
    state = opt.state_dict()
    state["adasum"]["accumulated_grads"] = state["adasum"]["accumulated_grads"][:1]
    with pytest.raises(ValueError, match="accumulated gradients for 1 parameters, the optimizer has 2"):
        model_and_opt(k=2)[2].load_state_dict(state)


def test_closure_is_evaluated_at_every_step_first():
    """torch's contract: the closure re-evaluates the model (forward and backward of the micro-batch) and
    its loss is returned, at every step(closure), inside a window as at its boundary; the update uses the
    gradients it computed, as a plain loop's backward before step() does."""
    model, _, opt = model_and_opt(k=2)
    ref_model, _, ref_opt = model_and_opt(k=2)
    calls = []

    def closure(i):
        def run():
            calls.append(i)
            backward(model, i)
            return torch.tensor(1.5 + i)
        return run

    for i in range(4):
        assert float(opt.step(closure(i))) == 1.5 + i and calls[-1] == i
        assert opt.is_boundary == (i % 2 == 1)
        opt.zero_grad()
        backward(ref_model, i)
        ref_opt.step()
        ref_opt.zero_grad()
    assert calls == [0, 1, 2, 3]
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters()))


def test_skip_nonfinite_off_lets_nan_through():
    model, _, opt = model_and_opt(skip_nonfinite=False)
    backward(model, 0)
    model.weight.grad[0, 0] = float("nan")
    opt.step()
    assert opt.skipped_updates == 0 and torch.isnan(model.weight).any()


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled-check", "torch-check"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_nonfinite_element_anywhere_skips_the_update(monkeypatch, dtype, bad, compiled):
    """The skip finds one NaN or Inf wherever it lies: the last element of the last gradient, one of a
    transposed (non-contiguous) gradient, in each dtype; the largest finite value and the smallest subnormal
    are finite. ``compiled``: host tensors read by the compiled kernels, or by torch's fused check."""
    import adasum.torch.window.tensors as tensors

    if not compiled:
        monkeypatch.setattr(tensors, "_COMPILED", None)
    elif tensors._COMPILED is None:
        pytest.skip("the compiled kernels were not built")
    a = torch.nn.Parameter(torch.zeros(300, 7, dtype=dtype))
    b = torch.nn.Parameter(torch.zeros(5000, dtype=dtype))
    inner = torch.optim.SGD([a, b], lr=1.0)
    opt = DistributedOptimizer(inner, op="mean", comm=MPI.COMM_SELF)
    info = torch.finfo(dtype)
    for where in ("last", "transposed", None):
        a.grad = torch.ones(7, 300, dtype=dtype).t()  # not contiguous
        b.grad = torch.ones(5000, dtype=dtype)
        b.grad[0], b.grad[1] = info.max, info.smallest_normal / 4
        if where == "last":
            b.grad[-1] = bad
        elif where == "transposed":
            a.grad[299, 6] = bad
        before = [a.detach().clone(), b.detach().clone()]
        opt.step()
        assert opt.step_was_skipped == (where is not None), where
        changed = not (torch.equal(a, before[0]) and torch.equal(b, before[1]))
        assert changed == (where is None), where
    assert opt.skipped_updates == 2


def test_any_object_with_param_groups_and_step():
    """Not a torch.optim.Optimizer: no state_dict hooks, no zero_grad of its own."""
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))

    class Plain:
        def __init__(self):
            self.param_groups = [{"params": [p], "lr": 0.5}]

        def step(self):
            with torch.no_grad():
                p.sub_(self.param_groups[0]["lr"] * p.grad)

    opt = DistributedOptimizer(Plain(), accumulation_steps=2, comm=MPI.COMM_SELF)
    for g in (1.0, 3.0):
        p.grad = (p.grad if p.grad is not None else 0) + torch.full((2,), g, dtype=torch.float64)
        opt.step()
        opt.zero_grad()
    assert torch.equal(p.detach(), torch.full((2,), -1.0, dtype=torch.float64)) and p.grad is None
