"""The state of :class:`~adasum.torch.DistributedOptimizer` for checkpoints: the wrapped optimizer's state
dict plus the window, its counters and, while a window is open, the accumulated gradients
(:mod:`.checkpoint` saves and resumes it).

:class:`StateDicts` is a base of the optimizer; it works on the parts the constructor made: ``_window``,
``_loss``, ``_boundary`` and ``_local``.
"""

from __future__ import annotations

from typing import Any

from .arguments import check_accumulated
from .local import load_problem

__all__ = ["StateDicts"]


class StateDicts:
    """``state_dict()`` and ``load_state_dict()`` of :class:`~adasum.torch.DistributedOptimizer`."""

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict plus one key, ``"adasum"``: the window's micro-batch count and
        forced flag, the boundary and skip counters, the loss-scale growth tracker, and, while a window is
        open, the accumulated gradients (one entry per parameter, None where there is none). Per rank: with
        ``op="adasum"`` the wrapped optimizer's state differs between ranks."""
        state = dict(self.optimizer.state_dict())
        own: dict[str, Any] = {**self._window.state_dict(), "boundaries": self.boundaries,
                               "skipped_updates": self.skipped_updates, "scaler_good_steps": self._loss.good_steps}
        if self._local is not None:
            own.update(self._local.state_dict())
        if self._window.seen:
            own["accumulated_grads"] = [None if p.grad is None else p.grad.detach() for p in self._params()]
        state["adasum"] = own
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state from :meth:`state_dict`, or a plain state of the wrapped optimizer (the counters then
        start from zero)."""
        self._check_open("load_state_dict()")
        state = dict(state_dict)
        own = state.pop("adasum", None) or {}
        grads = own.get("accumulated_grads")
        params = self._params()
        check_accumulated(grads, params)
        problem = load_problem(own, None if self._local is None else self._local.settings)
        if problem is not None:
            raise ValueError(f"rank {self.comm.Get_rank()}: {problem}")
        self.optimizer.load_state_dict(state)
        self._window.load_state_dict(own)
        self.boundaries = int(own.get("boundaries", 0))
        self.skipped_updates = int(own.get("skipped_updates", 0))
        self._loss.good_steps = int(own.get("scaler_good_steps", 0))
        self.is_boundary = self.step_was_skipped = False
        self._boundary.reset()
        if self._local is not None:
            self._local.load_state_dict(own)
        if grads is not None:
            for p, g in zip(params, grads):
                p.grad = None if g is None else g.detach().to(device=p.device, dtype=p.dtype, copy=True)

    def _restore_window(self) -> None:
        """After a checkpoint's model (the root rank's parameters) was loaded over a loaded open window of
        local steps: this rank's own parameters again."""
        if self._local is not None:
            self._local.restore_parameters()
