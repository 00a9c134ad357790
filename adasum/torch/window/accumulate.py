"""The micro-batch accumulation stage: when a window of micro-batches closes, and a scheduler that steps
once per closed window.

The calling convention is Accelerate's: after every micro-batch's ``backward()`` the training loop calls
``optimizer.step()`` and ``optimizer.zero_grad()``. Gradients add up in ``.grad`` while a window is open;
both calls do nothing until the window closes (a *boundary*), where the optimizer averages the gradients
over the micro-batches the window actually held, reduces and updates.
"""

from __future__ import annotations

from typing import Any

__all__ = ["AccumulationWindow", "BoundaryScheduler"]


class AccumulationWindow:
    """Counts the micro-batches of the open window and decides when it closes.

    A window closes at the micro-batch that brings its count to ``steps``, or earlier at one the user
    marked with :meth:`force` (the end of the data, say). It knows nothing about MPI; the same rule on
    every rank keeps the ranks' boundaries aligned.
    """

    def __init__(self, steps: int):
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"accumulation_steps must be a positive integer, got {steps!r}")
        self.steps = steps
        self.seen = 0          # micro-batches recorded in the open window
        self.forced = False    # the next recorded micro-batch closes the window whatever the count
        self.total = 0         # micro-batches of the windows closed so far (the ranks compare it)

    @property
    def closes_next(self) -> bool:
        """Whether the next recorded micro-batch closes the window."""
        return self.forced or self.seen + 1 >= self.steps

    def force(self) -> None:
        """Make the next recorded micro-batch close the window."""
        self.forced = True

    def record(self) -> bool:
        """Count one micro-batch; True if it closes the window (the caller then calls :meth:`close`)."""
        closes = self.closes_next
        self.seen += 1
        return closes

    def close(self) -> int:
        """End the open window; returns how many micro-batches it held."""
        n, self.seen, self.forced = self.seen, 0, False
        self.total += n
        return n

    def state_dict(self) -> dict[str, Any]:
        return {"micro_steps": self.seen, "forced": self.forced, "micro_batches_closed": self.total}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        seen = int(state.get("micro_steps", 0))
        if seen < 0:
            raise ValueError(f"micro_steps in the state must be >= 0, got {seen}")
        self.seen = seen
        self.forced = bool(state.get("forced", False))
        self.total = int(state.get("micro_batches_closed", 0))


class BoundaryScheduler:
    """A learning-rate scheduler that steps once per accumulation boundary.

    Call :meth:`step` after every ``optimizer.step()``, like the optimizer itself; it steps the wrapped
    scheduler only when that ``optimizer.step()`` closed a window (``optimizer.is_boundary``), skipped
    update or not, so the schedule counts windows, not micro-batches. Everything else (``get_last_lr``,
    ``state_dict``, ``last_epoch`` …) goes to the wrapped scheduler.

    The same without this class::

        optimizer.step()
        if optimizer.is_boundary:
            scheduler.step()
    """

    def __init__(self, scheduler, optimizer):
        if not hasattr(optimizer, "is_boundary"):
            raise TypeError(f"optimizer must be an adasum.torch.DistributedOptimizer (it tells where windows "
                            f"close), got {type(optimizer).__name__}")
        self.scheduler = scheduler
        self.optimizer = optimizer

    def step(self, *args, **kwargs) -> bool:
        """Step the scheduler if the last ``optimizer.step()`` was a boundary; returns whether it did."""
        if not self.optimizer.is_boundary:
            return False
        self.scheduler.step(*args, **kwargs)
        return True

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)

    def __getattr__(self, name: str):
        scheduler = self.__dict__.get("scheduler")
        if scheduler is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(scheduler, name)
