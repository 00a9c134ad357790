"""The accumulation window's side of :class:`~adasum.torch.DistributedOptimizer`: counting micro-batches,
``step()``, forcing and flushing a window, ``no_sync()``, ``zero_grad()``, finalizing and clipping the
gradients ahead of the step, and what a closed window does (a boundary, or a local step and every H-th a
combine) and counts.

:class:`WindowSteps` is a base of the optimizer; it works on the parts the constructor made: ``_window``
(:class:`~adasum.torch.accumulate.AccumulationWindow`), ``_boundary`` (:class:`~adasum.torch.boundary.Boundary`),
``_local`` (:class:`~adasum.torch.local.LocalSteps` or None), ``_engine`` (the overlap engine or None),
``_buffers`` (:class:`~adasum.torch.buffers.BufferSync` or None) and ``_strategy``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from .boundary import log_skip
from .window import agree

__all__ = ["WindowSteps"]


class WindowSteps:
    """The window's API, the step and the boundary counters of :class:`~adasum.torch.DistributedOptimizer`."""

    @property
    def accumulation_steps(self) -> int:
        return self._window.steps

    @property
    def micro_steps(self) -> int:
        """Micro-batches recorded in the open window (0 right after a boundary)."""
        return self._window.seen

    @property
    def sync_gradients(self) -> bool:
        """Whether the next ``step()`` closes a window (the moment to clip, see :meth:`finalize_gradients`)."""
        return self._window.closes_next

    def force_boundary(self) -> None:
        """Make the next ``step()`` close the window, however few micro-batches it holds (the end of the
        data, before evaluating or saving). Every rank must force the same step."""
        self._check_open("force_boundary()")
        self._window.force()

    def flush(self) -> bool:
        """Close and combine what is open, now, without a new micro-batch: the accumulation window (if it
        holds micro-batches), and with local steps the window of local steps (and ``delay=1``'s combine in
        flight). Returns whether it combined anything. Afterwards every rank holds the same parameters.

        For loops that learn only after the last micro-batch that the data ended, and at the end of
        training. Collective, even where nothing is open: the ranks check that they recorded as many
        micro-batches and windows as each other, and a rank that skipped or added a ``step()`` makes every
        rank raise, naming the ranks and their counts.
        """
        self._check_open("flush()")
        self.is_boundary = self.step_was_skipped = False
        self.took_local_step = False
        if self._window.seen:
            self._window.force()  # with local steps: the combine follows this local step
            self._close_window(self._window.seen)
            return True
        if self._local is not None and (self._local.taken or self._local.pending):
            self._combine(drain=True)
            return True
        decision = agree(self._vote_comm, self._ledger.at(0), self._layout, self._params(), None)
        if decision.failed:
            raise RuntimeError(f"(raised on rank {self.comm.Get_rank()}) flush() found the ranks out of step; "
                               f"nothing was changed: {decision.failed}")
        return False

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside do not close a window, whatever the count says: their gradients only
        accumulate, and with ``overlap`` no bucket is reduced during them. For frameworks that count the
        micro-batches themselves and call ``step()`` once per window (``accumulation_steps=1``)."""
        self._check_open("no_sync()")
        if self._engine is None:
            yield
            return
        self._engine.paused += 1
        try:
            yield
        finally:
            self._engine.paused -= 1

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients, unless a window is open (then the gradients are still accumulating)."""
        self._check_open("zero_grad()")
        if self._engine is not None:
            self._engine.refuse_unfinished("zero_grad()")
        if self._window.seen:
            return
        inner = getattr(self.optimizer, "zero_grad", None)
        if callable(inner):
            inner(set_to_none=set_to_none)
            return
        for p in self._params():
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()

    def finalize_gradients(self) -> bool:
        """If the next ``step()`` closes a window, make ``.grad`` what the local step will use, now: divided
        by the window's micro-batch count, unscaled by the ``grad_scaler``, and for ``op="sum"``/``"mean"``
        reduced over the ranks (collective). Returns whether it did; off the boundary it does nothing.

        Call it before clipping or inspecting gradients::

            if optimizer.finalize_gradients():
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
        """
        self._check_open("finalize_gradients()")
        if not self._window.closes_next:
            return False
        if self._local is not None:
            self._local.finalize(self._window.seen + 1)  # each rank's own, before its local step
        else:
            self._boundary.finalize(self._ledger.at(self._window.seen + 1))
        return True

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, **kwargs) -> torch.Tensor | None:
        """At a boundary: :meth:`finalize_gradients`, then ``torch.nn.utils.clip_grad_norm_`` over the
        parameters, returning the total norm; off the boundary nothing, returning None.

        With ``op="sum"``/``"mean"`` this clips the reduced gradient (the same norm on every rank), with
        ``op="adasum"`` each rank's own averaged gradient before its local step.
        """
        if not self.finalize_gradients():
            return None
        return torch.nn.utils.clip_grad_norm_(self._params(), max_norm, norm_type, **kwargs)

    # --- the step --------------------------------------------------------------------------------------------

    def step(self, closure: Callable[[], Any] | None = None):
        """Record one micro-batch; where it closes a window, reduce and update (collective there).

        ``closure`` (forward and backward of this micro-batch, as torch optimizers and Lightning pass it) is
        evaluated first, once, at every call; its loss is returned. The wrapped optimizer then steps
        without it, so optimizers that evaluate the closure several times (LBFGS) are not supported.
        """
        self._check_open("step()")
        if "grad_scale" in self.__dict__ or "found_inf" in self.__dict__:
            self.__dict__.pop("grad_scale", None)
            self.__dict__.pop("found_inf", None)
            raise RuntimeError("DistributedOptimizer was passed to GradScaler.step(); instead give the scaler "
                               "to the constructor (DistributedOptimizer(..., grad_scaler=scaler)) and call "
                               "optimizer.step() directly: the scaler's own update would differ across ranks")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.is_boundary = self.step_was_skipped = self.took_local_step = False
        if self._window.record():
            self._close_window(self._window.seen)
        return loss

    def _close_window(self, count: int) -> None:
        if self._local is not None:
            forced = self._window.forced
            self._window.close()
            self.took_local_step = True
            if self._local.local_step(count, forced):
                self._combine(drain=forced)
            return
        if not self._boundary.run(count, self._ledger.at(count)):
            self._record_skip()
        self._after_boundary()

    def _combine(self, drain: bool = False) -> None:
        if not self._local.combine(self._ledger.at(0), drain):
            self._record_skip()
        self._after_boundary()

    def _after_boundary(self) -> None:
        self.boundaries += 1
        self.is_boundary = True
        if self._buffers is not None:
            self._buffers.sync()

    # --- non-finite updates -----------------------------------------------------------------------------------

    def _record_skip(self) -> None:
        self.skipped_updates += 1
        self.step_was_skipped = True
        if self._local is not None:
            self._local.log_skip(self.boundaries + 1, self.skipped_updates)
        else:
            log_skip(self.comm, self._strategy, self.boundaries + 1, self.skipped_updates)
