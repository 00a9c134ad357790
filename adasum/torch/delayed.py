"""``DistributedOptimizer(local_steps=H, delay=1)``: the combine of window k runs on a communication thread
while window k+1's local steps run, and is merged at the end of window k+1.

The merge rule: each rank keeps the last global point G (the ranks' shared parameters after the last merged
combine). At the end of window k the rank's own delta d_k (its parameters minus the window's start) goes to
the thread to be combined, and the rank continues from G + d_k: its own delta stands in for the combined one
until that arrives (the "eager" update of Kale et al. 2025, with the rank's own pseudo-gradient in place of
the missing global one). At the end of window k+1 the combined delta of window k has arrived: the outer
optimizer moves G by it (G ← outer step from G along the combined delta, as without delay), and the rank
continues from the new G + d_{k+1}, so the stand-in d_k is replaced by the combined delta exactly once and
nothing is counted twice. Why this rule: it needs no extra hyperparameter (Streaming DiLoCo's mixing factor),
the outer optimizer sees the same sequence of combined deltas as with ``delay=0``, only one window late, and
a rank's parameters never hold another rank's unmerged progress.

A forced boundary (``force_boundary()``, ``flush()``) drains: its window's combine runs and is merged at
once, so every rank then holds G exactly, identical everywhere.

Memory: G and the in-flight deltas, two more copies of the parameters beside the window's start.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from mpi4py import MPI

from ..runtime import exchange
from ..runtime.context import context_for, library_comm
from .local import LocalSteps
from .overlap import GIVE_UP_WAIT, CommThread, Job
from .strategy import trained_params
from .tensors import StartCopy, all_finite

__all__ = ["DelayedCombine"]


class DelayedCombine(LocalSteps):
    """:class:`~adasum.torch.local.LocalSteps` whose combine is merged one window late (the module's rule)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.glob = StartCopy(self.start.where)  # G, once a combine went out
        self.has_glob = False
        self.sent: list[torch.Tensor] | None = None  # the deltas on the wire (then combined)
        self.job: Job | None = None
        self.arrived = False  # ``sent`` holds a combined result not merged yet (a loaded state)
        self.wire_comm = self.comm.Dup()
        library_comm(self.wire_comm)
        ctx = context_for(self.wire_comm)
        ctx.beside_compute = True  # its waits nap, leaving the core to the local steps
        ctx.may_give_up = True
        threaded = self.comm.Get_size() > 1 and MPI.Query_thread() == MPI.THREAD_MULTIPLE
        self.thread = CommThread(f"adasum-delayed-{self.comm.Get_rank()}") if threaded else None
        self._finalizer = weakref.finalize(self, _drop, self.thread, self.wire_comm)

    @property
    def pending(self) -> bool:
        return self.sent is not None

    def combine(self, drain: bool = False) -> bool:
        """Collective at the end of a window: merge the previous window's combine, send this window's delta,
        and with ``drain`` merge it at once too. Returns False where a merged combine was skipped."""
        params = trained_params(self.optimizer)
        index = list(range(len(params)))
        targets = [p.detach() for p in params]
        error, self.error, overflowed, taken = self.error, None, self.overflowed, self.taken
        self.taken, self.overflowed = 0, False
        wire_error = self._wait()
        failed = exchange.failures(self.comm, error or wire_error, what="the combine's error vote")
        if failed:
            if self.has_glob or taken:
                (self.glob if self.has_glob else self.start).apply(targets, index, "copy")
            self.sent, self.arrived = None, False
            raise RuntimeError(f"(raised on rank {self.comm.Get_rank()}) a local step or combine failed; the "
                               f"parameters are back at the last combined point: {failed}")
        scale = self.loss.current()
        if self.loss.enabled:
            overflowed = exchange.any_true(self.comm, overflowed, what="the combine's overflow vote")
        ok = self._merge(index)
        with torch.no_grad():
            if taken:
                deltas = [t.clone(memory_format=torch.contiguous_format) for t in targets]
                self.start.apply(deltas, index, "sub")  # this window's own delta d
                if self.has_glob:
                    for t, d in zip(targets, deltas):
                        t.copy_(d)
                    self.glob.apply(targets, index, "add")  # G + d
                else:  # the first window: G is its start, and the parameters are start + d already
                    first = [torch.empty_like(t) for t in targets]
                    self.start.apply(first, index, "copy")
                    self.glob.ensure(params)
                    self.glob.keep(index, first)
                    self.has_glob = True
                self._send(deltas)
            if drain:
                ok = self._merge(index, wait=True) and ok
                if self.has_glob:
                    self.glob.apply(targets, index, "copy")  # every rank holds G exactly
        self.loss.update(scale, not overflowed)
        return ok

    def _send(self, deltas: list[torch.Tensor]) -> None:
        self.sent, self.arrived = deltas, False
        if self.thread is None:
            self._reduce(deltas)
            self.arrived = True
        else:
            self.job = self.thread.submit(lambda: self._reduce(deltas))

    def _reduce(self, deltas: list[torch.Tensor]) -> None:
        with torch.no_grad():
            if self.comm.Get_size() == 1 or not deltas:
                return
            if self.op == "adasum":
                self.wire.adasum_(deltas, self.wire_comm, self.hierarchical)
            else:
                self.wire.sum_(deltas, self.wire_comm, self.op == "mean")

    def _wait(self) -> str | None:
        """Wait for the combine on the thread (no MPI call on this thread); its error, if it failed."""
        job, self.job = self.job, None
        if job is None:
            return None
        job.wait()
        self.arrived = job.error is None
        return job.error

    def _merge(self, index: list[int], wait: bool = False) -> bool:
        """G moves by the arrived combined delta (the outer optimizer's step), or stays where it is not
        finite (False). ``wait``: wait for the combine just sent first (its error raises on every rank)."""
        if wait:
            error = exchange.failures(self.comm, self._wait(), what="the drained combine's error vote")
            if error:
                self.sent = None
                raise RuntimeError(f"(raised on rank {self.comm.Get_rank()}) a combine failed: {error}")
        if self.sent is None or not self.arrived:
            return True
        combined, self.sent, self.arrived = self.sent, None, False
        ok = not self.skip_nonfinite or all_finite(combined)
        if ok:
            self.outer.apply_(combined, self.glob, index)  # combined now holds the new G
            self.glob.keep(index, combined)
        return ok

    def close(self) -> None:
        """Wait for a combine on the thread and end the thread (the parameters keep their values)."""
        self._wait()
        self._finalizer()

    # --- state ---------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        self.error = self.error or self._wait()
        own = super().state_dict()
        params = trained_params(self.optimizer)
        if self.has_glob:
            g = [torch.empty_like(p, device="cpu") for p in params]
            self.glob.apply(g, list(range(len(params))), "copy")
            own["global_parameters"] = g
            own["window_parameters"] = [p.detach().clone() for p in params]
        if self.sent is not None:
            own["combined_deltas"] = [d.detach().clone() for d in self.sent]
        return own

    def load_state_dict(self, own: dict[str, Any]) -> None:
        self._wait()
        super().load_state_dict(own)
        params = trained_params(self.optimizer)
        index = list(range(len(params)))
        g, sent = own.get("global_parameters"), own.get("combined_deltas")
        self.has_glob = g is not None
        if g is not None:
            self.glob.ensure(params)
            self.glob.keep(index, [t.to(p.device, p.dtype) for t, p in zip(g, params)])
            self._window = (own.get("window_start"), own["window_parameters"])
            self.restore_parameters()
        self.sent = None if sent is None else [t.to(p.device, p.dtype).contiguous() for t, p in zip(sent, params)]
        self.arrived = sent is not None


def _drop(thread: CommThread | None, comm: MPI.Intracomm) -> None:
    """The end of the thread and its communicator; never waits for a collective (as the overlap engine's
    drop): a thread inside one has its communicator given up."""
    if MPI.Is_finalized():
        if thread is not None:
            thread.drop()
        return
    if thread is None:
        comm.Free()
        return
    if not thread.drop(lambda: comm.Free() if not MPI.Is_finalized() else None):
        ctx = context_for(comm)
        ctx.broken = ctx.broken or "the optimizer that owned this communicator was dropped during a combine"
        thread.join(GIVE_UP_WAIT)
