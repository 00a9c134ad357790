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
"""

# No ``from __future__ import annotations`` here: DDP checks the hooks' return annotation as an object.
import weakref

import torch
from mpi4py import MPI

from ..call.allreduce import Op
from ..runtime.context import check_comm, library_comm
from .amp import LossScale
from .boundary import failures
from .compress import Wire
from .strategy import AdasumDeltas, Bucket, trained_params
from .tensors import StartCopy

__all__ = ["AdasumState", "adasum_hook", "DeltaState", "adasum_delta_hook"]


class _CommState:
    """A duplicate of ``comm`` for the hook's reductions, freed with the state. Pickles (and copies) without
    it, making no collective call (as torch's hook states drop their process group): a state unpickled or
    copied reduces over the library's duplicate of its process's ``MPI.COMM_WORLD``, looked up at the first
    reduction, which every rank makes in its first hook call (the library makes that duplicate, where it
    does not exist yet, collectively and watched by the stall inspector)."""

    def __init__(self, comm: MPI.Intracomm | None):
        comm = check_comm(comm)
        self._comm = comm.Dup()
        library_comm(self._comm)
        weakref.finalize(self, _free, self._comm)

    @property
    def comm(self) -> MPI.Intracomm:
        if self._comm is None:
            self._comm = library_comm(MPI.COMM_WORLD)
        return self._comm

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_comm", None)
        return state

    def __setstate__(self, state) -> None:
        self.__dict__.update(state)
        self._comm = None


class AdasumState(_CommState):
    """The state of :func:`adasum_hook`: the communicator, the op (``"adasum"``, ``"sum"`` or ``"mean"``)
    and the wire (``compression`` None, ``"fp16"`` or ``"bf16"``)."""

    def __init__(self, comm: MPI.Intracomm | None = None, op: str = "adasum", compression: str | None = None):
        try:
            self.op = Op(op).value
        except ValueError:
            raise ValueError(f"op must be one of 'adasum', 'sum', 'mean', got {op!r}") from None
        self.wire = Wire(compression)
        super().__init__(comm)


def adasum_hook(state: AdasumState, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the bucket's gradients reduced over MPI, per parameter, in place."""
    grads = bucket.gradients()
    if state.op == "adasum":
        state.wire.adasum_(grads, state.comm)
    else:
        state.wire.sum_(grads, state.comm, mean=state.op == "mean")
    return _done(bucket.buffer())


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
    """

    def __init__(self, optimizer, comm: MPI.Intracomm | None = None, *, compression: str | None = None,
                 start_copy: str = "device", accumulation_steps: int = 1, grad_scaler=None,
                 skip_nonfinite: bool = True):
        if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) or accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be a positive integer, got {accumulation_steps!r}")
        _claim(optimizer, self)
        super().__init__(comm)
        self.optimizer = optimizer
        self.accumulation_steps = accumulation_steps
        self.loss = LossScale(grad_scaler)
        self.strategy = AdasumDeltas(optimizer, StartCopy(start_copy), Wire(compression), False,
                                     bool(skip_nonfinite))
        self.buckets: list[Bucket] = []
        self.step_was_skipped = False
        self.skipped_updates = 0
        self.updates = 0
        self._index: dict[int, int] = {}
        self._in_hook = False
        handle = optimizer.register_step_pre_hook(_refuse_step(weakref.ref(self)))
        weakref.finalize(self, handle.remove)  # the optimizer steps freely again once the state is gone

    def __getstate__(self):
        raise TypeError("a DeltaState holds its optimizer; build it again in the new process")


def adasum_delta_hook(state: DeltaState, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the optimizer's step on the bucket's parameters, the deltas combined with
    Adasum over MPI; after the last bucket every parameter becomes start + combined delta (or keeps its
    start, on every rank, where a delta is not finite)."""
    hook_error = None
    if bucket.index() == 0:
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
    for p, g in zip(bucket.parameters(), bucket.gradients()):
        if id(p) in state._index:  # DDP's parameters that the optimizer does not train keep their gradient
            if p.grad is not None:  # none: unused in this backward (find_unused_parameters), so skipped
                p.grad = g  # the bucket's view: what DDP gives the parameter
            params.append(p)
    b = Bucket(params, [state._index[id(p)] for p in params], state.accumulation_steps, state.loss.current())
    state.strategy.reduce(b, state.comm, side=True)
    if hook_error and b.error is None:
        b.error = f"a step pre-hook of the optimizer raised {hook_error}"
    state.buckets.append(b)
    if bucket.is_last():
        _finish(state)
    return _done(bucket.buffer())


def _finish(state: DeltaState) -> None:
    buckets, state.buckets = state.buckets, []
    failed = failures(buckets, state.comm)
    if failed:
        state.strategy.abandon(buckets)
        raise RuntimeError(f"(raised on rank {state.comm.Get_rank()}) a local step failed inside the DDP hook; "
                           f"the parameters keep their values: {failed}")
    scale = state.loss.current()
    ok = state.strategy.update(buckets)
    state.loss.update(scale, ok)
    state.step_was_skipped = not ok
    state.skipped_updates += not ok
    state.updates += 1
    state.strategy.after_step()  # the update's step post-hooks, once the parameters hold its result


# id(optimizer) -> the DeltaState that steps it (weakly): one state per optimizer
_STATES: dict[int, weakref.ref] = {}


def _claim(optimizer, state: DeltaState) -> None:
    """Record ``state`` as ``optimizer``'s one DeltaState; raise if the optimizer already has one."""
    other = _STATES.get(id(optimizer))
    if other is not None and other() is not None:
        raise ValueError(f"this {type(optimizer).__name__} already has a DeltaState, which steps all its "
                         "parameters inside backward: one DeltaState per optimizer. Register that state on the "
                         "model (model.register_comm_hook(state, adasum_delta_hook)), or drop it (del state) "
                         "before making another")
    _STATES[id(optimizer)] = weakref.ref(state, lambda _, key=id(optimizer): _forget(key))


def _forget(key: int) -> None:
    other = _STATES.get(key)
    if other is not None and other() is None:
        del _STATES[key]


def _refuse_step(owner: weakref.ref):
    def pre_hook(optimizer, args, kwargs):
        state = owner()
        if state is not None and not state._in_hook:
            raise RuntimeError("this optimizer steps inside backward, in adasum_delta_hook (one step per "
                               "bucket); do not call optimizer.step() yourself")
    return pre_hook


def _done(buffer: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    fut = torch.futures.Future(devices=[buffer.device] if buffer.is_cuda else None)
    fut.set_result(buffer)
    return fut


def _free(comm: MPI.Intracomm) -> None:
    if not MPI.Is_finalized():
        comm.Free()
