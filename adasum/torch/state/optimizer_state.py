"""The state of :class:`~adasum.torch.DistributedOptimizer` for checkpoints: the wrapped optimizer's state
dict plus the window, its counters and, while a window is open, the accumulated gradients and the open
window of local steps (:mod:`.checkpoint` saves and resumes it), on the optimizer's parts."""

from __future__ import annotations

from typing import Any

from ..checks import check_accumulated
from ..window.tensors import trained_params
from ..window.training_loop import Parts, Steps

__all__ = ["state_dict", "load_state_dict"]


def state_dict(parts: Parts, steps: Steps) -> dict[str, Any]:
    """The wrapped optimizer's state dict plus ``"adasum"`` (see ``DistributedOptimizer.state_dict``)."""
    state = dict(parts.optimizer.state_dict())
    own: dict[str, Any] = {**parts.window.state_dict(), "boundaries": parts.closing.combines,
                           "skipped_updates": steps.skipped_updates, "scaler_good_steps": parts.loss.good_steps}
    if parts.local is not None:
        own.update(parts.local.state_dict())
    if parts.buffers is not None:
        local = parts.local
        window_open = bool(parts.window.seen or (local is not None and (local.taken or local.pending)))
        own["module_buffers"] = parts.buffers.state_dict(window_open)
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
    if parts.buffers is not None and own.get("module_buffers"):
        parts.buffers.check_state(own["module_buffers"])
    parts.optimizer.load_state_dict(state)
    parts.window.load_state_dict(own)
    parts.closing.combines = int(own.get("boundaries", 0))
    parts.closing.skipped = int(own.get("skipped_updates", 0))
    parts.loss.good_steps = int(own.get("scaler_good_steps", 0))
    steps.is_boundary = parts.closing.step_was_skipped = False
    parts.closing.diverged = None  # a loaded state: the ranks' models are alike again
    parts.boundary.reset()
    if parts.local is not None:
        parts.local.load_state_dict(own)
    if parts.buffers is not None and own.get("module_buffers"):
        parts.buffers.load_state_dict(own["module_buffers"])
    if grads is not None:
        for p, g in zip(params, grads):
            p.grad = None if g is None else g.detach().to(device=p.device, dtype=p.dtype, copy=True)


def load_problem(own: dict[str, Any], settings: dict[str, Any] | None) -> str | None:
    """Why a state's ``"adasum"`` entries ``own`` do not load into an optimizer with these local-steps
    ``settings`` (None: no local steps), or None: a state taken inside a window of local steps (or with a
    combine in flight) loads only into the same settings."""
    taken = int(own.get("local_steps_taken", 0))
    if not taken and own.get("combined_deltas") is None:
        return None
    saved = own.get("local_settings")
    if saved is None and settings is not None:
        return None  # a state from before the settings were saved: its shape is checked on loading
    if saved is not None:
        saved = {"outer_optimizer": None, **saved}  # a state from before outer optimizers: the built-in one
    if saved == settings:
        return None
    here = "no local steps (local_steps=1, delay=0, no outer optimizer)" if settings is None else str(settings)
    inflight = ", a combine in flight" if own.get("combined_deltas") is not None else ""
    return (f"the state was taken inside a window of local steps ({taken} local steps taken{inflight}) of an "
            f"optimizer with {saved if saved is not None else 'local steps'}; this optimizer has {here}. Load it "
            "into an optimizer with the same local-steps settings, or save the state after flush() (every "
            "window combined), which loads into any settings")
