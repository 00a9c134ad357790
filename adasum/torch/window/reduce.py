"""The reduce strategies of :class:`~adasum.torch.DistributedOptimizer`: what a boundary does with a
bucket of parameters, as a plain object that holds no reference to the optimizer proxy.

A boundary is one or more :class:`Bucket` s. :meth:`reduce` runs once per bucket, on the main thread inside
``step()``, with the communicator to reduce on: :meth:`local` (this rank's part: averaging, the local step,
the deltas) then :meth:`combine` (the wire). With overlap the two run on two threads during backward
(``side=True``), so that one bucket's local part runs while the previous bucket's bytes are on the wire.
After every rank has agreed that no bucket failed, :meth:`settle` and :meth:`update` run on the main thread.

- :class:`AdasumDeltas` (``op="adasum"``): average the bucket's gradients, take the wrapped optimizer's
  step on the bucket's parameters only, take the deltas (new - start) and combine them with Adasum, one
  layer per parameter; ``update`` sets every parameter to start + combined delta. With ``side=True`` the
  step runs on shadows of the parameters (kept copies, which then hold the deltas), so that the parameters
  are not written before ``update``. The optimizer's step hooks run once per update, around all buckets
  (:meth:`AdasumDeltas.before_step`, :meth:`AdasumDeltas.after_step`), not around each local step.
- :class:`GradientReduce` (``"sum"``/``"mean"``): average and reduce the bucket's gradients; ``update`` takes
  the wrapped optimizer's step.

``reduce`` is the unit a DDP communication hook can reuse: it needs only the bucket's parameters, their
positions in the optimizer's parameter list, and a communicator.
"""

from __future__ import annotations

import traceback
from collections import OrderedDict
from collections.abc import MutableMapping
from typing import Callable

import torch
from mpi4py import MPI

from .compress import Wire
from .tensors import StartCopy, all_finite, average_, grads_of, mark_nonfinite
from ..internals import (STEP_HOOK_DICTS, foreach_add_, foreach_copy_, foreach_sub_, record_scheduled_step,
                         step_hooks_of, unhooked_step)

__all__ = ["Bucket", "AdasumDeltas", "GradientReduce", "ShadowState", "all_params", "step_hooks", "step_on",
           "trained_params"]


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


class AdasumDeltas:
    """Adasum of the weight deltas of each rank's own local step (the module docstring)."""

    op = "adasum"

    def __init__(self, optimizer, start: StartCopy, wire: Wire, hierarchical: bool, skip_nonfinite: bool):
        self.optimizer = optimizer
        self.start = start
        self.wire = wire
        self.hierarchical = hierarchical
        self.skip_nonfinite = skip_nonfinite

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
                step_on(self.optimizer, params, everything, shadows)
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

    def combine(self, bucket: Bucket, comm: MPI.Intracomm) -> None:
        """Adasum of the bucket's deltas over ``comm``, in place. Where :meth:`local` failed before it formed
        them, the bucket takes part with NaN deltas (every rank then skips the update)."""
        params = bucket.params
        with torch.no_grad():
            if len(bucket.result) != len(params):
                bucket.result = [torch.zeros_like(p) for p in params]
                mark_nonfinite(bucket.result)
            bucket.amax = self.wire.adasum_(bucket.result, comm, self.hierarchical,
                                            bucket.names() if self.wire.dtype else None)

    def carries_companion(self, bucket: Bucket, comm: MPI.Intracomm) -> bool:
        """No: the window's agreement comes first, the deltas' votes with it."""
        return False

    def settle(self, buckets: list[Bucket]) -> None:
        """Nothing to hand over before the update: the deltas stay apart from the gradients."""

    def update(self, buckets: list[Bucket]) -> bool:
        """Start + combined delta for every parameter, or the start where any delta is not finite (then
        False, on every rank alike)."""
        with torch.no_grad():
            ok = not self.skip_nonfinite or all_finite([d for b in buckets for d in b.result])
            for b in buckets:
                targets = [p.detach() for p in b.params]
                if b.side:
                    if ok and targets:
                        foreach_add_(targets, b.result)
                else:
                    self.start.apply(targets, b.index, "add" if ok else "copy")
                if not ok:
                    self.wire.explain(b.result, b.amax, b.names())
        return ok

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

    def __init__(self, optimizer, op: str, wire: Wire, skip_nonfinite: bool):
        self.optimizer = optimizer
        self.op = op
        self.wire = wire
        self.skip_nonfinite = skip_nonfinite

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
        with torch.no_grad():
            if not bucket.averaged:
                average_(grads_of(bucket.params), bucket.count, bucket.scale)
            bucket.averaged = True

    def combine(self, bucket: Bucket, comm: MPI.Intracomm, companion=None) -> None:
        """Reduce the averaged gradients over ``comm`` in one call. A parameter without a gradient takes part
        with zeros; it gets the reduced gradient if some rank had one, else it stays without (so the wrapped
        optimizer skips it on every rank alike). One extra layer carries which ranks had gradients.
        ``companion``: the window's agreement, carried by the call's (:meth:`carries_companion`)."""
        params = bucket.params
        with torch.no_grad():
            if not params or comm.Get_size() == 1:
                return
            ref = params[0]
            have = torch.tensor([p.grad is not None for p in params], dtype=ref.dtype, device=ref.device)
            tensors, missing = [], []
            for i, p in enumerate(params):
                if p.grad is None:
                    missing.append(i)
                    tensors.append(torch.zeros_like(p, memory_format=torch.contiguous_format))
                else:
                    tensors.append(p.grad)
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

    def update(self, buckets: list[Bucket]) -> bool:
        """The wrapped optimizer's step, unless a reduced gradient is not finite (then False everywhere)."""
        grads = [g for b in buckets for g in grads_of(b.params)]
        if self.skip_nonfinite and not all_finite(grads):
            for b in buckets:
                self.wire.explain([torch.zeros(0) if p.grad is None else p.grad for p in b.params], b.amax,
                                  b.names())
            return False
        self.optimizer.step()
        return True

    def before_step(self) -> str | None:
        """Nothing: ``update`` calls ``optimizer.step()``, which runs the step hooks itself."""
        return None

    def after_step(self) -> None:
        """Nothing (see :meth:`before_step`)."""

    def abandon(self, buckets: list[Bucket]) -> None:
        """Nothing to undo: the parameters have not changed."""


def all_params(optimizer) -> list[torch.Tensor]:
    """Every parameter of ``optimizer``, trained or frozen, each once, in the order of its param groups."""
    return list({id(p): p for group in optimizer.param_groups for p in group["params"]}.values())


def trained_params(optimizer) -> list[torch.Tensor]:
    """The parameters of ``optimizer`` that train, each once, in the order of its param groups (the same on
    every rank)."""
    seen: set[int] = set()
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def step_on(optimizer, params: list[torch.Tensor], everything: bool = False,
            shadows: list[torch.Tensor] | None = None) -> None:
    """The wrapped optimizer's own step on ``params`` only (``everything``: on all its parameters).

    The step is the function of the optimizer's class, without the step hooks that ``optimizer.step()``
    runs around it and without an instance-level replacement of ``step`` (an LR scheduler's, say): those
    belong to the whole update (:func:`step_hooks`). On a bucket it runs on a shallow view of the optimizer
    whose param groups hold only the bucket's tensors and share everything else (the hyperparameters,
    ``state``): the user's ``param_groups`` are never changed, and group entries the step writes are written
    back to them. With ``shadows`` (one per parameter, same dtype, device and shape) the view steps the
    shadows instead, each with its parameter's gradient and its parameter's state (:class:`ShadowState`),
    and the parameters keep their values.
    """
    step = _own_step(optimizer)
    if everything and shadows is None:
        step(optimizer)
        return
    stepped = params if shadows is None else shadows
    where = {id(p): i for i, p in enumerate(params)}
    view = object.__new__(type(optimizer))
    view.__dict__.update(optimizer.__dict__)
    view.__dict__.pop("step", None)
    for hooks in STEP_HOOK_DICTS:
        if hooks in view.__dict__:
            view.__dict__[hooks] = OrderedDict()
    pairs = []
    for g in optimizer.param_groups:
        sub = [stepped[where[id(p)]] for p in g["params"] if id(p) in where]
        if sub:
            pairs.append((g, dict(g, params=sub)))
    view.param_groups = [v for _, v in pairs]
    if shadows is not None:
        view.state = ShadowState(optimizer.state, params, shadows)
        for s, p in zip(shadows, params):
            s.grad = p.grad
    try:
        step(view)
    finally:
        if shadows is not None:
            for s in shadows:
                s.grad = None
    for g, v in pairs:
        for key, value in v.items():
            if key != "params" and g.get(key) is not value:
                g[key] = value


class ShadowState(MutableMapping):
    """The wrapped optimizer's ``state`` as a step on shadows sees it: a shadow's entry is its parameter's
    own (made in the optimizer's ``state`` where new), so the step updates the user's optimizer state as a
    step on the parameters would."""

    def __init__(self, state, params: list[torch.Tensor], shadows: list[torch.Tensor]):
        self._state = state
        self._param = {id(s): p for s, p in zip(shadows, params)}

    def _key(self, key):
        return self._param.get(id(key), key)

    def __getitem__(self, key):
        return self._state[self._key(key)]

    def __setitem__(self, key, value) -> None:
        self._state[self._key(key)] = value

    def __delitem__(self, key) -> None:
        del self._state[self._key(key)]

    def __contains__(self, key) -> bool:
        return self._key(key) in self._state

    def __iter__(self):
        return iter(self._state)

    def __len__(self) -> int:
        return len(self._state)

    def get(self, key, default=None):
        return self._state.get(self._key(key), default)

    def setdefault(self, key, default=None):
        return self._state.setdefault(self._key(key), default)


def _own_step(optimizer) -> Callable:
    """The step function of ``optimizer``'s class, unwrapped from torch's hook runner."""
    fn = unhooked_step(type(optimizer))
    if fn is None:  # a step set on the instance only: nothing else to call
        return lambda opt: optimizer.step()
    return fn


def step_hooks(optimizer, which: str) -> None:
    """The step hooks of ``optimizer``, once (``"pre"`` or ``"post"``, in ``optimizer.step()``'s order), each
    with ``(optimizer, (optimizer,), {})`` as ``optimizer.step()`` calls them (what a pre-hook returns is not
    used: no arguments reach the step). ``"pre"`` also records the step where an LR scheduler replaced
    ``optimizer.step`` to watch for it, so the scheduler knows the optimizer stepped."""
    if which == "pre":
        record_scheduled_step(optimizer)
    for hook in step_hooks_of(optimizer, which):
        hook(optimizer, (optimizer,), {})


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
