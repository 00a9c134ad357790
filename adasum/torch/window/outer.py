"""The outer optimizer of local steps, on the pseudo-gradient ``g = -combined delta`` of each parameter: the
built-in one (DiLoCo's outer SGD with Nesterov momentum, parameters tracked by identity), or any torch
optimizer the user built on the model's parameters (:class:`TorchOuter`)."""

from __future__ import annotations

import torch

from .tensors import Snapshot
from ..internals import foreach_add_, foreach_copy_, foreach_mul, foreach_mul_, foreach_neg_

__all__ = ["OuterSGD", "TorchOuter", "describe_outer", "outer_problem"]


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


class TorchOuter:
    """The outer optimizer as any torch optimizer the user built on the model's parameters (DiLoCo's form:
    ``outer_optimizer=torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)``). At each
    combine every parameter is set to the base point, its ``.grad`` to the pseudo-gradient
    ``g = -combined delta``, and the optimizer's own ``step()`` moves it; the parameters' own gradients and
    (``delay=1``) their current values are put back afterwards. Its state is the optimizer's own."""

    lr = momentum = None  # not settings of this class: the optimizer's param groups hold them
    plain = False

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    def apply_(self, deltas: list[torch.Tensor], params: list[torch.Tensor], base: Snapshot) -> None:
        """``deltas`` (the combined deltas of ``params``) become the new points: base moved by the step."""
        if not deltas:
            return
        with torch.no_grad():
            targets = [p.detach() for p in params]
            aliased = all(d.data_ptr() == t.data_ptr() for d, t in zip(deltas, targets))
            held = None if aliased else [t.clone() for t in targets]  # delay=1: the parameters go on from here
            grads = [p.grad for p in params]
            pseudo = [d.neg() for d in deltas]
            base.apply(targets, params, "copy")
        try:
            for p, g in zip(params, pseudo):
                p.grad = g
            self.optimizer.step()
        finally:
            for p, g in zip(params, grads):
                p.grad = g
        with torch.no_grad():
            if not aliased:
                foreach_copy_(deltas, targets)
                foreach_copy_(targets, held)

    def state_dict(self, everything: list[torch.Tensor]) -> dict:
        return {"outer_optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state, everything: list[torch.Tensor], trained: list[torch.Tensor]) -> None:
        if state is None:
            return
        if not isinstance(state, dict) or "outer_optimizer" not in state:
            raise ValueError("the state was saved with the built-in outer SGD (outer_lr, outer_momentum); this "
                             "optimizer has an outer_optimizer: load it into one made with the same settings")
        self.optimizer.load_state_dict(state["outer_optimizer"])


def outer_problem(outer, optimizer, opts) -> str | None:
    """What is wrong with ``outer`` (the ``outer_optimizer`` argument) for the wrapped ``optimizer`` and
    the settings ``opts``, or None."""
    if outer is None:
        return None
    if not isinstance(outer, torch.optim.Optimizer):
        return f"outer_optimizer must be a torch.optim.Optimizer, got {type(outer).__name__}"
    if outer is optimizer:
        return "outer_optimizer must be an optimizer of its own, not the wrapped one"
    if opts.outer_lr != 1.0 or opts.outer_momentum != 0.0:
        return ("outer_lr and outer_momentum set the built-in outer SGD; with an outer_optimizer give its rate "
                "and momentum to it")
    if opts.overlap is True:
        return "an outer_optimizer combines after the H-th local step: construct the optimizer with overlap=False"
    mine = {id(p) for g in outer.param_groups for p in g["params"]}
    missing = [i for i, p in enumerate(q for g in optimizer.param_groups for q in g["params"])
               if p.requires_grad and id(p) not in mine]
    if missing:
        return (f"outer_optimizer does not hold the wrapped optimizer's parameters {missing[:5]}"
                f"{' …' if len(missing) > 5 else ''}: build it on the same parameters (model.parameters())")
    return None


def describe_outer(outer) -> str | None:
    """How the ranks compare their outer optimizers: the class and every group's hyperparameters."""
    if outer is None:
        return None
    groups = [sorted((k, repr(v)) for k, v in g.items() if k != "params") for g in outer.param_groups]
    return f"{type(outer).__name__}{groups}"
