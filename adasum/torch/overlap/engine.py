"""Overlap with backward: :class:`OverlapEngine` owns the hooks, the bucket plan that every rank shares,
the two threads (a bucket's local part, its collective) and the wire's communicator, and the state of the
backward in progress.

On the backward that closes a window, a post-accumulate-grad hook on every parameter counts the gradient
accumulations; a bucket whose parameters all have theirs is handed over at once to two threads: one runs
the strategy's :meth:`local` part (averaging, the local step, the deltas; ``side=True``: the parameters keep
their values until ``step()``), the other its :meth:`combine` (the collective), once the local part is done.
So bucket k+1's local step runs while bucket k's bytes are on the wire; the wire thread's waits nap
(:mod:`adasum.runtime.waiting`), leaving the core to backward and to the local thread.

A bucket is a run of parameters in the order backward finished them in the first observed boundary, as
rank 0 saw it (shared with every rank), cut where it holds at least ``bucket_bytes`` bytes. Every rank
hands its buckets to the thread in that order, so the collectives follow the same order on every rank
whatever order its own backward produces the gradients in: a bucket whose parameters are ready waits until
every bucket before it has been handed over.

A plan holds for one list of trained parameters. Where that list changes (a parameter frozen or unfrozen
with ``requires_grad_``, a group added), the next closing backward is observed again, its boundary runs in
``step()`` on every rank alike, and the plan made from it serves the boundaries after. A bucket waits for
at least one gradient of each of its parameters: a parameter that gets none in some backward on some rank
(a branch not taken, a head not used) holds its bucket, and the ones after it, until ``step()`` hands them
over, so no bucket is reduced before a gradient it could still receive. A parameter that receives more
accumulations than planned after its bucket went to the thread makes the boundary fail on every rank.

The bucket plan and a backward's progress are in :mod:`.buckets`, the lane in :mod:`adasum.runtime.lane`.

Nothing here refers to the optimizer proxy: the hooks hold the engine weakly, the thread holds only its
queue, and a job holds the strategy and its bucket. So an optimizer that is no longer referenced is
collected, and its finalizer drops the engine (:meth:`OverlapEngine.drop`): it never waits for a
collective, since the other ranks may never enter the one a thread is in.
"""

from __future__ import annotations

import time
import weakref
from typing import Callable

import torch
from mpi4py import MPI

from ...runtime import exchange
from ...runtime.lane import Job, Lane
from ..window.close import Ledger, WindowClose
from ..window.strategies import Bucket
from ..window.tensors import trained_params
from .buckets import FIRST_BUCKET_BYTES, Backward, BucketPlan, plan_from  # noqa: F401 (importable here)

__all__ = ["BucketPlan", "OverlapEngine"]


class OverlapEngine:
    """Hooks, plan, thread and communicator of one overlapped optimizer (see the module docstring).

    ``strategy`` reduces a bucket; ``window`` (an :class:`~adasum.torch.window.accumulate.AccumulationWindow`) says
    whether the backward in progress closes a window; ``loss_scale`` gives the scale of its gradients.
    """

    def __init__(self, optimizer, strategy, window, loss_scale, comm: MPI.Intracomm, bucket_bytes: int,
                 ledger: Ledger, close: WindowClose):
        # the wire's thread and communicator, and a worker thread for the buckets' local parts
        self.lane = Lane(comm, "adasum-overlap", threaded=True, worker=True)
        self.comm = self.lane.comm
        self._optimizer = optimizer
        self._strategy = strategy
        self._window = window
        self._loss_scale = loss_scale
        self._ledger, self._close = ledger, close  # the window's procedure makes the lane's agreement
        self.bucket_bytes = bucket_bytes
        self._hooks: list = []
        self._hooked: list[int] = []
        self._plan: BucketPlan | None = None
        self._bw: Backward | None = None
        self.disabled: str | None = None  # why overlap is off for good
        self.paused = 0  # inside DistributedOptimizer.no_sync(): backward passes that close no window
        self.closed = False
        self.overlapped_boundaries = 0       # boundaries whose buckets were reduced during backward
        self.buckets_started_in_backward = 0  # of the last such boundary, buckets handed over before step()
        # Of the last such boundary, one dict per bucket in the order the ranks reduce them: "bucket", "bytes",
        # and in seconds after the backward's first gradient "ready" (handed to the threads), "local" (its
        # local part began), "began" and "ended" (its collective), "step" (when step() came to wait).
        self.timeline: list[dict] = []
        self.install()

    # --- hooks ------------------------------------------------------------------------------------------------

    def install(self) -> None:
        """(Re)register one post-accumulate-grad hook per trained parameter; the bucket plan starts over."""
        self._hook_params(trained_params(self._optimizer))
        self._plan = None
        self._bw = None

    def _hook_params(self, params: list[torch.Tensor]) -> None:
        self._remove_hooks()
        self._hooked = [id(p) for p in params]
        me = weakref.ref(self)
        for p in params:
            self._hooks.append(p.register_post_accumulate_grad_hook(_hook(me)))

    def _on_grad(self, param: torch.Tensor) -> None:
        """Backward has accumulated ``param``'s gradient (inside backward)."""
        if self.disabled or self.paused or not self._window.closes_next:
            return
        bw = self._bw if self._bw is not None else self._begin()
        i = bw.pos.get(id(param))
        if i is None:
            return  # hooked, but not trained any more (frozen since): no bucket holds it
        fired = bw.fired
        fired[i] += 1
        if bw.observe:
            if fired[i] == 1:
                bw.order.append(i)
            return
        plan = self._plan
        if fired[i] == plan.expected[i]:
            bw.waiting[plan.bucket_of[i]] -= 1
            self._launch_ready(bw)
        elif fired[i] > plan.expected[i] and plan.bucket_of[i] < bw.next and bw.late is None:
            # Its bucket was reduced without this gradient: the boundary fails on every rank (in step()).
            bw.late = (
                f"rank {self.comm.Get_rank()}: parameter {i} (shape {tuple(param.shape)}) received "
                f"{fired[i]} gradient accumulations in the backward that closes this window, {plan.expected[i]} "
                "when the buckets were planned, and its bucket went to the overlap thread before the last of "
                "them: step() was not called after the previous closing backward, or backward ran more often "
                "in this micro-batch than in the planned one (overlap needs every closing micro-batch to run "
                "backward alike; use overlap=False otherwise). The buckets are planned again at the next "
                "boundary")

    def _begin(self) -> Backward:
        params = trained_params(self._optimizer)
        ids = [id(p) for p in params]
        plan = self._plan if self._plan is not None and self._plan.ids == ids else None
        pos = plan.pos if plan is not None else {pid: i for i, pid in enumerate(ids)}
        bw = self._bw = Backward(params, ids, pos, plan, self._window.seen + 1, self._loss_scale.current())
        if plan is not None:
            self._strategy.prepare(params)
            # The lane's first job: the ranks agree on the window (its number, micro-batches, parameters)
            # before any bucket goes on the wire, so a rank whose windows are out of step raises everywhere.
            self.lane.submit(_agreement_job(bw, self.comm, self._ledger.at(bw.count), self._close),
                             "the window's agreement")
            self._launch_ready(bw)
        return bw

    def _launch_ready(self, bw: Backward) -> None:
        """Hand every bucket that is complete, and has no incomplete bucket before it, to the thread."""
        waiting = bw.waiting
        while bw.next < len(waiting) and waiting[bw.next] <= 0:
            self._submit(bw)

    def _submit(self, bw: Backward) -> None:
        idx = self._plan.buckets[bw.next]
        bw.next += 1
        bucket = Bucket([bw.params[i] for i in idx], idx, bw.count, bw.scale)
        bw.buckets.append(bucket)
        local = self.lane.submit_work(_local_job(self._strategy, bucket), "a bucket's local step")
        bw.local_jobs.append(local)
        bw.jobs.append(self.lane.submit(_wire_job(self._strategy, bucket, self.comm, local, bw),
                                        "a bucket's reduction"))

    # --- at the boundary ----------------------------------------------------------------------------------

    @property
    def started(self) -> bool:
        """Whether buckets of the closing window were handed to the thread already."""
        return self._bw is not None and not self._bw.observe

    def finish(self) -> tuple[list[Bucket], float, str | None] | None:
        """Hand over the remaining buckets and wait for all of them; returns them with the loss scale their
        gradients carried and what failed the window's agreement (None where it passed; no bucket was
        reduced then), or None where this boundary's backward was not overlapped. An error of a job is kept
        on its bucket."""
        bw = self._bw
        if bw is None or bw.observe:
            return None
        self._bw = None
        self.buckets_started_in_backward = bw.next
        called = time.perf_counter()
        while bw.next < len(self._plan.buckets):
            self._submit(bw)
        for job, bucket in zip(bw.jobs, bw.buckets):
            error = self.lane.wait(job)
            if error and bucket.error is None:
                bucket.error = error
        if bw.late is not None and bw.buckets and bw.buckets[0].error is None:
            bw.buckets[0].error = bw.late
        self.overlapped_boundaries += 1
        self.timeline = [{"bucket": b, "bytes": sum(p.numel() * p.element_size() for p in bucket.params),
                          "ready": job.times[0] - bw.began, "local": local.times[1] - bw.began,
                          "began": job.times[1] - bw.began, "ended": job.times[2] - bw.began,
                          "step": called - bw.began}
                         for b, (job, local, bucket) in enumerate(zip(bw.jobs, bw.local_jobs, bw.buckets))]
        return bw.buckets, bw.scale, bw.refused

    def after_boundary(self) -> None:
        """Collective, at the end of every boundary: where no plan exists for the trained parameters (none
        yet, or they changed), make it from the backward just observed once every rank observed one with
        these parameters (rank 0's order: parameters it saw no gradient for follow in reverse parameter
        order). Each parameter is expected at least once, so a parameter without a gradient holds its bucket
        until ``step()``."""
        bw, self._bw = self._bw, None
        params = trained_params(self._optimizer)
        ids = [id(p) for p in params]
        if ids != self._hooked:
            self._hook_params(params)
        if self._plan is not None and self._plan.ids != ids:
            self._plan = None
        if self._plan is not None or self.disabled:
            return
        mine = bw.order if bw is not None and bw.observe and bw.ids == ids else None
        rank = self.comm.Get_rank()
        everyone = exchange.allgather(self.comm, mine if rank == 0 else mine is not None,
                                      what="the overlap's bucket plan")
        if everyone[0] is None or not all(everyone[1:]) or mine is None:
            return
        self._plan = plan_from(everyone[0], bw, params, self.bucket_bytes)

    def replan(self) -> None:
        """Forget the plan (every rank alike: after a boundary that failed on every rank); the next closing
        backward is observed."""
        self._plan = None
        self._bw = None

    def refuse_unfinished(self, what: str) -> None:
        """Raise where the backward that closes a window handed buckets to the thread and ``step()`` never
        took them (a skipped ``step()``), after waiting for the thread: nothing touches the parameters then."""
        if self.started:
            bw = self._bw
            _, _, refused = self.finish()
            text = (f"rank {self.comm.Get_rank()}: {what} after the backward that closes a window but before its "
                    "step(): every rank must call step() after each micro-batch's backward; the window's reduced "
                    "buckets are dropped and the parameters keep the window's start")
            if refused is None:
                # The other ranks' step() decides the boundary next (Boundary._decide): this rank meets that
                # decision with its error, so every rank raises instead of waiting for it.
                self._close.agree(self._ledger.at(bw.count), bw.params, text, comm=self.comm)
            self.replan()
            raise RuntimeError(text)

    def disable(self, why: str) -> None:
        """Overlap off for good (later boundaries run in ``step()``)."""
        self.disabled = why

    # --- lifetime ---------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Remove the hooks and close the lane (its threads run what they were given and end, its
        communicator is freed). It waits for the threads: call it where every rank has handed the same
        buckets over (after :meth:`finish` on every rank, as ``DistributedOptimizer.close()`` does)."""
        if self.closed:
            return
        self.closed = True
        self._remove_hooks()
        self._bw = None
        self.lane.close()

    def drop(self) -> None:
        """The end of an engine nobody closed (its optimizer collected, or the interpreter exiting): the
        hooks are removed and the lane dropped, which never waits for a collective
        (:meth:`adasum.runtime.lane.Lane.drop`): a bucket inside one has the lane's communicator given up,
        its error stays on the dropped bucket. The user's communicator is untouched."""
        if self.closed:
            return
        self.closed = True
        self._remove_hooks()
        self._bw = None
        self.lane.drop("the optimizer that owned this communicator was dropped")

    def _remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def _hook(owner: "weakref.ref[OverlapEngine]"):
    def hook(param: torch.Tensor) -> None:
        engine = owner()
        if engine is not None and not engine.closed:
            engine._on_grad(param)
    return hook


def _local_job(strategy, bucket: Bucket) -> Callable[[], None]:
    def job() -> None:
        strategy.local(bucket, side=True)
    return job


def _agreement_job(bw: Backward, comm: MPI.Intracomm, ledger: dict[str, int], close: WindowClose) -> Callable[[], None]:
    def job() -> None:
        decision = close.agree(ledger, bw.params, None, comm=comm)
        bw.refused = decision.failed
    return job


def _wire_job(strategy, bucket: Bucket, comm: MPI.Intracomm, local: Job, bw: Backward) -> Callable[[], None]:
    def job() -> None:
        local.wait()
        if bw.refused is not None:  # the ranks' windows differ: nothing goes on the wire
            return
        if local.error and bucket.error is None:
            bucket.error = local.error  # the bucket still takes part in the collective, with NaN deltas
        strategy.combine(bucket, comm)
    return job
