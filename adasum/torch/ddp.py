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
import weakref

import torch
from mpi4py import MPI

from ..call.allreduce import Op
from ..runtime.context import check_comm, context_for, library_comm
from .amp import LossScale
from .boundary import failures
from .compress import Wire
from .overlap import GIVE_UP_WAIT, CommThread
from .strategy import AdasumDeltas, Bucket, trained_params
from .tensors import StartCopy

__all__ = ["AdasumState", "adasum_hook", "DeltaState", "adasum_delta_hook"]


class _CommState:
    """A duplicate of ``comm`` for the hook's reductions and the thread that runs them (:class:`_Link`),
    both ended with the state (or by :meth:`close`). Pickles (and copies) without them, making no collective
    call (as torch's hook states drop their process group): a state unpickled or copied reduces over the
    library's duplicate of its process's ``MPI.COMM_WORLD``, looked up at the first reduction, which every
    rank makes in its first hook call (the library makes that duplicate, where it does not exist yet,
    collectively and watched by the stall inspector)."""

    def __init__(self, comm: MPI.Intracomm | None, overlap: bool = True):
        comm = check_comm(comm)
        self.overlap = bool(overlap)
        self._comm = comm.Dup()
        library_comm(self._comm)
        self._start(owned=True)

    def _start(self, owned: bool) -> None:
        self._link = _Link(self._comm, owned)
        weakref.finalize(self, self._link.drop)

    @property
    def comm(self) -> MPI.Intracomm:
        if self._comm is None:
            self._comm = self._link.comm = library_comm(MPI.COMM_WORLD)
        return self._comm

    @property
    def closed(self) -> bool:
        return self._link.closed

    def close(self) -> None:
        """End the communication thread, once it has run the buckets already given to it, and free the
        communicator; the hook raises afterwards. Call it on every rank after a ``backward()`` (DDP has
        waited for every bucket then); a state that is collected ends the same way without waiting for a
        collective."""
        self._link.close()

    def _submit(self, buffer: torch.Tensor, work) -> torch.futures.Future[torch.Tensor]:
        """``work()`` reduces a bucket: run it on the communication thread and return a future of ``buffer``
        that it completes (with the error ``work`` raised, if it did); or run it here, where the state does
        not overlap, and return a completed future."""
        link = self._link
        if link.closed:
            raise RuntimeError(f"rank {link.rank}: this {type(self).__name__} was closed; "
                               "register a new state on a new model")
        if link.threaded is None:
            comm = self.comm  # found here, on every rank, in the first hook call
            link.threaded = (self.overlap and comm.Get_size() > 1
                             and MPI.Query_thread() == MPI.THREAD_MULTIPLE)
            if link.threaded:
                link.begin()
        if not link.threaded:
            work()
            return _done(buffer)
        fut = _future(buffer)
        error: list = []
        link.pending[id(fut)] = fut
        link.thread.submit(_job(link, fut, buffer, work, error))
        # DDP reads the future from C++: a callback that raises marks the future it returns as failed there
        # (a Python future's set_exception is a result that DDP would try to read as the bucket's tensor).
        return fut.then(_raising(error))

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_comm", None)
        state.pop("_link", None)
        return state

    def __setstate__(self, state) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("overlap", True)  # a state pickled before the hooks overlapped
        self._comm = None
        self._start(owned=False)


class _Link:
    """A hook state's communicator and communication thread, apart from the state, so that the thread and
    the finalizer hold nothing of it: the state is collected with its DDP model, and :meth:`drop` then ends
    the thread. ``pending``: the futures given to the thread and not completed yet."""

    def __init__(self, comm: MPI.Intracomm | None, owned: bool):
        self.comm = comm
        self.rank = MPI.COMM_WORLD.Get_rank() if comm is None else comm.Get_rank()
        self.owned = owned            # the state made the communicator (else: the library's, shared)
        self.threaded: bool | None = None  # decided in the first hook call
        self.thread: CommThread | None = None
        self.pending: dict[int, torch.futures.Future] = {}
        self.reducing = False  # the thread is inside a bucket's reduction (which may wait for other ranks)
        self.closed = False

    def begin(self) -> None:
        ctx = context_for(self.comm)
        ctx.beside_compute = True  # its waits nap under waiting="auto" (adasum.runtime.waiting)
        if self.owned:
            ctx.may_give_up = True  # drop() may give a wait there up (adasum.runtime.stall)
        self.thread = CommThread(f"adasum-ddp-hook-{self.comm.Get_rank()}")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.thread is not None:
            self.thread.close()
        self._ended()

    def drop(self) -> None:
        """The end of a state nobody closed: never waits for a collective (as
        :meth:`adasum.torch.overlap.OverlapEngine.drop`). The thread skips the buckets it has not begun
        (their futures fail); a bucket inside a collective is given up where the state owns the
        communicator (a wait there then raises within ``adasum.runtime.stall.GIVE_UP_EVERY``)."""
        if self.closed:
            return
        self.closed = True
        thread = self.thread
        if thread is None or MPI.Is_finalized():
            if thread is not None:
                thread.drop()
            self._ended()
            return
        reducing = self.reducing  # read before drop(): a bucket that begins after drop() is skipped
        if not thread.drop(self._ended):
            if not reducing:
                thread.join(5.0)  # it is completing a future or taking the next job: ends at once
                return
            if self.owned:
                ctx = context_for(self.comm)
                ctx.broken = ctx.broken or ("the DDP hook state that owned this communicator was dropped while "
                                            "its thread waited in a collective")
            thread.join(GIVE_UP_WAIT)

    def _ended(self) -> None:
        """Last, once no bucket runs: fail the futures never completed, free the communicator."""
        pending, self.pending = self.pending, {}
        for fut in pending.values():
            if not fut.done():  # its job never ran: the future's callback raises
                fut.set_exception(RuntimeError("the DDP hook state was closed or dropped before this bucket's "
                                               "reduction ran"))
        if self.owned and self.comm is not None:
            _free(self.comm)
        self.comm = None


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


def _job(link: _Link, fut: torch.futures.Future, buffer: torch.Tensor, work, error: list):
    def job() -> None:
        nonlocal work
        link.reducing = True
        try:
            work()
        except BaseException as e:  # noqa: BLE001 - through the future: backward() raises it
            error.append(e)
        finally:
            link.reducing = False
            work = None  # before the future completes: nothing on the thread holds the state afterwards
        link.pending.pop(id(fut), None)
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

    def __init__(self, optimizer, comm: MPI.Intracomm | None = None, *, compression: str | None = None,
                 start_copy: str = "device", accumulation_steps: int = 1, grad_scaler=None,
                 skip_nonfinite: bool = True, overlap: bool = True):
        if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) or accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be a positive integer, got {accumulation_steps!r}")
        _claim(optimizer, self)
        super().__init__(comm, overlap)
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


def _future(buffer: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    return torch.futures.Future(devices=[buffer.device] if buffer.is_cuda else None)


def _done(buffer: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    fut = _future(buffer)
    fut.set_result(buffer)
    return fut


def _free(comm: MPI.Intracomm) -> None:
    if not MPI.Is_finalized():
        comm.Free()
