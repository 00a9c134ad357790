"""The outer optimizer of local steps (DiLoCo's outer SGD with Nesterov momentum), on the pseudo-gradient
``g = -combined delta`` of each parameter, tracked by identity."""

from __future__ import annotations

import torch

from .tensors import Snapshot
from ..internals import foreach_add_, foreach_mul, foreach_mul_, foreach_neg_

__all__ = ["OuterSGD"]


class OuterSGD:
    """The outer optimizer: SGD on the pseudo-gradient ``g = -combined delta``, Nesterov where
    ``momentum > 0`` (the module's formula). Its state is a momentum buffer per parameter, by identity."""

    def __init__(self, lr: float, momentum: float):
        self.lr = float(lr)
        self.momentum = float(momentum)
        self.velocity: dict[int, torch.Tensor] = {}

    @property
    def plain(self) -> bool:
        """start + combined delta, exactly."""
        return self.lr == 1.0 and self.momentum == 0.0

    def apply_(self, deltas: list[torch.Tensor], params: list[torch.Tensor], base: Snapshot) -> None:
        """``deltas`` (the combined deltas of ``params``) become the new points: base moved by the outer step."""
        with torch.no_grad():
            if not deltas:
                return
            if not self.plain:
                foreach_neg_(deltas)  # g
                if self.momentum:
                    v = [self._velocity(p, d) for p, d in zip(params, deltas)]
                    foreach_mul_(v, self.momentum)
                    foreach_add_(v, deltas)  # v = mu * v + g
                    foreach_add_(deltas, foreach_mul(v, self.momentum))  # g + mu * v
                foreach_mul_(deltas, -self.lr)
            base.apply(deltas, params, "add")

    def _velocity(self, p: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        v = self.velocity.get(id(p))
        if v is None or v.shape != like.shape:
            v = self.velocity[id(p)] = torch.zeros_like(like)
        return v

    def state_dict(self, everything: list[torch.Tensor]) -> list[torch.Tensor | None] | None:
        """The momentum buffers, one per parameter of the optimizer (None where it has none), or None."""
        if not self.velocity:
            return None
        return [None if id(p) not in self.velocity else self.velocity[id(p)].detach().clone() for p in everything]

    def load_state_dict(self, state, everything: list[torch.Tensor], trained: list[torch.Tensor]) -> None:
        self.velocity = {}
        if state is None:
            return
        params = everything if len(state) == len(everything) else trained  # else: one per trained parameter
        if len(state) != len(params) or any(v is not None and tuple(v.shape) != tuple(p.shape)
                                            for v, p in zip(state, params)):
            raise ValueError(f"the state's outer momentum buffer has {len(state)} tensors that do not fit the "
                             f"optimizer's {len(params)} parameters")
        for p, v in zip(params, state):
            if v is not None:
                self.velocity[id(p)] = v.detach().to(device=p.device, dtype=p.dtype, copy=True)
