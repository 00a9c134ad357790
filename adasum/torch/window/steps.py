"""The training loop's side of :class:`~adasum.torch.DistributedOptimizer`: counting micro-batches,
``step()``, forcing and flushing a window, ``no_sync()``, ``zero_grad()``, finalizing and clipping the
gradients ahead of the step, and what a closed window does (a boundary, or a local step and every H-th a
combine) and counts.

:class:`Parts` holds what the optimizer's constructor made; :class:`Steps` works on them, and the
optimizer delegates its loop methods and flags to it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch
from mpi4py import MPI

from ..overlap.engine import OverlapEngine
from .accumulate import AccumulationWindow
from .agreement import Layout, Ledger, agree
from .amp import LossScale
from .boundary import Boundary, log_skip
from .local_steps import LocalSteps
from .module_buffers import BufferSync
from .reduce import trained_params

__all__ = ["Parts", "Steps"]


@dataclasses.dataclass(eq=False)
class Parts:
    """The parts of one optimizer, made by its constructor."""

    optimizer: torch.optim.Optimizer  # the wrapped optimizer
    comm: MPI.Intracomm
    window: AccumulationWindow        # the micro-batches of the open window
    ledger: Ledger                    # what the ranks agree on at each combine
    layout: Layout                    # how they compare their windows' parameters
    loss: LossScale
    strategy: Any                     # AdasumDeltas or GradientReduce: what a boundary does with a bucket
    boundary: Boundary                # the boundary (no local steps)
    local: LocalSteps | None          # local steps (and delay=1) where the settings ask for them
    engine: OverlapEngine | None      # overlap with backward
    buffers: BufferSync | None        # the module's buffers kept alike


class Steps:
    """The loop methods and the flags of one optimizer, on its :class:`Parts`."""

    def __init__(self, parts: Parts):
        self.parts = parts
        self.is_boundary = False      # the last step() combined
        self.took_local_step = False  # the last step() closed an accumulation window
        self.step_was_skipped = False  # that combine was skipped for non-finite values
        self.skipped_updates = 0

    @property
    def vote_comm(self) -> MPI.Intracomm:
        """Where the window's agreements run: the overlap's lane while there is one (its first job at a
        closing backward is the agreement, so a rank whose windows are out of step meets it there), else
        ``comm``."""
        engine = self.parts.engine
        return engine.comm if engine is not None and not engine.closed else self.parts.comm

    def force_boundary(self) -> None:
        self.parts.window.force()

    def flush(self) -> bool:
        parts = self.parts
        self.is_boundary = self.step_was_skipped = self.took_local_step = False
        if parts.window.seen:
            parts.window.force()  # with local steps: the combine follows this local step
            self.close_window(parts.window.seen)
            return True
        if parts.local is not None and (parts.local.taken or parts.local.pending):
            self._combine(drain=True)
            return True
        decision = agree(self.vote_comm, parts.ledger.at(0), parts.layout, trained_params(parts.optimizer), None)
        if decision.failed:
            raise RuntimeError(f"(raised on rank {parts.comm.Get_rank()}) flush() found the ranks out of step; "
                               f"nothing was changed: {decision.failed}")
        if parts.buffers is not None:  # forward passes since the last window changed them on each rank
            parts.buffers.sync()
        return False

    @contextlib.contextmanager
    def no_sync(self):
        engine = self.parts.engine
        if engine is None:
            yield
            return
        engine.paused += 1
        try:
            yield
        finally:
            engine.paused -= 1

    def zero_grad(self, set_to_none: bool = True) -> None:
        parts = self.parts
        if parts.engine is not None:
            parts.engine.refuse_unfinished("zero_grad()")
        if parts.window.seen:
            return
        inner = getattr(parts.optimizer, "zero_grad", None)
        if callable(inner):
            inner(set_to_none=set_to_none)
            return
        for p in trained_params(parts.optimizer):
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()

    def finalize_gradients(self) -> bool:
        parts = self.parts
        if not parts.window.closes_next:
            return False
        if parts.local is not None:
            parts.local.finalize(parts.window.seen + 1)  # each rank's own, before its local step
        else:
            parts.boundary.finalize(parts.ledger.at(parts.window.seen + 1))
        return True

    def step(self) -> None:
        """Record one micro-batch; where it closes a window, reduce and update."""
        self.is_boundary = self.step_was_skipped = self.took_local_step = False
        if self.parts.window.record():
            self.close_window(self.parts.window.seen)

    def close_window(self, count: int) -> None:
        parts = self.parts
        if parts.local is not None:
            forced = parts.window.forced
            parts.window.close()
            self.took_local_step = True
            if parts.local.local_step(count, forced):
                self._combine(drain=forced)
            return
        if not parts.boundary.run(count, parts.ledger.at(count)):
            self._record_skip()
        self._after_boundary()

    def _combine(self, drain: bool = False) -> None:
        if not self.parts.local.combine(self.parts.ledger.at(0), drain):
            self._record_skip()
        self._after_boundary()

    def _after_boundary(self) -> None:
        self.parts.ledger.combines += 1
        self.is_boundary = True
        if self.parts.buffers is not None:
            self.parts.buffers.sync()

    def _record_skip(self) -> None:
        parts = self.parts
        self.skipped_updates += 1
        self.step_was_skipped = True
        number = parts.ledger.combines + 1
        if parts.local is not None:
            parts.local.log_skip(number, self.skipped_updates)
        else:
            log_skip(parts.comm, parts.strategy, number, self.skipped_updates)
