"""The reduce strategies of :class:`~adasum.torch.DistributedOptimizer`: what a boundary does with a
bucket of parameters, as a plain object that holds no reference to the optimizer proxy.

A boundary is one or more :class:`Bucket` s. :meth:`reduce` runs once per bucket, on the main thread inside
``step()``, with the communicator to reduce on: :meth:`local` (this rank's part: averaging, the local step,
the deltas) then :meth:`combine` (the wire). With overlap the two run on two threads during backward
(``side=True``), so that one bucket's local part runs while the previous bucket's bytes are on the wire.
After every rank has agreed that no bucket failed, :meth:`settle` and :meth:`apply` run on the main thread,
driven by the window's procedure (:class:`adasum.torch.window.close.WindowClose`, through
:class:`BucketUpdate`).

- :class:`AdasumDeltas` (``op="adasum"``): average the bucket's gradients, take the wrapped optimizer's
  step on the bucket's parameters only, take the deltas (new - start) and combine them with Adasum, one
  layer per parameter; ``update`` sets every parameter to start + combined delta. With ``side=True`` the
  step runs on shadows of the parameters (kept copies, which then hold the deltas), so that the parameters
  are not written before ``apply``. The optimizer's step hooks run once per update, around all buckets
  (:meth:`AdasumDeltas.before_step`, :meth:`AdasumDeltas.after_step`), not around each local step.
- :class:`GradientReduce` (``"sum"``/``"mean"``): average and reduce the bucket's gradients; ``apply`` takes
  the wrapped optimizer's step.

``reduce`` is the unit a DDP communication hook can reuse: it needs only the bucket's parameters, their
positions in the optimizer's parameter list, and a communicator.
"""

from __future__ import annotations

import traceback
from typing import Callable

import torch
from mpi4py import MPI

from .compress import Wire
from .tensors import StartCopy, all_finite, average_, grads_of, mark_nonfinite
from .bucket_step import BucketSteps, step_hooks, whole_step
from ..internals import foreach_add_, foreach_copy_, foreach_sub_

__all__ = ["Bucket", "BucketUpdate", "AdasumDeltas", "GradientReduce"]


class Bucket:
    """Some of the optimizer's parameters at one boundary, and what reducing them produced."""

    __slots__ = ("params", "index", "count", "scale", "averaged", "side", "error", "result", "amax")

    def __init__(self, params: list[torch.Tensor], index: list[int], count: int, scale: float,
                 averaged: bool = False):
        self.params = params      # the parameters
        self.index = index        # their positions in the optimizer's list of trained parameters
        self.count = count        # micro-batches of the window
        self.scale = scale        # the loss scale the gradients carry
        self.averaged = averaged  # the gradients are averaged (and unscaled) already
        self.side = False         # reduced apart from the parameters (during backward)
        self.error: str | None = None  # what went wrong on this rank, with its traceback
        self.result: list = []    # adasum: the combined deltas; sum/mean: (parameter, gradient) to set
        self.amax = None          # the 16-bit wire's largest magnitudes (see Wire.explain)

    def names(self) -> list[str]:
        return [f"parameter {i} (shape {tuple(p.shape)})" for i, p in zip(self.index, self.params)]


class BucketUpdate:
    """A boundary's buckets as the window's procedure takes them (:class:`~adasum.torch.window.close.Update`):
    the strategy combines, applies and explains them; ``abandon`` is the owner's undo."""

    voted = False             # every rank holds the whole combined values
    skips_overflowed = False  # a rank's non-finite update reaches the others through the wire (NaN deltas)

    def __init__(self, strategy, buckets: list[Bucket], params: list[torch.Tensor], abandon: Callable[[], None],
                 companion: bool = False):
        self.strategy, self.buckets, self.params, self.abandon = strategy, buckets, params, abandon
        self._companion = companion  # the boundary allows the wire's agreement to carry the window's

    def carries_companion(self, comm: MPI.Intracomm) -> bool:
        return self._companion and self.strategy.carries_companion(self.buckets[0], comm)

    def combine(self, comm: MPI.Intracomm, companion) -> None:
        if companion is None:
            self.strategy.combine(self.buckets[0], comm)
        else:
            self.strategy.combine(self.buckets[0], comm, companion=companion)

    def settle(self) -> None:
        self.strategy.settle(self.buckets)

    def combined(self) -> list[torch.Tensor]:
        return self.strategy.combined(self.buckets)

    def apply(self, ok: bool) -> None:
        self.strategy.apply(self.buckets, ok)

    def explain(self) -> None:
        self.strategy.explain(self.buckets)


class AdasumDeltas:
    """Adasum of the weight deltas of each rank's own local step (the module docstring)."""

    op = "adasum"

    def __init__(self, optimizer, start: StartCopy, wire: Wire, hierarchical: bool, skip_nonfinite: bool):
        self.optimizer = optimizer
        self.start = start
        self.wire = wire
        self.hierarchical = hierarchical
        self.skip_nonfinite = skip_nonfinite
        self.steps = BucketSteps(optimizer)  # the optimizer's step on a bucket or on shadows

    def prepare(self, params: list[torch.Tensor]) -> None:
        """Before a boundary's buckets: the start buffers for every trained parameter."""
        self.start.ensure(params)

    def reduce(self, bucket: Bucket, comm: MPI.Intracomm, side: bool, everything: bool = False) -> None:
        """Local step on the bucket, Adasum of its deltas over ``comm``: :meth:`local`, then :meth:`combine`.
        A failure here still takes part in the reduction (with a NaN delta, so every rank skips the update),
        and is kept on the bucket. ``everything``: the bucket holds every parameter of the optimizer (one
        plain step)."""
        self.local(bucket, side, everything)
        self.combine(bucket, comm)

    def local(self, bucket: Bucket, side: bool, everything: bool = False) -> None:
        """This rank's part: average the gradients, take the local step, form the deltas; no communication.

        ``side``: the step runs on the bucket's shadows (kept copies of its parameters, with the parameters'
        averaged gradients and optimizer state), which then become the deltas (shadow - parameter); the
        parameters are never written. Otherwise the step runs in the parameters, from a start copy, and the
        deltas are formed in them (new - start), inside ``step()``."""
        params, index = bucket.params, bucket.index
        bucket.side = side
        local_ok = False
        shadows = None
        try:
            with torch.no_grad():
                if side:
                    shadows = self.start.side(index, params)
                    if shadows:
                        foreach_copy_(shadows, [p.detach() for p in params])
                else:
                    self.start.keep(index, params)
                grads = grads_of(params)
                if not bucket.averaged:
                    average_(grads, bucket.count, bucket.scale)
                local_ok = not self.skip_nonfinite or all_finite(grads)
            # A rank whose gradients are not finite skips its own step, so its optimizer state stays finite.
            if local_ok and grads:
                if everything and shadows is None:
                    whole_step(self.optimizer)
                else:
                    self.steps.step(params, shadows)
        except BaseException as e:  # noqa: BLE001 - kept, raised on every rank after the agreement
            bucket.error, local_ok = _describe(e), False
        with torch.no_grad():
            if side:
                if shadows is None:  # failed before the shadows existed: combine() takes part with NaNs
                    return
                deltas = shadows
                if deltas:
                    foreach_sub_(deltas, [p.detach() for p in params])
            else:
                deltas = [p.detach() for p in params]
                self.start.apply(deltas, index, "sub")
            if not local_ok:
                mark_nonfinite(deltas)
        bucket.result = deltas

    def combine(self, bucket: Bucket, comm: MPI.Intracomm, companion=None) -> None:
        """Adasum of the bucket's deltas over ``comm``, in place. Where :meth:`local` failed before it formed
        them, the bucket takes part with NaN deltas (every rank then skips the update). ``companion``: the
        window's agreement, carried by the call's (:meth:`carries_companion`)."""
        params = bucket.params
        with torch.no_grad():
            if len(bucket.result) != len(params):
                bucket.result = [torch.zeros_like(p) for p in params]
                mark_nonfinite(bucket.result)
            bucket.amax = self.wire.adasum_(bucket.result, comm, self.hierarchical,
                                            bucket.names() if self.wire.dtype else None, companion=companion)

    def carries_companion(self, bucket: Bucket, comm: MPI.Intracomm) -> bool:
        """Whether :meth:`combine` of ``bucket`` starts with one agreement that can carry the window's (not
        in hierarchical mode, whose agreements run on the node groups)."""
        return bool(bucket.params) and comm.Get_size() > 1 and self.wire.carries_companion \
            and not self.hierarchical

    def settle(self, buckets: list[Bucket]) -> None:
        """Nothing to hand over before the update: the deltas stay apart from the gradients."""

    def combined(self, buckets: list[Bucket]) -> list[torch.Tensor]:
        """The combined deltas, which must all be finite for the update."""
        return [d for b in buckets for d in b.result]

    def apply(self, buckets: list[Bucket], ok: bool) -> None:
        """Start + combined delta for every parameter (``ok``), or the start."""
        with torch.no_grad():
            for b in buckets:
                targets = [p.detach() for p in b.params]
                if b.side:
                    if ok and targets:
                        foreach_add_(targets, b.result)
                else:
                    self.start.apply(targets, b.index, "add" if ok else "copy")

    def explain(self, buckets: list[Bucket]) -> None:
        for b in buckets:
            self.wire.explain(b.result, b.amax, b.names())

    def before_step(self) -> str | None:
        """Once per update, before its first local step (with overlap: in ``step()``, once the threads took
        the local steps): the wrapped optimizer's step pre-hooks, as ``optimizer.step()`` runs them. Returns the error of a hook
        that raised (described), for the boundary's vote."""
        try:
            step_hooks(self.optimizer, "pre")
        except BaseException as e:  # noqa: BLE001 - raised on every rank after the agreement
            return _describe(e)
        return None

    def after_step(self) -> None:
        """Once per update, after the parameters hold its result: the wrapped optimizer's step post-hooks."""
        step_hooks(self.optimizer, "post")

    def abandon(self, buckets: list[Bucket]) -> None:
        """A boundary that failed on some rank: every parameter back to its start."""
        with torch.no_grad():
            for b in buckets:
                if not b.side:
                    self.start.apply([p.detach() for p in b.params], b.index, "copy")


class GradientReduce:
    """Sum or mean of the gradients, then the wrapped optimizer's step (the module docstring)."""

    def __init__(self, optimizer, op: str, wire: Wire):
        self.optimizer = optimizer
        self.op = op
        self.wire = wire

    def prepare(self, params: list[torch.Tensor]) -> None:
        """Nothing is kept between the buckets of a boundary."""

    def reduce(self, bucket: Bucket, comm: MPI.Intracomm, side: bool, everything: bool = False) -> None:
        """Average the bucket's gradients and reduce them over ``comm`` in one call (:meth:`local`, then
        :meth:`combine`)."""
        self.local(bucket, side, everything)
        self.combine(bucket, comm)

    def local(self, bucket: Bucket, side: bool, everything: bool = False) -> None:
        """Average the bucket's gradients (and unscale them)."""
        bucket.side = side
        if not bucket.averaged and bucket.count * bucket.scale != 1.0:
            with torch.no_grad():
                average_(grads_of(bucket.params), bucket.count, bucket.scale)
        bucket.averaged = True

    def combine(self, bucket: Bucket, comm: MPI.Intracomm, companion=None) -> None:
        """Reduce the averaged gradients over ``comm`` in one call. A parameter without a gradient takes part
        with zeros; it gets the reduced gradient if some rank had one, else it stays without (so the wrapped
        optimizer skips it on every rank alike). One extra layer carries which ranks had gradients.
        ``companion``: the window's agreement, carried by the call's (:meth:`carries_companion`)."""
        params = bucket.params
        if not params or comm.Get_size() == 1:
            return
        if self.wire.dtype is None:  # the library's call writes the gradients' memory: nothing autograd sees
            self._combine(bucket, comm, companion)
        else:
            with torch.no_grad():
                self._combine(bucket, comm, companion)

    def _combine(self, bucket: Bucket, comm: MPI.Intracomm, companion) -> None:
        params = bucket.params
        ref = params[0]
        tensors, missing = [], []
        for i, p in enumerate(params):
            if p.grad is None:
                missing.append(i)
                tensors.append(torch.zeros_like(p, memory_format=torch.contiguous_format))
            else:
                tensors.append(p.grad)
        if missing:
            have = torch.tensor([p.grad is not None for p in params], dtype=ref.dtype, device=ref.device)
        else:
            have = torch.ones(len(params), dtype=ref.dtype, device=ref.device)
        bucket.amax = self.wire.sum_(tensors + [have], comm, self.op == "mean",
                                     bucket.names() if self.wire.dtype else None, companion=companion)
        if missing:
            somewhere = (have > 0).tolist()
            bucket.result = [(params[i], tensors[i]) for i in missing if somewhere[i]]

    def carries_companion(self, bucket: Bucket, comm: MPI.Intracomm) -> bool:
        """Whether :meth:`combine` of ``bucket`` starts with one agreement that can carry the window's."""
        return bool(bucket.params) and comm.Get_size() > 1 and self.wire.carries_companion

    def settle(self, buckets: list[Bucket]) -> None:
        """Give the parameters that had no gradient here the reduced one (main thread)."""
        for b in buckets:
            for p, g in b.result:
                p.grad = g
            b.result = []

    def combined(self, buckets: list[Bucket]) -> list[torch.Tensor]:
        """The reduced gradients, which must all be finite for the step."""
        return [g for b in buckets for g in grads_of(b.params)]

    def apply(self, buckets: list[Bucket], ok: bool) -> None:
        """The wrapped optimizer's step (``ok``); otherwise the parameters stay as they are."""
        if ok:
            self.optimizer.step()

    def explain(self, buckets: list[Bucket]) -> None:
        for b in buckets:
            self.wire.explain([torch.zeros(0) if p.grad is None else p.grad for p in b.params], b.amax, b.names())

    def before_step(self) -> str | None:
        """Nothing: ``update`` calls ``optimizer.step()``, which runs the step hooks itself."""
        return None

    def after_step(self) -> None:
        """Nothing (see :meth:`before_step`)."""

    def abandon(self, buckets: list[Bucket]) -> None:
        """Nothing to undo: the parameters have not changed."""


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
