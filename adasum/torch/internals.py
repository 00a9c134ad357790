"""The parts of torch's own API that adasum relies on and torch does not promise (names with a leading
underscore), gathered in one place. ``tests/training/test_torch_internals.py`` pins each behaviour used here
on the pinned torch, so that a torch release that changes one fails there, by name, first.

- The fused list operations (``torch._foreach_*``): one kernel launch per device for a list of tensors.
- GradScaler's fused non-finite check (``torch._amp_foreach_non_finite_check_and_unscale_``).
- A sparse COO tensor's stored values (``Tensor._values()``), without coalescing.
- An optimizer's step hooks (``Optimizer._optimizer_step_pre_hooks`` / ``_post_hooks`` and the global ones in
  ``torch.optim.optimizer``), and the wrapper torch puts around ``step`` (``profile_hook_step``: the
  function carries ``hooked`` and ``__wrapped__``): adasum runs the hooks once per update and the unwrapped
  step per bucket.
- What an LR scheduler's ``step`` wrapper reads (``_wrapped_by_lr_sched`` and ``_opt_called``, or before
  torch 2.2 ``_with_counter`` and ``_step_count``): a step adasum takes without calling ``optimizer.step()``
  is recorded as the wrapper would record it.
- The modules one FSDP2 state covers (``FSDPModule._get_fsdp_state()._modules``): ``fully_shard([a, b])``
  makes one parameter group, one reduce-scatter buffer and one all-reduce hook for both.
"""

from __future__ import annotations

from itertools import chain
from typing import Callable

import torch
from torch.optim import optimizer as _torch_optimizer

__all__ = ["foreach_add_", "foreach_sub_", "foreach_copy_", "foreach_mul_", "foreach_mul", "foreach_neg_",
           "foreach_div_", "foreach_norm", "non_finite_check_and_unscale_", "sparse_values", "STEP_HOOK_DICTS",
           "step_hooks_of", "unhooked_step", "record_scheduled_step", "fsdp_group"]

foreach_add_ = torch._foreach_add_
foreach_sub_ = torch._foreach_sub_
foreach_copy_ = torch._foreach_copy_
foreach_mul_ = torch._foreach_mul_
foreach_mul = torch._foreach_mul
foreach_neg_ = torch._foreach_neg_
foreach_div_ = torch._foreach_div_
foreach_norm = torch._foreach_norm
non_finite_check_and_unscale_ = torch._amp_foreach_non_finite_check_and_unscale_

# The instance attributes that hold an optimizer's own step hooks.
STEP_HOOK_DICTS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")


def sparse_values(t: torch.Tensor) -> torch.Tensor:
    """The stored values of a sparse COO tensor (duplicates included, not coalesced)."""
    return t._values()


def step_hooks_of(optimizer, which: str) -> list[Callable]:
    """The hooks ``optimizer.step()`` runs, in its order: ``"pre"``, the global pre-hooks then the
    optimizer's own; ``"post"``, the optimizer's own post-hooks then the global ones."""
    if which == "pre":
        hooks = chain(getattr(_torch_optimizer, "_global_optimizer_pre_hooks", {}).values(),
                      getattr(optimizer, STEP_HOOK_DICTS[0], {}).values())
    else:
        hooks = chain(getattr(optimizer, STEP_HOOK_DICTS[1], {}).values(),
                      getattr(_torch_optimizer, "_global_optimizer_post_hooks", {}).values())
    return list(hooks)


def unhooked_step(cls) -> Callable | None:
    """The step function of an optimizer class, without the hook runner torch wraps it in; None where the
    class has none."""
    fn = getattr(cls, "step", None)
    if fn is not None and getattr(fn, "hooked", False):
        fn = getattr(fn, "__wrapped__", fn)
    return fn


def record_scheduled_step(optimizer) -> None:
    """Where an LR scheduler replaced ``optimizer.step`` to watch it, record a step as that replacement does
    (so the scheduler does not warn that it stepped before the optimizer)."""
    patched = getattr(optimizer, "step", None)
    if getattr(patched, "_wrapped_by_lr_sched", False):
        optimizer._opt_called = True
    if getattr(patched, "_with_counter", False):  # torch before 2.2
        optimizer._step_count = getattr(optimizer, "_step_count", 0) + 1


def fsdp_group(module) -> tuple:
    """The modules sharded together with the FSDP2 module ``module`` (itself included): more than one where
    ``fully_shard`` was given a list."""
    return tuple(module._get_fsdp_state()._modules)
