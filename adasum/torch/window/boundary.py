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
from ...runtime.agreement import AdasumMismatchError, Companion, exchange_digest
from .agreement import Layout, agree, companion_extra, differences
from .agreement import log_skip as window_log
from .amp import LossScale
from .reduce import AdasumDeltas, Bucket, GradientReduce, trained_params
from .tensors import average_, grads_of

__all__ = ["Boundary", "log_skip"]


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
    layout: Layout
    averaged: bool = False  # the closing window's gradients are averaged already
    reduced: tuple[list[Bucket], float] | None = None  # ... and reduced (sum/mean): buckets, scale

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
        """Close the window of ``count`` micro-batches: reduce, agree, apply. Returns False where the update
        was skipped for non-finite values (on every rank alike)."""
        try:
            buckets, scale = self.reduced or self._reduce_and_agree(count, ledger)
            ok = self.strategy.update(buckets)
            self.loss.update(scale, ok)
        finally:
            self.window.close()
            self.reset()
        if self.engine is not None and not self.engine.closed:
            self.engine.after_boundary()
        self.strategy.after_step()
        return ok

    def _reduce_and_agree(self, count: int, ledger: dict[str, int]) -> tuple[list[Bucket], float]:
        """The window's buckets, reduced, once every rank agreed (:func:`~adasum.torch.window.agreement.agree`) that
        none failed and that the windows match: before the wire where the boundary runs here, after it
        where the buckets were reduced during backward (overlap)."""
        done = self.engine.finish() if self.engine is not None and not self.engine.closed else None
        # The wrapped optimizer's step pre-hooks, at the start of the boundary's work in step(): before the
        # local step, or after the threads finished the local steps they took during backward (overlap).
        # One that raises fails the boundary on every rank.
        hook_error = self.strategy.before_step()
        hook_error = hook_error and f"a step pre-hook of the wrapped optimizer raised {hook_error}"
        if done is not None:
            (buckets, scale, refused), comm = done, self.engine.comm
            if refused is not None:  # the lane's agreement failed on every rank: no bucket was reduced
                self._abandon(buckets)
                raise RuntimeError(f"(raised on rank {self.comm.Get_rank()}) the ranks' windows differ at this "
                                   f"boundary; the parameters keep the window's start: {refused}")
            self._decide(buckets, ledger, next((b.error for b in buckets if b.error), None) or hook_error)
        else:
            params = trained_params(self.optimizer)
            scale, comm = self.loss.current(), self.comm
            self.strategy.prepare(params)
            buckets = [Bucket(params, list(range(len(params))), count, scale, averaged=self.averaged)]
            # A frozen parameter (requires_grad off) is not stepped, even where it still has a gradient.
            everything = len(params) == len({id(p) for g in self.optimizer.param_groups for p in g["params"]})
            self.strategy.local(buckets[0], side=False, everything=everything)
            error = buckets[0].error or hook_error
            # sum/mean: the window's agreement rides on the reduction's own (one small collective, not two).
            # Not where an overlap engine is open: its lane makes the agreement of the boundaries it reduces,
            # and this one must meet it there (a rank that forced this boundary, say).
            lane_open = self.engine is not None and not self.engine.closed
            companion = self._companion(ledger, error) \
                if not lane_open and self.strategy.carries_companion(buckets[0], comm) else None
            if companion is None:
                self._decide(buckets, ledger, error)
            try:
                self.strategy.combine(buckets[0], comm, **({} if companion is None else {"companion": companion}))
            except AdasumMismatchError as e:
                self._abandon(buckets)
                if companion is None:
                    raise
                raise self._refused(ledger, e) from None
            except BaseException as e:
                self._abandon(buckets)
                if companion is not None and error is not None and isinstance(e, RuntimeError):
                    raise RuntimeError(f"(raised on rank {self.comm.Get_rank()}) a local step or reduction failed "
                                       f"at this boundary; the parameters keep the window's start: {e}") from None
                raise
        self.strategy.settle(buckets)
        return buckets, scale

    def _decide(self, buckets: list[Bucket], ledger: dict[str, int], error: str | None) -> None:
        """Raise on every rank if a bucket failed on any, or the ranks' windows differ, with the parameters
        left at the window's start."""
        overlap = self.engine is not None and not self.engine.closed
        comm = self.engine.comm if overlap else self.comm  # where the lane's agreement runs, if any
        decision = agree(comm, ledger, self.layout, trained_params(self.optimizer), error)
        if decision.failed:
            self._abandon(buckets)
            raise RuntimeError(f"(raised on rank {self.comm.Get_rank()}) a local step or reduction failed at "
                               "this boundary; the parameters keep the window's start: " + decision.failed)

    def _companion(self, ledger: dict[str, int], error: str | None) -> Companion:
        """The window's agreement (:func:`~adasum.torch.window.agreement.agree`'s ledger, parameters and
        error) as the companion of the reduction's agreement."""
        extra = companion_extra(ledger, self.layout, trained_params(self.optimizer))
        return Companion(exchange_digest("the window's agreement", extra), extra, error)

    def _refused(self, ledger: dict[str, int], e: AdasumMismatchError) -> RuntimeError:
        """Every rank's error where the reduction that carried the window's agreement found the ranks apart;
        collective where the settings differ (every rank then gathers what differs in the windows)."""
        text = str(e)
        if "disagree on the settings" in text:
            found = differences(self.comm, ledger, self.layout.of(trained_params(self.optimizer))[0])
            text = found or text
        return RuntimeError(f"(raised on rank {self.comm.Get_rank()}) a local step or reduction failed at this "
                            f"boundary; the parameters keep the window's start: {text}")

    def _abandon(self, buckets: list[Bucket]) -> None:
        if self.engine is not None:
            self.engine.replan()  # every rank alike: the next closing backward is observed again
        self.strategy.abandon(buckets)
        self.window.close()
        self.reset()


def log_skip(comm: MPI.Intracomm, strategy, number: int, skipped: int) -> None:
    """Rank 0 logs, on the ``adasum`` logger, that update ``number`` was skipped on every rank."""
    what = "weight deltas" if isinstance(strategy, AdasumDeltas) else "gradients"
    window_log(comm, "adasum: update %d skipped on every rank: the %s %s hold a NaN or Inf; parameters left "
               "unchanged (%d skipped so far)", number, "reduced" if comm.Get_size() > 1 else "local", what,
               skipped)
