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
import weakref
from typing import Any

import torch
from mpi4py import MPI

from ..overlap.engine import OverlapEngine
from .accumulate import AccumulationWindow
from .amp import LossScale
from .boundary import Boundary
from .close import Layout, Ledger, WindowClose
from .compress import Wire
from .local_steps import LocalSteps
from .module_buffers import BufferSync
from .outer import OuterSGD, TorchOuter
from .strategies import AdasumDeltas, GradientReduce
from .tensors import trained_params
from .tensors import StartCopy

__all__ = ["Parts", "Steps", "assemble"]


@dataclasses.dataclass(eq=False)
class Parts:
    """The parts of one optimizer, made by its constructor."""

    optimizer: torch.optim.Optimizer  # the wrapped optimizer
    comm: MPI.Intracomm
    window: AccumulationWindow        # the micro-batches of the open window
    ledger: Ledger                    # what the ranks agree on at each combine
    closing: WindowClose              # the window's procedure: agreement, apply, counters
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

    @property
    def step_was_skipped(self) -> bool:
        """The last step() combined, and that combine was skipped for non-finite values."""
        return self.is_boundary and self.parts.closing.step_was_skipped

    @property
    def skipped_updates(self) -> int:
        return self.parts.closing.skipped

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
        self.is_boundary = self.took_local_step = False
        if parts.window.seen:
            parts.window.force()  # with local steps: the combine follows this local step
            self.close_window(parts.window.seen)
            return True
        if parts.local is not None and (parts.local.taken or parts.local.pending):
            self._combine(drain=True)
            return True
        parts.closing.decide(parts.ledger.at(0), trained_params(parts.optimizer), comm=self.vote_comm,
                           context="flush() found the ranks out of step; nothing was changed")
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
        self.is_boundary = self.took_local_step = False
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
        parts.boundary.run(count, parts.ledger.at(count))
        self._after_boundary()

    def _combine(self, drain: bool = False) -> None:
        self.parts.local.combine(self.parts.ledger.at(0), drain)
        self._after_boundary()

    def _after_boundary(self) -> None:
        """The module's buffers made alike (the procedure counted the combine)."""
        self.is_boundary = True
        if self.parts.buffers is not None:
            self.parts.buffers.sync()


def assemble(opt, module, kept: list[torch.Tensor], wire: Wire, loss: LossScale,
              overlap: bool) -> Parts:
    """The parts the settings of ``opt`` (a :class:`~adasum.torch.DistributedOptimizer`) ask for: the strategy, local steps, the buffers' sync, the overlap engine
    (dropped, never waited for, once the optimizer is collected) and the boundary."""
    optimizer, comm, opts = opt.optimizer, opt.comm, opt.options
    window, layout = AccumulationWindow(opts.accumulation_steps), Layout(optimizer)
    local_steps = opts.uses_local_steps or opt.outer_optimizer is not None
    if local_steps:
        close = WindowClose(comm, layout, loss, name="DistributedOptimizer", unit="combine",
                            skip_nonfinite=opt.skip_nonfinite, failed="a local step or combine failed in this "
                            "window of local steps; the parameters are back at the window's start")
    else:
        close = WindowClose(comm, layout, loss, name="DistributedOptimizer", skip_nonfinite=opt.skip_nonfinite,
                            failed="a local step or reduction failed at this boundary; the parameters keep the "
                            "window's start")
    ledger = Ledger(window, close)
    if opt.op == "adasum" and comm.Get_size() > 1:
        strategy = AdasumDeltas(optimizer, StartCopy(opt.start_copy), wire, opt.hierarchical,
                                opt.skip_nonfinite)
    else:  # one rank: exactly the wrapped optimizer (the reduction is the identity)
        strategy = GradientReduce(optimizer, opt.op, wire)
    local = None
    if local_steps:
        outer = OuterSGD(opt.outer_lr, opt.outer_momentum) if opt.outer_optimizer is None else \
            TorchOuter(opt.outer_optimizer)
        local = ledger.local = LocalSteps(optimizer, comm, opt.op, opt.local_steps,
                                          outer, opt.start_copy, wire,
                                          opt.hierarchical, opt.skip_nonfinite, close, opt.delay)
    source = module if isinstance(module, torch.nn.Module) else None
    buffers = None if opt.buffers is None else BufferSync(opt.buffers, kept, comm, source)
    engine = None
    if overlap:
        engine = OverlapEngine(optimizer, strategy, window, loss, comm, opt.bucket_bytes, ledger, close)
        weakref.finalize(opt, engine.drop)  # never waits for a collective (OverlapEngine.drop)
    boundary = Boundary(optimizer, comm, strategy, window, loss, engine, close)
    return Parts(optimizer, comm, window, ledger, close, loss, strategy, boundary, local, engine, buffers)
