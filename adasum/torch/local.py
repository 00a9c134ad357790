"""Local steps between combines, and the outer optimizer: ``DistributedOptimizer(local_steps=H,
outer_lr=, outer_momentum=)``.

Each rank's wrapped optimizer takes H local steps (one per accumulation window, each a plain
``optimizer.step()`` on the rank's own averaged gradients, with its hooks), with no MPI call in between.
After the H-th, the ranks combine each parameter's delta since the window's start (``op="adasum"``: Adasum,
one layer per parameter; ``"mean"``/``"sum"``: the mean/sum of the deltas, model averaging), and every
rank continues from the same point: the window's start moved by the outer optimizer, DiLoCo's outer SGD
with Nesterov momentum on the pseudo-gradient ``g = -combined delta``::

    v <- mu * v + g
    params <- start - outer_lr * (g + mu * v)

With the defaults (``outer_lr=1``, ``outer_momentum=0``) that is start + combined delta.

:class:`LocalSteps` is the procedure, :class:`OuterSGD` the outer optimizer; the optimizer proxy
(:mod:`.optimizer`) counts micro-batches and calls them.
"""

from __future__ import annotations

import logging
import numbers
from typing import Any

import torch
from mpi4py import MPI

from ..runtime import exchange
from .amp import LossScale
from .compress import Wire
from .strategy import _describe, trained_params
from .tensors import StartCopy, all_finite, average_, grads_of

__all__ = ["LocalSteps", "OuterSGD", "local_problem", "uses_local_steps"]

_log = logging.getLogger("adasum")


def uses_local_steps(local_steps: int, outer_lr: float, outer_momentum: float, delay: int) -> bool:
    """Whether these settings need :class:`LocalSteps` (anything but ``1, 1.0, 0.0, 0``: today's boundary)."""
    return not (local_steps == 1 and outer_lr == 1.0 and outer_momentum == 0.0 and delay == 0)


def local_problem(settings: dict[str, Any]) -> str | None:
    """What is wrong with one rank's ``local_steps``, ``outer_lr``, ``outer_momentum``, ``delay`` and
    ``overlap`` (as passed), or None."""
    h, lr, mu, delay = (settings[k] for k in ("local_steps", "outer_lr", "outer_momentum", "delay"))
    if isinstance(h, bool) or not isinstance(h, numbers.Integral) or h < 1:
        return f"local_steps must be an integer >= 1, got {h!r}"
    if isinstance(lr, bool) or not isinstance(lr, numbers.Real) or not lr > 0 or lr == float("inf"):
        return f"outer_lr must be a number > 0, got {lr!r}"
    if isinstance(mu, bool) or not isinstance(mu, numbers.Real) or not 0 <= mu < 1:
        return f"outer_momentum must be a number in [0, 1), got {mu!r}"
    if isinstance(delay, bool) or delay not in (0, 1):
        return f"delay must be 0 or 1, got {delay!r}"
    if settings["overlap_requested"] and uses_local_steps(int(h), float(lr), float(mu), int(delay)):
        return ("overlap=True overlaps a combine with the backward that closes it; with local_steps > 1 or an "
                "outer optimizer the combine follows the H-th local step instead: construct the optimizer "
                "with overlap=False")
    return None


class OuterSGD:
    """The outer optimizer: SGD on the pseudo-gradient ``g = -combined delta``, Nesterov where
    ``momentum > 0`` (the module's formula). Its state is the momentum buffer, one tensor per trained
    parameter (None until the first combine, and always without momentum)."""

    def __init__(self, lr: float, momentum: float):
        self.lr = float(lr)
        self.momentum = float(momentum)
        self.velocity: list[torch.Tensor] | None = None

    @property
    def plain(self) -> bool:
        """start + combined delta, exactly."""
        return self.lr == 1.0 and self.momentum == 0.0

    def apply_(self, deltas: list[torch.Tensor], start: StartCopy, index: list[int]) -> None:
        """``deltas`` (the parameters themselves, holding the combined deltas) become the new parameters."""
        with torch.no_grad():
            if not deltas:
                return
            if not self.plain:
                torch._foreach_neg_(deltas)  # g
                if self.momentum:
                    if self.velocity is None or len(self.velocity) != len(deltas):
                        self.velocity = [torch.zeros_like(d) for d in deltas]
                    torch._foreach_mul_(self.velocity, self.momentum)
                    torch._foreach_add_(self.velocity, deltas)  # v = mu * v + g
                    torch._foreach_add_(deltas, torch._foreach_mul(self.velocity, self.momentum))  # g + mu * v
                torch._foreach_mul_(deltas, -self.lr)
            start.apply(deltas, index, "add")

    def state_dict(self) -> list[torch.Tensor] | None:
        return None if self.velocity is None else [v.detach().clone() for v in self.velocity]

    def load_state_dict(self, velocity, params: list[torch.Tensor]) -> None:
        if velocity is None:
            self.velocity = None
            return
        if len(velocity) != len(params) or any(tuple(v.shape) != tuple(p.shape) for v, p in zip(velocity, params)):
            raise ValueError(f"the state's outer momentum buffer has {len(velocity)} tensors that do not fit the "
                             f"optimizer's {len(params)} trained parameters")
        self.velocity = [v.detach().to(device=p.device, dtype=p.dtype, copy=True) for v, p in zip(velocity, params)]


class LocalSteps:
    """The window of local steps and its combine, for one optimizer. No reference to the proxy."""

    def __init__(self, optimizer, comm: MPI.Intracomm, op: str, steps: int, outer: OuterSGD, start: StartCopy,
                 wire: Wire, hierarchical: bool, skip_nonfinite: bool, loss: LossScale):
        self.optimizer = optimizer
        self.comm = comm
        self.op = op
        self.steps = steps
        self.outer = outer
        self.start = start
        self.wire = wire
        self.hierarchical = hierarchical
        self.skip_nonfinite = skip_nonfinite
        self.loss = loss
        self.taken = 0             # local steps in the open window (skipped ones included)
        self.overflowed = False    # a local step of this window had non-finite gradients on this rank
        self.error: str | None = None  # a local step of this window raised on this rank
        self.averaged = False      # the closing accumulation window's gradients are averaged already
        self._window = None        # a loaded open window: (start, this rank's parameters)

    def finalize(self, count: int) -> None:
        """Average (and unscale) the gradients of the accumulation window that the next local step uses."""
        if not self.averaged:
            average_(grads_of(trained_params(self.optimizer)), count, self.loss.current())
            self.averaged = True

    def local_step(self, count: int, forced: bool) -> bool:
        """One local step from the gradients of ``count`` micro-batches; no MPI call. Returns whether the
        window of local steps closes now (the H-th, or a forced boundary): the caller then calls
        :meth:`combine`."""
        params = trained_params(self.optimizer)
        self._window = None
        if self.taken == 0:
            self.start.ensure(params)
            self.start.keep(list(range(len(params))), params)
        self.taken += 1
        try:
            self.finalize(count)
            finite = not self.skip_nonfinite or all_finite(grads_of(params))
            self.overflowed |= not finite
            # A rank whose gradients are not finite skips this local step (its optimizer state stays finite);
            # after a failed step the window only counts: its combine raises on every rank.
            if finite and self.error is None:
                self.optimizer.step()
        except BaseException as e:  # noqa: BLE001 - raised on every rank at the combine
            self.error = self.error or _describe(e)
        finally:
            self.averaged = False
        return forced or self.taken >= self.steps

    pending = False  # a combine in flight (delay=1, :mod:`.delayed`)

    def close(self) -> None:
        """Nothing runs apart (delay=1 waits for its thread here)."""

    def combine(self, drain: bool = False) -> bool:
        """Collective (``drain`` matters only with ``delay=1``): every parameter becomes the outer optimizer's step from the window's start along the
        combined delta, or keeps the start where the combined delta is not finite (then False, on every rank
        alike). A local step that raised on any rank raises here on every rank, the start restored."""
        params = trained_params(self.optimizer)
        index = list(range(len(params)))
        targets = [p.detach() for p in params]
        error, self.error, overflowed = self.error, None, self.overflowed
        self.taken, self.overflowed = 0, False
        failed = exchange.failures(self.comm, error, what="the combine's error vote")
        if failed:
            self.start.apply(targets, index, "copy")
            raise RuntimeError(f"(raised on rank {self.comm.Get_rank()}) a local step failed in this window of "
                               f"local steps; the parameters keep the window's start: {failed}")
        scale = self.loss.current()
        if self.loss.enabled:
            overflowed = exchange.any_true(self.comm, overflowed, what="the combine's overflow vote")
        with torch.no_grad():
            self.start.apply(targets, index, "sub")  # the parameters hold this rank's deltas
            names = [f"parameter {i} (shape {tuple(p.shape)})" for i, p in enumerate(params)]
            if self.comm.Get_size() > 1 and targets:
                if self.op == "adasum":
                    amax = self.wire.adasum_(targets, self.comm, self.hierarchical,
                                             names if self.wire.dtype else None)
                else:
                    amax = self.wire.sum_(targets, self.comm, self.op == "mean", names if self.wire.dtype else None)
            else:
                amax = None
            ok = not self.skip_nonfinite or all_finite(targets)
            if ok:
                self.outer.apply_(targets, self.start, index)
            else:
                self.wire.explain(targets, amax, names)
                self.start.apply(targets, index, "copy")
        self.loss.update(scale, ok and not overflowed)
        return ok

    def log_skip(self, number: int, skipped: int) -> None:
        if self.comm.Get_rank() == 0:
            _log.warning("adasum: combine %d skipped on every rank: the combined weight deltas hold a NaN or "
                         "Inf; parameters left at the window's start (%d skipped so far)", number, skipped)

    # --- state ---------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The open window (its local steps, this rank's parameters and the window's start, while any local
        step was taken) and the outer optimizer's momentum buffer."""
        own: dict[str, Any] = {"local_steps_taken": self.taken, "local_overflowed": self.overflowed,
                               "outer_momentum_buffer": self.outer.state_dict()}
        if self.error is not None:
            own["local_error"] = self.error
        if self.taken:
            params = trained_params(self.optimizer)
            start = [torch.empty_like(p, device="cpu") for p in params]
            self.start.apply(start, list(range(len(params))), "copy")
            own["window_start"] = start
            own["window_parameters"] = [p.detach().clone() for p in params]
        return own

    def load_state_dict(self, own: dict[str, Any]) -> None:
        params = trained_params(self.optimizer)
        taken = int(own.get("local_steps_taken", 0))
        start, now = own.get("window_start"), own.get("window_parameters")
        if taken < 0 or (taken and (start is None or now is None)):
            raise ValueError(f"the state's open window of local steps ({taken} taken) lacks its start or parameters")
        for name, values in (("window_start", start), ("window_parameters", now)):
            if values is not None and (len(values) != len(params) or any(
                    tuple(v.shape) != tuple(p.shape) for v, p in zip(values, params))):
                raise ValueError(f"the state's {name} does not fit the optimizer's {len(params)} trained parameters")
        self.outer.load_state_dict(own.get("outer_momentum_buffer"), params)
        self.taken = taken
        self.overflowed = bool(own.get("local_overflowed", False))
        self.error = own.get("local_error")
        self.averaged = False
        self._window = (start, now) if taken else None
        if taken:
            self.start.ensure(params)
            self.start.keep(list(range(len(params))), [s.to(p.device, p.dtype) for s, p in zip(start, params)])
            self.restore_parameters()

    def restore_parameters(self) -> None:
        """Set the parameters to this rank's own values in the loaded open window (a checkpoint's model holds
        the root rank's)."""
        window = self._window
        if window is None:
            return
        with torch.no_grad():
            for p, v in zip(trained_params(self.optimizer), window[1]):
                p.copy_(v)
