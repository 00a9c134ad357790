"""Each behaviour of torch's private API that adasum relies on (:mod:`adasum.torch.internals`), pinned on
the installed torch: a release that changes one fails here, by name."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from adasum.torch import internals as ti


def tensors(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=dtype) for shape, dtype in
            (((3, 4), torch.float32), ((5,), torch.float32), ((2, 2, 2), torch.float64))]


def test_foreach_ops_are_the_elementwise_ops_in_place_bitwise():
    a, b = tensors(1), tensors(2)
    for fused, plain in ((ti.foreach_add_, torch.Tensor.add_), (ti.foreach_sub_, torch.Tensor.sub_),
                         (ti.foreach_copy_, torch.Tensor.copy_)):
        got, want = [t.clone() for t in a], [t.clone() for t in a]
        fused(got, b)
        for w, y in zip(want, b):
            plain(w, y)
        assert all(torch.equal(g, w) for g, w in zip(got, want)), fused
    got = [t.clone() for t in a]
    ti.foreach_mul_(got, 0.7)
    assert all(torch.equal(g, t * 0.7) for g, t in zip(got, a))
    assert all(torch.equal(g, t * 0.7) for g, t in zip(ti.foreach_mul(a, 0.7), a))  # out of place
    got = [t.clone() for t in a]
    ti.foreach_neg_(got)
    ti.foreach_div_(got, 3.0)
    assert all(torch.equal(g, -t / 3.0) for g, t in zip(got, a))
    norms = ti.foreach_norm(a, float("inf"))
    assert all(torch.equal(n, t.abs().max()) for n, t in zip(norms, a))


@pytest.mark.parametrize("bad", [None, float("nan"), float("inf")])
def test_non_finite_check_and_unscale_flags_and_multiplies(bad):
    a = tensors(3)
    if bad is not None:
        a[1][2] = bad
    want = [t * 0.25 for t in a]
    found, inv = torch.zeros(1), torch.full((1,), 0.25)
    ti.non_finite_check_and_unscale_([t for t in a if t.dtype == torch.float32], found, inv)
    assert float(found) == (0.0 if bad is None else 1.0)
    for t, w in zip(a[:2], want[:2]):
        assert torch.equal(t.nan_to_num(), w.nan_to_num())


def test_sparse_values_are_the_stored_values_uncoalesced():
    t = torch.sparse_coo_tensor([[0, 0, 2]], [1.0, 2.0, 3.0], (4,))  # index 0 twice
    assert torch.equal(ti.sparse_values(t), torch.tensor([1.0, 2.0, 3.0]))


def test_step_hooks_are_the_ones_step_runs_in_its_order():
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    order: list[str] = []
    handles = [register_optimizer_step_pre_hook(lambda *a: order.append("global pre")),
               opt.register_step_pre_hook(lambda *a: order.append("pre")),
               opt.register_step_post_hook(lambda *a: order.append("post")),
               register_optimizer_step_post_hook(lambda *a: order.append("global post"))]
    try:
        p.grad = torch.ones(2)
        opt.step()
        seen, order[:] = list(order), []
        for which in ("pre", "post"):
            for hook in ti.step_hooks_of(opt, which):
                hook(opt, (opt,), {})
        assert order == seen == ["global pre", "pre", "post", "global post"]
        assert all(isinstance(getattr(opt, name), dict) for name in ti.STEP_HOOK_DICTS)
    finally:
        for h in handles:
            h.remove()


def test_unhooked_step_steps_without_the_hooks():
    p, q = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    a, b = torch.optim.SGD([p], lr=0.1, momentum=0.9), torch.optim.SGD([q], lr=0.1, momentum=0.9)
    fired: list[int] = []
    b.register_step_pre_hook(lambda *args: fired.append(1))
    step = ti.unhooked_step(torch.optim.SGD)
    assert getattr(torch.optim.SGD.step, "hooked", False) and step is not torch.optim.SGD.step
    for _ in range(3):
        p.grad, q.grad = torch.full((2,), 0.5), torch.full((2,), 0.5)
        a.step()
        step(b)
    assert torch.equal(p, q) and fired == []


def test_a_recorded_step_satisfies_an_lr_scheduler():
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    assert getattr(opt.step, "_wrapped_by_lr_sched", False)
    ti.record_scheduled_step(opt)  # the step taken without calling opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Detected call of `lr_scheduler.step()` before `optimizer.step()`"
        scheduler.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
