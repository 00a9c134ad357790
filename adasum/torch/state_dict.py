"""The state of :class:`~adasum.torch.DistributedOptimizer` for checkpoints: the wrapped optimizer's state
dict plus the window, its counters and, while a window is open, the accumulated gradients and the open
window of local steps (:mod:`.checkpoint` saves and resumes it), on the optimizer's parts."""

from __future__ import annotations

from typing import Any

from .arguments import check_accumulated
from .local import load_problem
from .stepping import Parts, Steps
from .strategy import trained_params

__all__ = ["state_dict", "load_state_dict"]


def state_dict(parts: Parts, steps: Steps) -> dict[str, Any]:
    """The wrapped optimizer's state dict plus ``"adasum"`` (see ``DistributedOptimizer.state_dict``)."""
    state = dict(parts.optimizer.state_dict())
    own: dict[str, Any] = {**parts.window.state_dict(), "boundaries": parts.ledger.combines,
                           "skipped_updates": steps.skipped_updates, "scaler_good_steps": parts.loss.good_steps}
    if parts.local is not None:
        own.update(parts.local.state_dict())
    if parts.window.seen:
        own["accumulated_grads"] = [None if p.grad is None else p.grad.detach()
                                    for p in trained_params(parts.optimizer)]
    state["adasum"] = own
    return state


def load_state_dict(parts: Parts, steps: Steps, state_dict: dict[str, Any]) -> None:
    """Load a state of :func:`state_dict` (or a plain state of the wrapped optimizer). Everything is checked
    before anything changes."""
    state = dict(state_dict)
    own = state.pop("adasum", None) or {}
    grads = own.get("accumulated_grads")
    params = trained_params(parts.optimizer)
    check_accumulated(grads, params)
    problem = load_problem(own, None if parts.local is None else parts.local.settings)
    if problem is not None:
        raise ValueError(f"rank {parts.comm.Get_rank()}: {problem}")
    parts.optimizer.load_state_dict(state)
    parts.window.load_state_dict(own)
    parts.ledger.combines = int(own.get("boundaries", 0))
    steps.skipped_updates = int(own.get("skipped_updates", 0))
    parts.loss.good_steps = int(own.get("scaler_good_steps", 0))
    steps.is_boundary = steps.step_was_skipped = False
    parts.boundary.reset()
    if parts.local is not None:
        parts.local.load_state_dict(own)
    if grads is not None:
        for p, g in zip(params, grads):
            p.grad = None if g is None else g.detach().to(device=p.device, dtype=p.dtype, copy=True)
