"""Adasum of weight deltas across the replicas of an FSDP2 model: :class:`ReplicaDeltas`, which drives the
window's procedure (:class:`adasum.torch.window.close.WindowClose`) with the deltas of this rank's shards."""

from __future__ import annotations

import weakref
import zlib

import torch
from mpi4py import MPI

from ...call.allreduce import Op
from ...runtime import exchange
from ...runtime.faults import world
from ..window.close import Layout, WindowClose
from ..window.tensors import all_finite
from .mesh import _free, _managed, setup

__all__ = ["ReplicaDeltas"]


class ReplicaDeltas:
    """Adasum of weight deltas across the replicas of an FSDP2 model: each replica's optimizer steps its
    ranks' shards on the gradients FSDP reduced over the shard group alone (no hook), then the deltas of
    every parameter are combined across the replicas with the tree on the whole parameter (as
    :func:`adasum_replicas` combines gradients) and every replica continues from start + combined delta.
    Optimizer state (momentum, Adam's moments) stays with each replica, as with
    :class:`~adasum.torch.DistributedOptimizer`. ``op="mean"`` averages the deltas (model averaging).
    ``local_steps=H``: H optimizer steps between combines, the deltas taken since the window's start (local
    SGD); :meth:`flush` combines a window left open. ``compression="bf16"`` or ``"fp16"``: the deltas travel
    between the replicas as 16-bit floats (``DistributedOptimizer``'s wire).

    The rules of :class:`~adasum.torch.DistributedOptimizer` hold here too:

    - a rank whose gradients are not finite (a NaN or Inf loss on one replica) skips its own optimizer step,
      so its state stays finite; with ``local_steps=1`` that combine is then skipped on every rank (every
      parameter back at the window's start, ``step_was_skipped`` True, ``skipped_updates`` counting it),
      with local steps the window goes on without that step; a combined delta that is not finite skips the
      combine on every rank;
    - a local step that raises on one rank, at a step that combines, raises on every rank, the parameters
      back at the window's start;
    - at each combine the ranks agree on the window's number and its steps, and the model's forward checks
      the steps taken so far before FSDP gathers any parameter: a rank that skipped or added a ``step()``
      makes every rank raise, naming the counts, instead of leaving the others waiting in a collective.

    Collective over MPI's world (the constructor, every :meth:`step` and every forward of ``model``), after
    ``adasum.torch.init_process_group()``; the model sharded with ``fully_shard(..., mesh=mesh["shard"])``
    and no :func:`adasum_replicas` hook (it would combine the gradients first)."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module, mesh, *, op: str | Op = "adasum",
                 local_steps: int = 1, compression: str | None = None):
        self.comm = world()  # the world the mesh spans (MPI's, or the survivors' after an elastic shrink)
        modules, plan, self.tree = setup(model, mesh, op, form="ReplicaDeltas", local_steps=local_steps,
                                         compression=compression)
        self.local_steps, self._steps, self._start, self._nonfinite = local_steps, 0, None, False
        self._checked = False  # whether the replicas were found to start alike (at the first step)
        self.params = [p for m in modules for _, p in _managed(m)]
        known = {id(p) for p in self.params}
        stray = [i for i, p in enumerate(q for g in optimizer.param_groups for q in g["params"]) if id(p) not in known]
        problem = (f"rank {self.comm.Get_rank()}: ReplicaDeltas: the optimizer's parameters {stray} are not "
                   "parameters of the model's FSDP modules") if stray else None
        exchange.raise_everywhere(self.comm, problem, ValueError, "ReplicaDeltas: checking the optimizer")
        self.optimizer = optimizer
        self.closing = WindowClose(self.comm, Layout(optimizer), None, name="ReplicaDeltas", unit="combine",
                                 failed="ReplicaDeltas: the combine failed; the parameters are back at the "
                                 "window's start")
        # Before FSDP's own pre-forward hook (which gathers the parameters): the steps taken so far.
        check = model.register_forward_pre_hook(_ForwardCheck(weakref.ref(self)), prepend=True)
        self._finalizer = weakref.finalize(self, _close_deltas, check, self.tree.replicate, self.tree.shard)

    step_was_skipped = property(lambda self: self.closing.step_was_skipped,
                                doc="Whether the last combine was skipped for values that were not finite.")
    skipped_updates = property(lambda self: self.closing.skipped, doc="Combines skipped so far.")
    windows = property(lambda self: self.closing.combines, doc="Combines made so far (skipped ones included).")

    @property
    def param_groups(self) -> list:
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        """The wrapped optimizer's step on this rank's shards; at the end of a window (every ``local_steps``
        steps) the deltas since its start combined across the replicas. Returns the closure's loss."""
        if not self._finalizer.alive:
            raise RuntimeError("ReplicaDeltas.step() after close()")
        if self._start is None:
            if not self._checked:
                self._check_alike()
            with torch.no_grad():
                self._start = [p.to_local().clone() for p in self.params]
        self.closing.step_was_skipped = False
        combines = self._steps + 1 == self.local_steps
        try:
            loss = None
            if closure is not None:  # before the check: the closure makes the gradients
                with torch.enable_grad():
                    loss = closure()
            # A rank whose gradients are not finite skips its own step, so its optimizer state stays finite.
            # A window of one step is then skipped on every rank (as DistributedOptimizer's boundary does);
            # a window of local steps goes on without that step (as its local steps do).
            if _grads_finite(self.params):
                self.optimizer.step()
            elif self.local_steps == 1:
                self._nonfinite = True
        except BaseException as e:
            if not combines:
                raise  # the next forward's check (or flush) finds this rank one step behind
            self._steps += 1
            self._combine(error=f"rank {self.comm.Get_rank()}: the wrapped optimizer's step raised "
                                f"{type(e).__name__}: {e}")
            raise  # not reached: the combine raises on every rank
        self._steps += 1
        if combines:
            self._combine()
        return loss

    def _check_alike(self) -> None:
        """Before the first window: the replicas must hold the same parameters (each window continues from
        its start plus the combined delta, so replicas that start apart stay apart). One digest per rank's
        shards, compared over its replicate group; a difference raises on every rank."""
        digest = 0
        with torch.no_grad():
            for p in self.params:
                local = p.to_local().detach()
                digest = zlib.crc32(local.cpu().contiguous().view(torch.uint8).numpy().tobytes(), digest)
        seen = exchange.allgather(self.tree.replicate, digest, "ReplicaDeltas: comparing the replicas")
        problem = None
        if len(set(seen)) > 1:
            apart = [g for g, d in enumerate(seen) if d != seen[0]]
            problem = (f"rank {self.comm.Get_rank()}: ReplicaDeltas: the replicas start from different "
                       f"parameters (replicas {apart} differ from replica 0 in this rank's shards), and would "
                       "stay apart: load the same checkpoint on every replica (a checkpoint saved after "
                       "flush(), or one that keeps one copy of the model, as torch.distributed.checkpoint does)")
        exchange.raise_everywhere(self.comm, problem, ValueError, "ReplicaDeltas: comparing the replicas")
        self._checked = True

    def flush(self) -> None:
        """Combine the open window now, however many steps it holds. Collective even where no window is
        open: the ranks check that they took as many steps as each other."""
        if not self._finalizer.alive:
            raise RuntimeError("ReplicaDeltas.flush() after close()")
        self._combine()

    def _ledger(self) -> dict[str, int]:
        return {"combine": self.closing.combines + 1, "local steps": self._steps}

    def _check_forward(self) -> None:
        """Collective, at every forward of the model: the ranks' step counts, before FSDP's collectives."""
        self.closing.decide({**self._ledger(), "forward": 1}, self.params,
                          context="ReplicaDeltas: the ranks' windows differ at the model's forward")

    def _combine(self, error: str | None = None) -> None:
        """The window's procedure (:class:`~adasum.torch.window.close.WindowClose`: the agreement on the
        combine's number, the steps it holds, the parameters, a failed local step, a delta that is not
        finite; the combine of the deltas across the replicas; the vote on whether every combined delta is
        finite; start + combined delta, or the start), then a new window."""
        if self._start is None:  # no window open: the ranks check their counts
            self.closing.decide(self._ledger(), self.params, error, undo=self._restart)
            self._steps, self._nonfinite = 0, False
            return
        update = _ShardDeltas(self, error is None)
        self.closing.close(update, self._ledger(), error=error, overflowed=not update.finite)
        self._steps, self._start, self._nonfinite = 0, None, False

    def _restart(self) -> None:
        """Every parameter back at the window's start; a new window begins."""
        with torch.no_grad():
            for p, s in zip(self.params, self._start or []):
                p.to_local().copy_(s)
        self._steps, self._start, self._nonfinite = 0, None, False

    def close(self) -> None:
        """Remove the forward check and free the communicators; any later :meth:`step` raises."""
        self._finalizer()


class _ShardDeltas:
    """The window's deltas of this rank's shards, as the window's procedure takes them
    (:class:`~adasum.torch.window.close.Update`): one flat buffer, combined across the replicas by the tree
    on whole parameters. The replicas hold different shards: whether every combined delta is finite is
    voted on; a rank whose own update is not finite skips the wire on every rank."""

    voted = True
    skips_overflowed = True

    def __init__(self, owner: ReplicaDeltas, form: bool):
        self.owner, self.params = owner, owner.params
        self.sizes = tuple(s.numel() for s in owner._start)
        self.deltas = None
        if form:
            with torch.no_grad():
                shards = [p.to_local() for p in owner.params]
                self.deltas = torch.cat([(t - s).reshape(-1) for t, s in zip(shards, owner._start)])
        self.finite = not owner._nonfinite and (self.deltas is None or bool(torch.isfinite(self.deltas).all()))

    def carries_companion(self, comm: MPI.Intracomm) -> bool:
        return False

    def combine(self, comm: MPI.Intracomm, companion) -> None:
        with torch.no_grad():
            self.owner.tree.reduce_(self.deltas, self.sizes)

    def settle(self) -> None:
        """Nothing: the combined deltas are in the buffer."""

    def combined(self) -> list[torch.Tensor]:
        return [self.deltas]

    def apply(self, ok: bool) -> None:
        if not ok:
            self.owner._restart()
            return
        with torch.no_grad():
            for p, s, d in zip(self.params, self.owner._start, self.deltas.split(self.sizes)):
                p.to_local().copy_(s + d.view_as(s))

    def explain(self) -> None:
        """Nothing more to say than the log line: the deltas are not kept."""

    def abandon(self) -> None:
        self.owner._restart()


class _ForwardCheck:
    """The forward pre-hook of a model under :class:`ReplicaDeltas` (held weakly: the hook ends with it)."""

    __slots__ = ("owner",)

    def __init__(self, owner: weakref.ref):
        self.owner = owner

    @torch.compiler.disable  # a collective over MPI: never traced into a compiled model's graph
    def __call__(self, module, args) -> None:
        owner = self.owner()
        if owner is not None and owner._finalizer.alive:
            owner._check_forward()


def _grads_finite(params: list) -> bool:
    """Whether this rank's shards of the gradients are all finite."""
    grads = [g.to_local() if hasattr(g, "to_local") else g for g in (p.grad for p in params) if g is not None]
    return all_finite(grads)


def _close_deltas(check, *comms) -> None:
    check.remove()
    _free(*comms)
