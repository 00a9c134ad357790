"""The weight-delta form: :class:`DeltaState` and :func:`adasum_delta_hook`, the optimizer's step on each
bucket's shadows inside backward, the deltas combined over MPI, and the window's close after the last
bucket (:class:`~adasum.torch.window.close.WindowClose`)."""

# No ``from __future__ import annotations`` here: DDP checks the hooks' return annotation as an object.
import weakref

import torch
from mpi4py import MPI

from ...runtime.context import check_comm
from ..checks import check_agreement
from ..internals import step_hooks_of
from ..options import Options
from ..window.amp import LossScale
from ..window.close import Layout, WindowClose
from ..window.compress import Wire
from ..window.strategies import AdasumDeltas, Bucket, BucketUpdate
from ..window.tensors import StartCopy, trained_params
from .comm_state import CommState

__all__ = ["DeltaState", "adasum_delta_hook"]


# The settings of :class:`~adasum.torch.options.Options` that the delta hook's state takes.
_DELTA_SETTINGS = {"compression", "start_copy", "accumulation_steps", "skip_nonfinite", "overlap", "hierarchical"}


class DeltaState(CommState):
    """The state of :func:`adasum_delta_hook`: the optimizer whose step runs inside backward, per bucket,
    and what :class:`DistributedOptimizer` keeps for a boundary (the shadows, the wire, the loss scale).

    ``accumulation_steps``: backward passes per update (the ones before run under ``model.no_sync()``);
    the gradients are divided by it, as a mean over micro-batches. After each update, ``step_was_skipped``
    says whether it was skipped for non-finite values (on every rank alike) and ``skipped_updates`` counts
    them.

    One state per optimizer: the state steps all of the optimizer's parameters inside backward, so a second
    ``DeltaState`` of an optimizer that still has one raises ``ValueError`` (register the one state on the
    model, or drop it before making another).

    Each bucket's local step runs on shadows of its parameters (the parameters change only after the last
    bucket), so ``start_copy`` changes nothing here. The optimizer's step hooks run once per update, as
    around one ``optimizer.step()``: the pre-hooks before the first bucket's local step, the post-hooks once
    the parameters hold the update (an LR scheduler on the optimizer sees one step per update).

    ``overlap`` (default): all of that (the step hooks, each bucket's local step and reduction, the update)
    runs on the state's communication thread, bucket after bucket in DDP's order, while backward goes on;
    the update is done when ``backward()`` returns. The local steps read only their own bucket's
    gradients, which DDP hands over complete, and write only shadows; the parameters change after the last
    bucket's gradients were taken, as without overlap. ``overlap=False``: inside each hook call.
    """

    def __init__(self, optimizer, comm: MPI.Intracomm | None = None, *, grad_scaler=None,
                 options: Options | None = None, **settings):
        opts = Options.of(options or Options(overlap=True), settings, "DeltaState", allowed=_DELTA_SETTINGS)
        comm = check_comm(comm)
        opts.raise_problems(comm, "DeltaState")
        compression, start_copy, accumulation_steps, skip_nonfinite, overlap = (
            opts.compression, opts.start_copy, opts.accumulation_steps, opts.skip_nonfinite, opts.overlap)
        _check_unclaimed(optimizer)
        # every rank the same settings and parameters (a difference raises on every rank)
        check_agreement(comm, {k: getattr(opts, k) for k in sorted(_DELTA_SETTINGS)}, trained_params(optimizer),
                        who="DeltaState")
        super().__init__(comm, overlap)
        self.optimizer = optimizer
        self.accumulation_steps = accumulation_steps
        self.loss = LossScale(grad_scaler)
        self.strategy = AdasumDeltas(optimizer, StartCopy(start_copy), Wire(compression), opts.hierarchical,
                                     bool(skip_nonfinite))
        self.buckets: list[Bucket] = []
        self.closing = WindowClose(comm, Layout(optimizer), self.loss, name="DeltaState",
                                 skip_nonfinite=bool(skip_nonfinite),
                                 failed="a local step failed inside the DDP hook; the parameters keep their values")
        self._index: dict[int, int] = {}
        self._in_hook = False
        handle = optimizer.register_step_pre_hook(_StepGuard(weakref.ref(self)))
        # the optimizer steps freely again once the state is gone (or abandoned)
        self._unguard = weakref.finalize(self, handle.remove)

    step_was_skipped = property(lambda self: self.closing.step_was_skipped)
    skipped_updates = property(lambda self: self.closing.skipped)
    updates = property(lambda self: self.closing.combines, doc="Updates made so far (skipped ones included).")

    def abandon(self, why: str = "the hook state was abandoned") -> None:
        """As :meth:`AdasumState.abandon`; the optimizer is released too (another ``DeltaState`` may take it,
        and its own ``step()`` no longer raises)."""
        super().abandon(why)
        self._unguard()

    def __getstate__(self):
        raise TypeError("a DeltaState holds its optimizer; build it again in the new process")


def adasum_delta_hook(state: DeltaState, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the optimizer's step on the bucket's parameters, the deltas combined with
    Adasum over MPI; after the last bucket every parameter becomes start + combined delta (or keeps its
    start, on every rank, where a delta is not finite). It runs on the state's communication thread; the
    last bucket's future completes once the parameters hold the update."""
    first, last = bucket.index() == 0, bucket.is_last()
    pairs = list(zip(bucket.parameters(), bucket.gradients()))
    return state._submit(bucket.buffer(), lambda: _delta_bucket(state, first, last, pairs))


def _delta_bucket(state: DeltaState, first: bool, last: bool, pairs: list) -> None:
    """One bucket of :func:`adasum_delta_hook` (``pairs``: its parameters and DDP's gradients of them)."""
    hook_error = None
    if first:
        state.buckets = []
        everything = trained_params(state.optimizer)
        state._index = {id(p): i for i, p in enumerate(everything)}
        state.strategy.prepare(everything)
        state._in_hook = True  # the update's step pre-hooks, once, before its first local step
        try:
            hook_error = state.strategy.before_step()
        finally:
            state._in_hook = False
    params = []
    for p, g in pairs:
        if id(p) in state._index:  # DDP's parameters that the optimizer does not train keep their gradient
            if p.grad is not None:  # none: unused in this backward (find_unused_parameters), so skipped
                p.grad = g  # the bucket's view: what DDP gives the parameter
            params.append(p)
    b = Bucket(params, [state._index[id(p)] for p in params], state.accumulation_steps, state.loss.current())
    state.buckets.append(b)
    try:
        state.strategy.reduce(b, state.comm, side=True)
    except BaseException as e:  # noqa: BLE001 - the update is abandoned on every rank at the last bucket
        b.error = f"{type(e).__name__}: {e}"
        if last:
            _finish(state)
        raise
    if hook_error and b.error is None:
        b.error = f"a step pre-hook of the optimizer raised {hook_error}"
    if last:
        _finish(state)


def _finish(state: DeltaState) -> None:
    """After the last bucket: the window's procedure (agreement, apply, loss scale, counters), then the
    update's step post-hooks, once the parameters hold its result."""
    buckets, state.buckets = state.buckets, []
    error = next((b.error for b in buckets if b.error), None)
    update = BucketUpdate(state.strategy, buckets, [p for b in buckets for p in b.params],
                          lambda: state.strategy.abandon(buckets))
    scale = state.loss.current()
    decision = state.closing.reduce(update, {"update": state.closing.combines + 1}, error=error, reduced=True)
    state.closing.apply(update, decision, scale)
    state.strategy.after_step()


def _check_unclaimed(optimizer) -> None:
    """Raise if ``optimizer`` already has a live DeltaState (its :class:`_StepGuard` among the optimizer's
    step pre-hooks): one state per optimizer. The optimizer holds the guard, so nothing outlives it."""
    for hook in step_hooks_of(optimizer, "pre"):
        if isinstance(hook, _StepGuard) and hook.owner() is not None:
            raise ValueError(f"this {type(optimizer).__name__} already has a DeltaState, which steps all its "
                             "parameters inside backward: one DeltaState per optimizer. Register that state on "
                             "the model (model.register_comm_hook(state, adasum_delta_hook)), or drop it (del "
                             "state) before making another")


class _StepGuard:
    """The step pre-hook a DeltaState puts on its optimizer: ``optimizer.step()`` called by the user raises
    (the state steps the optimizer inside backward). Holds the state weakly."""

    __slots__ = ("owner",)

    def __init__(self, owner: weakref.ref):
        self.owner = owner

    def __call__(self, optimizer, args, kwargs):
        state = self.owner()
        if state is not None and not state._in_hook:
            raise RuntimeError("this optimizer steps inside backward, in adasum_delta_hook (one step per "
                               "bucket); do not call optimizer.step() yourself")
