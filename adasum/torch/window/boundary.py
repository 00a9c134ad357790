"""What happens where a window of micro-batches closes: :class:`Boundary` takes the window's buckets
(reduced during backward by the overlap engine, or here as one bucket of every parameter), has every rank
vote on whether a bucket failed anywhere, then lets the reduce strategy hand over and apply the result, and
updates the loss scale from the decision every rank shares. For adasum, the wrapped optimizer's step hooks
run once per boundary around all that (pre-hooks first, post-hooks once the parameters hold the result),
whichever path the boundary took: its local steps run without them.

:meth:`Boundary.finalize` does the first part early, for a loop that clips or inspects the gradients before
``step()``: it averages them (``op="adasum"``: each rank's own, before its local step) or averages and
reduces them (sum/mean).
"""

from __future__ import annotations

import dataclasses

import torch
from mpi4py import MPI

from ..overlap.engine import OverlapEngine
from .accumulate import AccumulationWindow
from .amp import LossScale
from .close import WindowClose
from .strategies import AdasumDeltas, Bucket, BucketUpdate, GradientReduce
from .tensors import trained_params
from .tensors import average_, grads_of

__all__ = ["Boundary"]


@dataclasses.dataclass(eq=False)
class Boundary:
    """The boundary procedure of one optimizer, over the optimizer's parts; its state is what
    :meth:`finalize` did ahead of ``step()``."""

    optimizer: torch.optim.Optimizer
    comm: MPI.Intracomm
    strategy: AdasumDeltas | GradientReduce
    window: AccumulationWindow
    loss: LossScale
    engine: OverlapEngine | None
    closing: WindowClose              # the window's procedure
    averaged: bool = False  # the closing window's gradients are averaged already
    reduced: tuple | None = None  # ... and reduced (sum/mean): the update, the decision, the scale

    def reset(self) -> None:
        self.averaged, self.reduced = False, None

    def finalize(self, ledger: dict[str, int]) -> None:
        """Make ``.grad`` what the local step will use, for the window that the next ``step()`` closes."""
        if self.averaged or self.reduced is not None:
            return
        if isinstance(self.strategy, AdasumDeltas):
            # All gradients are needed before any local step: from now on every boundary runs in step().
            if self.engine is not None:
                self.engine.disable("finalize_gradients")
                if self.engine.started:
                    self.engine.finish()
                    raise RuntimeError(
                        "finalize_gradients()/clip_grad_norm_() was called at a boundary whose local steps "
                        "already ran during backward (overlap with op='adasum'); the parameters keep the "
                        "window's start. Call it at every boundary from the first one on (overlap then stays "
                        "off), or construct the optimizer with overlap=False")
            average_(grads_of(trained_params(self.optimizer)), self.window.seen + 1, self.loss.current())
            self.averaged = True
        else:
            self.reduced = self._reduce_and_agree(self.window.seen + 1, ledger)

    def run(self, count: int, ledger: dict[str, int]) -> bool:
        """Close the window of ``count`` micro-batches: reduce, agree, apply (the window's procedure). Returns
        False where the update was skipped for non-finite values (on every rank alike)."""
        try:
            update, decision, scale = self.reduced or self._reduce_and_agree(count, ledger)
            ok = self.closing.apply(update, decision, scale)
        finally:
            self.window.close()
            self.reset()
        if self.engine is not None and not self.engine.closed:
            self.engine.after_boundary()
        self.strategy.after_step()
        return ok

    def _reduce_and_agree(self, count: int, ledger: dict[str, int]) -> tuple:
        """The window's buckets reduced, once every rank agreed that none failed and that the windows match:
        the agreement before the wire (or riding on it) where the boundary reduces here, after it where the
        buckets were reduced during backward (overlap). Returns the update, the decision and the scale."""
        done = self.engine.finish() if self.engine is not None and not self.engine.closed else None
        # The wrapped optimizer's step pre-hooks, at the start of the boundary's work in step(): before the
        # local step, or after the threads finished the local steps they took during backward (overlap).
        # One that raises fails the boundary on every rank.
        hook_error = self.strategy.before_step()
        hook_error = hook_error and f"a step pre-hook of the wrapped optimizer raised {hook_error}"
        params = trained_params(self.optimizer)
        lane_open = self.engine is not None and not self.engine.closed
        if done is not None:
            (buckets, scale, refused) = done
            update = BucketUpdate(self.strategy, buckets, params, lambda: self._abandon(buckets))
            if refused is not None:  # the lane's agreement failed on every rank: no bucket was reduced
                update.abandon()
                raise self.closing.failure(f"the ranks' windows differ at this boundary: {refused}")
            error = next((b.error for b in buckets if b.error), None) or hook_error
            decision = self.closing.reduce(update, ledger, error=error, reduced=True, vote_comm=self.engine.comm)
            return update, decision, scale
        scale = self.loss.current()
        self.strategy.prepare(params)
        buckets = [Bucket(params, list(range(len(params))), count, scale, averaged=self.averaged)]
        # A frozen parameter (requires_grad off) is not stepped, even where it still has a gradient.
        everything = len(params) == len({id(p) for g in self.optimizer.param_groups for p in g["params"]})
        self.strategy.local(buckets[0], side=False, everything=everything)
        # sum/mean: the window's agreement rides on the reduction's own (one small collective, not two).
        # Not where an overlap engine is open: its lane makes the agreement of the boundaries it reduces,
        # and this one must meet it there (a rank that forced this boundary, say).
        update = BucketUpdate(self.strategy, buckets, params, lambda: self._abandon(buckets),
                              companion=not lane_open)
        decision = self.closing.reduce(update, ledger, error=buckets[0].error or hook_error, comm=self.comm,
                                     vote_comm=self.engine.comm if lane_open else self.comm)
        return update, decision, scale

    def _abandon(self, buckets: list[Bucket]) -> None:
        if self.engine is not None:
            self.engine.replan()  # every rank alike: the next closing backward is observed again
        self.strategy.abandon(buckets)
        self.window.close()
        self.reset()
