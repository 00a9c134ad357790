"""Adasum inside torch's ``DistributedDataParallel``, as a communication hook: an explicit state object and
a plain function, as torch's own hooks are. A model takes one hook (DDP's ``register_comm_hook`` can be
called once): one of the two below. ``examples/ddp_hook.py`` and ``examples/ddp_delta_hook.py`` are complete
scripts.

Gradients (any optimizer; Adasum of the gradients, or their sum or mean)::

    adasum.torch.init_process_group()                     # under mpiexec: torch.distributed from MPI
    model = torch.nn.parallel.DistributedDataParallel(model)
    model.register_comm_hook(AdasumState(), adasum_hook)

Weight deltas (Adasum of what each rank's optimizer *would do*, as :class:`DistributedOptimizer` does)::

    state = DeltaState(optimizer)
    model.register_comm_hook(state, adasum_delta_hook)
    ...
    loss.backward()          # the optimizer's step runs inside, bucket by bucket, on shadows of the
    optimizer.zero_grad()    # parameters; they change once, after the last bucket. Do not call
                             # optimizer.step(). Its step hooks run once per update.

The hooks reduce over MPI (on a duplicate of ``comm``), one layer per parameter, not over DDP's process
group: the collective's agreement makes a mismatch between ranks an error on every rank, and its stall
inspector names a rank that does not arrive.

Each hook returns at once a future that a communication thread of the state completes once the bucket is
reduced, so DDP goes on with backward meanwhile, as with its own allreduce hook; DDP waits for the futures
at the end of backward. The thread (one per state, started by the first hook call) takes the buckets in the
order DDP hands them over, the same on every rank, and its waits nap (the setting ``waiting``, see
:mod:`adasum.runtime.waiting`), leaving the core to backward. An error there (a mismatch, a stall, a failed
local step) completes the bucket's future with it, and ``backward()`` raises it, on every rank. The thread
ends with ``state.close()`` or when the state is collected (the DDP model that holds it deleted), without
waiting for a collective. ``overlap=False`` reduces inside the hook instead (the same results, bit for bit);
so do a single process and an MPI without ``MPI_THREAD_MULTIPLE``.
"""

# No ``from __future__ import annotations`` here: DDP checks the hooks' return annotation as an object.
import functools
import weakref

import torch
from mpi4py import MPI

from ..call.allreduce import Op
from ..runtime.context import check_comm
from ..runtime.lane import Lane
from .checks import check_agreement
from .internals import step_hooks_of
from .options import Options
from .window.close import Layout, WindowClose
from .window.amp import LossScale
from .window.compress import Wire
from .window.strategies import AdasumDeltas, Bucket, BucketUpdate
from .window.tensors import trained_params
from .window.tensors import StartCopy

__all__ = ["AdasumState", "adasum_hook", "DeltaState", "adasum_delta_hook"]


class _CommState:
    """A hook state's lane (:class:`~adasum.runtime.lane.Lane`: a duplicate of ``comm`` and the thread that
    reduces the buckets), ended with the state (or by :meth:`close`). Pickles (and copies) without it,
    making no collective call (as torch's hook states drop their process group): a state unpickled or
    copied reduces over the library's duplicate of the current world (``MPI.COMM_WORLD``, or the survivors'
    communicator after an elastic shrink: :func:`adasum.runtime.faults.world`), looked up at the first
    reduction, which every rank makes in its first hook call (the library makes that duplicate, where it
    does not exist yet, collectively and watched by the stall inspector)."""

    def __init__(self, comm: MPI.Intracomm | None, overlap: bool = True):
        comm = check_comm(comm)
        self.overlap = bool(overlap)
        self._start(comm, owned=True)

    def _start(self, comm: MPI.Intracomm | None, owned: bool) -> None:
        # the futures given to the lane and not completed yet: failed if the lane ends before their job ran
        self._pending: dict[int, torch.futures.Future] = {}
        self._lane = Lane(comm, "adasum-ddp-hook", owned=owned, threaded=None if self.overlap else False,
                          on_end=functools.partial(_fail_pending, self._pending))
        weakref.finalize(self, self._lane.drop, "the DDP hook state that owned this communicator was dropped")

    @property
    def comm(self) -> MPI.Intracomm:
        return self._lane.comm

    @property
    def closed(self) -> bool:
        return self._lane.closed

    def close(self) -> None:
        """End the communication thread, once it has run the buckets already given to it, and free the
        communicator; the hook raises afterwards. Call it on every rank after a ``backward()`` (DDP has
        waited for every bucket then); a state that is collected ends the same way without waiting for a
        collective."""
        self._lane.close()

    def abandon(self, why: str = "the hook state was abandoned") -> None:
        """End without a collective (the world changed under it: its communicator may be revoked, and the
        other ranks may never enter a collective there): the communication thread and the communicator are
        dropped, the hook raises afterwards saying ``why``. Local; :class:`adasum.torch.elastic.ElasticDDP`
        calls it before it makes a new state on the new world."""
        self._lane.drop(why)

    def _submit(self, buffer: torch.Tensor, work) -> torch.futures.Future[torch.Tensor]:
        """``work()`` reduces a bucket: run it on the lane and return a future of ``buffer`` that it completes
        (with the error ``work`` raised, if it did); or run it here, where the lane is not threaded, and
        return a completed future."""
        lane = self._lane
        if lane.closed:
            raise RuntimeError(f"rank {lane.rank}: this {type(self).__name__} was closed; "
                               "register a new state on a new model")
        if not lane.threaded:
            work()
            return _done(buffer)
        fut = _future(buffer)
        error: list = []
        self._pending[id(fut)] = fut
        lane.submit(_job(self._pending, fut, buffer, work, error), "a DDP bucket's reduction")
        # DDP reads the future from C++: a callback that raises marks the future it returns as failed there
        # (a Python future's set_exception is a result that DDP would try to read as the bucket's tensor).
        return fut.then(_raising(error))

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_lane", None)
        state.pop("_pending", None)
        return state

    def __setstate__(self, state) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("overlap", True)  # a state pickled before the hooks overlapped
        self.__dict__.pop("_comm", None)
        self._start(None, owned=False)


def _fail_pending(pending: dict) -> None:
    """Last, once no bucket runs: fail the futures whose job never ran."""
    futures = list(pending.values())
    pending.clear()
    for fut in futures:
        if not fut.done():  # its job never ran: the future's callback raises
            fut.set_exception(RuntimeError("the DDP hook state was closed or dropped before this bucket's "
                                           "reduction ran"))


def _raising(error: list):
    """The callback of a bucket's future: its tensor, or the error its reduction raised. The error is kept
    apart from the first future (in ``error``), so that nothing the error refers to (its traceback's
    frames) refers back to that future: a cycle through a future is never collected, and would keep the
    state, and its thread, alive."""
    def then(fut: torch.futures.Future) -> torch.Tensor:
        if error:
            raise error.pop()
        return fut.value()
    return then


def _job(pending: dict, fut: torch.futures.Future, buffer: torch.Tensor, work, error: list):
    def job() -> None:
        nonlocal work
        try:
            work()
        except BaseException as e:  # noqa: BLE001 - through the future: backward() raises it
            error.append(e)
        finally:
            work = None  # before the future completes: nothing on the thread holds the state afterwards
        pending.pop(id(fut), None)
        fut.set_result(buffer)
    return job


class AdasumState(_CommState):
    """The state of :func:`adasum_hook`: the communicator, the op (``"adasum"``, ``"sum"`` or ``"mean"``)
    and the wire (``compression`` None, ``"fp16"`` or ``"bf16"``). ``overlap``: reduce on the state's
    communication thread while backward goes on (default), or inside the hook (False)."""

    def __init__(self, comm: MPI.Intracomm | None = None, op: str = "adasum", compression: str | None = None,
                 overlap: bool = True):
        try:
            self.op = Op(op).value
        except ValueError:
            raise ValueError(f"op must be one of 'adasum', 'sum', 'mean', got {op!r}") from None
        self.wire = Wire(compression)
        super().__init__(comm, overlap)


def adasum_hook(state: AdasumState, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the bucket's gradients reduced over MPI, per parameter, in place, on the
    state's communication thread; the future completes once they are (with the error, where one was
    raised)."""
    grads = bucket.gradients()

    def work() -> None:
        if state.op == "adasum":
            state.wire.adasum_(grads, state.comm)
        else:
            state.wire.sum_(grads, state.comm, mean=state.op == "mean")
    return state._submit(bucket.buffer(), work)


# The settings of :class:`~adasum.torch.options.Options` that the delta hook's state takes.
_DELTA_SETTINGS = {"compression", "start_copy", "accumulation_steps", "skip_nonfinite", "overlap", "hierarchical"}


class DeltaState(_CommState):
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


def _future(buffer: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    return torch.futures.Future(devices=[buffer.device] if buffer.is_cuda else None)


def _done(buffer: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    fut = _future(buffer)
    fut.set_result(buffer)
    return fut
