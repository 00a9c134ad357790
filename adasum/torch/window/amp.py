"""The loss scale of mixed-precision training, kept the same on every rank.

``torch.amp.GradScaler`` decides on its own rank whether a step overflowed; across ranks the decisions (and
so the scales) would drift apart. :class:`LossScale` applies GradScaler's rule instead from the decision
that every rank shares (the skip of a boundary), and sets the scaler's scale with ``update(new_scale)``.
"""

from __future__ import annotations

import math

__all__ = ["LossScale"]


class LossScale:
    """The scale the gradients of a window carry (1.0 without a scaler, or with a disabled one), and its
    update after each boundary."""

    def __init__(self, grad_scaler=None):
        if grad_scaler is not None and not all(callable(getattr(grad_scaler, m, None))
                                               for m in ("scale", "update", "get_scale", "is_enabled")):
            raise TypeError(f"grad_scaler must be a torch.amp.GradScaler, got {type(grad_scaler).__name__}")
        self.scaler = grad_scaler
        self.good_steps = 0  # boundaries since the scale last changed (GradScaler's growth tracker)

    @property
    def enabled(self) -> bool:
        return self.scaler is not None and self.scaler.is_enabled()

    def current(self) -> float:
        return float(self.scaler.get_scale()) if self.enabled else 1.0

    def update(self, scale: float, ok: bool) -> None:
        """GradScaler's rule (back off on a skip, grow after ``growth_interval`` good boundaries), driven by
        the all-rank decision ``ok`` about a boundary whose gradients carried ``scale``."""
        if not self.enabled:
            return
        s = self.scaler
        if not ok:
            new, self.good_steps = scale * s.get_backoff_factor(), 0
        else:
            self.good_steps += 1
            new = scale
            if self.good_steps >= s.get_growth_interval():
                grown = scale * s.get_growth_factor()
                if math.isfinite(grown):
                    new = grown
                self.good_steps = 0
        s.update(float(new))
