"""``DistributedOptimizer``: any torch optimizer, data-parallel over MPI with Adasum on weight deltas
(docs/design.md), or with a plain sum/mean of the gradients, with local micro-batch accumulation.

This is the object users see, and it is small: it counts micro-batches (:mod:`.accumulate`), and at a
boundary hands buckets of parameters to a reduce strategy (:mod:`.strategy`: Adasum of weight deltas, or
sum/mean of gradients), in ``step()`` or, with ``overlap=True``, on the overlap engine's thread during
backward (:mod:`.overlap`). Before anything is applied the ranks vote on whether a bucket failed anywhere,
so an error on one rank is an error on every rank. Every MPI call goes through the collective or
:mod:`adasum.runtime.exchange`, so the stall inspector names a rank that does not arrive.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from mpi4py import MPI

from ..call.allreduce import Op
from ..runtime.context import check_comm
from ..runtime.launch import check_launch
from .arguments import check_agreement, check_arguments, check_buffers
from .accumulate import AccumulationWindow
from .amp import LossScale
from .boundary import Boundary
from .buffers import BufferSync, buffers_of
from .compress import Wire
from .local import LocalSteps, OuterSGD, local_problem, uses_local_steps
from .overlap import OverlapEngine
from .state_dict import StateDicts
from .stepping import WindowSteps
from .strategy import AdasumDeltas, GradientReduce, trained_params
from .tensors import StartCopy
from .window import Layout, Ledger

__all__ = ["DistributedOptimizer"]


class DistributedOptimizer(WindowSteps, StateDicts, torch.optim.Optimizer):
    """Wraps ``optimizer`` (SGD, Adam, AdamW, anything with ``param_groups`` and ``step()``) for training on
    every rank of ``comm``. It holds the wrapped optimizer (``.optimizer``) rather than re-implementing it:
    ``param_groups``, ``state`` and ``defaults`` are the wrapped optimizer's own.

    Collective: every rank of ``comm`` constructs it with the same settings and the same parameter shapes,
    and calls ``step()`` the same number of times. The constructor checks the settings across ranks.

    The training loop (Accelerate's convention)::

        for i, (x, y) in enumerate(shard):
            loss_fn(model(x), y).backward()
            if i == len(shard) - 1:
                optimizer.force_boundary()  # a short last window is averaged by its own count
            optimizer.step()                # reduces and updates only where a window closes
            scheduler.step()                # a BoundaryScheduler: once per window
            optimizer.zero_grad()           # does nothing while a window is open

    Args:
        optimizer: the torch optimizer to wrap; it keeps doing the actual update.
        op: ``"adasum"`` (reduce the weight deltas of each rank's local step with Adasum), ``"sum"`` or
            ``"mean"`` (reduce the gradients before the local step).
        accumulation_steps: micro-batches per window. Their gradients add up in ``.grad``; at the boundary
            they are divided by the number of micro-batches the window actually held, so the loss of each
            micro-batch should be a mean over its samples and must not be divided by ``accumulation_steps``.
        comm: an mpi4py intracommunicator; default ``MPI.COMM_WORLD``.
        start_copy: ``op="adasum"`` only: where the window's starting values are kept, ``"device"`` (next to
            the parameters) or ``"host"`` (pinned host memory for CUDA parameters; device memory grows only
            by the largest parameter, at the price of copies). See :class:`~adasum.torch.tensors.StartCopy`.
        grad_scaler: a ``torch.amp.GradScaler`` whose ``scale(loss).backward()`` produced the gradients. The
            optimizer then unscales at the boundary and updates the scale itself, from the non-finite check
            that all ranks share, so every rank keeps the same scale. Do not call the scaler's ``step``,
            ``unscale_`` or ``update`` yourself.
        hierarchical: ``op="adasum"`` only: the deltas are averaged over the ranks of each node, then combined
            with Adasum across nodes (``adasum_allreduce(..., hierarchical=True)``): fewer bytes between
            nodes, Adasum's benefit kept for the node count.
        skip_nonfinite: skip an update, on every rank, when the reduced gradients (sum/mean) or weight deltas
            (adasum) hold a NaN or Inf; the parameters are left as they were, ``skipped_updates`` counts it
            and rank 0 logs it once (logger ``"adasum"``). With adasum a rank whose own gradients are
            non-finite skips its local step (its optimizer state stays finite); the other ranks have taken
            theirs, and their optimizer state keeps it. Off: non-finite values reach the parameters.
        overlap: communicate during backward (default off: where every rank has one core, the thread
            competes with backward for it). On the backward that closes a window, buckets of parameters go
            to a background thread as backward finishes them, which reduces them (for adasum, after their
            local step; the parameters still change only inside ``step()``); ``step()`` waits and applies.
            Bitwise the results of ``overlap=False`` for adasum. The rules are in docs/training.md.
        bucket_bytes: with ``overlap``, the smallest bucket in bytes of parameters (the last may be smaller).
        compression: ``None``, ``"fp16"`` or ``"bf16"``: the deltas (adasum) or gradients (sum/mean) travel
            as 16-bit floats, half the bytes, and are combined in float32 or wider (see
            :class:`~adasum.torch.compress.Wire`: fp16 travels scaled per layer by an agreed power of two).
        module: the model (its ``buffers()``) or an iterable of buffer tensors to keep alike on every rank
            at each boundary, as ``buffers`` says; None (the default): the buffers are left alone (each rank's
            BatchNorm statistics then follow its own batches).
        buffers: with ``module``, how its buffers are kept alike, at the end of every ``step()`` that closes
            a window (collective there): ``"average"`` (the default: each buffer's change since the last
            boundary is averaged over the ranks, integers rounded down; the constructor first copies rank
            0's buffers to every rank), ``"broadcast"`` (rank 0's buffers are copied to every rank) or None
            (left alone). See :mod:`adasum.torch.buffers` for why averaging is the default.
        local_steps: local steps between combines (default 1: a combine at every window). With H > 1 the
            wrapped optimizer takes a plain step at every window (each rank on its own averaged gradients,
            no MPI call), and every H windows the ranks combine each parameter's delta since the start of
            the H windows (``op="adasum"``: Adasum; ``"mean"``/``"sum"``: mean/sum of the deltas, i.e. model
            averaging) and continue from start + combined delta (see ``outer_lr``). See :mod:`.local`.
        outer_lr: the outer optimizer's rate at each combine (default 1.0): DiLoCo's outer SGD on
            g = -(combined delta): v <- mu·v + g, params = start - outer_lr·(g + mu·v). Any other value of
            it or of ``outer_momentum``, like ``local_steps > 1``, makes every window's step a plain local
            step (also with ``op="mean"``).
        outer_momentum: mu above, Nesterov where > 0 (default 0.0: params = start + combined delta).
        delay: 0 (the combine runs in the ``step()`` of the H-th local step) or 1 (it runs on a thread during
            the next window's local steps and is merged at its end; rule in :mod:`.delayed`). A forced
            boundary (``force_boundary()``, ``flush()``) merges at once: every rank then holds the same values.

    Attributes:
        is_boundary: whether the last ``step()`` combined the ranks' updates (without local steps: closed a
            window; with ``local_steps=H``: the H-th local step's window).
        took_local_step: whether the last ``step()`` closed an accumulation window (with ``local_steps``:
            took a local step, or skipped one for non-finite gradients).
        step_was_skipped: whether that boundary's update was skipped for non-finite values.
        skipped_updates: boundaries skipped so far.
        boundaries: windows closed so far.
        overlapped_boundaries: boundaries whose buckets were reduced during backward (``overlap``).
        buckets_started_in_backward: of the last such boundary, how many buckets were handed to the
            thread before ``step()`` was called.
        timeline: of the last such boundary, when each bucket was handed over, reduced and done
            (:attr:`adasum.torch.overlap.OverlapEngine.timeline`); empty without overlap.
    """

    # GradScaler.step(opt) hands scaling over to optimizers that say this; step() then tells the user to
    # pass the scaler to the constructor instead (the scaler's own update would diverge across ranks).
    _step_supports_amp_scaling = True

    def __init__(self, optimizer, *, op: str | Op = "adasum", accumulation_steps: int = 1,
                 comm: MPI.Intracomm | None = None, start_copy: str = "device", grad_scaler=None,
                 skip_nonfinite: bool = True, hierarchical: bool = False, overlap: bool = False,
                 bucket_bytes: int = 25 << 20, compression: str | None = None, module=None,
                 buffers: str | None = "average", local_steps: int = 1, outer_lr: float = 1.0,
                 outer_momentum: float = 0.0, delay: int = 0):
        # torch.optim.Optimizer.__init__ is not called: the wrapped optimizer owns groups, state, defaults.
        if isinstance(optimizer, DistributedOptimizer):
            raise TypeError("optimizer is already a DistributedOptimizer; wrap the torch optimizer only once")
        check_arguments(optimizer, bucket_bytes)
        check_buffers(module, buffers)
        self.op = _op_name(op)
        comm = check_comm(comm)
        check_launch()  # a job whose processes MPI does not see raises here
        if hierarchical and self.op != "adasum":
            raise ValueError(f"hierarchical=True needs op 'adasum', got op '{self.op}'")
        self.optimizer = optimizer
        self.comm = comm
        wire = Wire(compression)
        self.compression = wire.name
        self.bucket_bytes = bucket_bytes
        start = StartCopy(start_copy)
        self.start_copy = start_copy
        self.grad_scaler = grad_scaler
        self._loss = LossScale(grad_scaler)
        self.skip_nonfinite = bool(skip_nonfinite)
        self.hierarchical = bool(hierarchical)
        self._window = AccumulationWindow(accumulation_steps)
        if self.op == "adasum" and comm.Get_size() > 1:
            self._strategy = AdasumDeltas(optimizer, start, wire, self.hierarchical, self.skip_nonfinite)
        else:  # one rank: exactly the wrapped optimizer (the reduction is the identity)
            self._strategy = GradientReduce(optimizer, self.op, wire, self.skip_nonfinite)
        self._closed = False
        self.is_boundary = False
        self.took_local_step = False
        self.step_was_skipped = False
        self.skipped_updates = 0
        self._ledger = Ledger(self._window)  # what the ranks agree on at each combine
        self.buffers = buffers if module is not None else None
        kept = [] if self.buffers is None else buffers_of(module)
        local = {"local_steps": local_steps, "outer_lr": outer_lr, "outer_momentum": outer_momentum,
                 "delay": delay, "overlap_requested": bool(overlap)}
        self.overlap_requested = bool(overlap)
        overlap = self._agree(accumulation_steps, overlap, wire, kept, local)
        self.local_steps, self.outer_lr, self.outer_momentum, self.delay = (
            int(local_steps), float(outer_lr), float(outer_momentum), int(delay))
        self._assemble(module, kept, start, wire, overlap)

    def _agree(self, accumulation_steps: int, overlap: bool, wire: Wire, kept: list[torch.Tensor],
               local: dict[str, Any]) -> bool:
        """Check every rank's settings, parameters and buffers against the others' (collective; a difference
        raises on every rank); returns whether the boundaries may overlap with backward."""
        # Overlap needs a second thread in MPI; without MPI_THREAD_MULTIPLE every boundary runs in step().
        comm = self.comm
        overlap = bool(overlap) and comm.Get_size() > 1 and MPI.Query_thread() == MPI.THREAD_MULTIPLE
        check_agreement(comm, {"op": self.op, "accumulation_steps": accumulation_steps,
                               "start_copy": self.start_copy, "skip_nonfinite": self.skip_nonfinite,
                               "hierarchical": self.hierarchical, "grad_scaler": self._loss.enabled,
                               "overlap": overlap, "bucket_bytes": self.bucket_bytes,
                               "compression": str(wire.dtype), "buffers": self.buffers, "buffer_count": len(kept),
                               **local},
                        self._params(), [(tuple(b.shape), str(b.dtype)) for b in kept], local_problem)
        return overlap

    def _assemble(self, module, kept: list[torch.Tensor], start: StartCopy, wire: Wire, overlap: bool) -> None:
        """Make the parts the settings ask for: local steps, the buffers' sync, the overlap engine (dropped,
        never waited for, once this optimizer is collected) and the boundary procedure."""
        optimizer, comm = self.optimizer, self.comm
        self._layout = Layout(optimizer)  # how the ranks compare the parameters of their windows
        self._local: LocalSteps | None = None
        if uses_local_steps(self.local_steps, self.outer_lr, self.outer_momentum, self.delay):
            self._local = self._ledger.local = LocalSteps(optimizer, comm, self.op, self.local_steps,
                                     OuterSGD(self.outer_lr, self.outer_momentum), start.where, wire,
                                     self.hierarchical, self.skip_nonfinite, self._loss, self._layout, self.delay)
        source = module if isinstance(module, torch.nn.Module) else None
        self._buffers = None if self.buffers is None else BufferSync(self.buffers, kept, comm, source)
        self._engine: OverlapEngine | None = None
        if overlap:
            self._engine = OverlapEngine(optimizer, self._strategy, self._window, self._loss, comm,
                                         self.bucket_bytes, self._ledger, self._layout)
            weakref.finalize(self, self._engine.drop)  # never waits for a collective (OverlapEngine.drop)
        self._boundary = Boundary(optimizer, comm, self._strategy, self._window, self._loss, self._engine,
                                  self._layout)

    # --- the wrapped optimizer's own attributes ------------------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups) -> None:
        self.optimizer.param_groups = groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the wrapped optimizer. Collective in effect: every rank must add the same shapes
        (the next combine checks it). Inside a window of local steps the group's parameters join the window
        at their first local step."""
        self._check_open("add_param_group()")
        self.optimizer.add_param_group(param_group)
        if self._engine is not None:
            self._engine.install()

    @property
    def overlap(self) -> bool:
        """Whether boundaries may be reduced during backward (False once closed)."""
        return self._engine is not None and not self._engine.closed

    @property
    def overlap_comm(self) -> MPI.Intracomm | None:
        """The communicator the overlap thread reduces on (a duplicate of ``comm``; None without overlap):
        ``adasum.count_traffic(opt.overlap_comm)`` counts what the overlapped buckets send."""
        return self._engine.comm if self.overlap else None

    @property
    def overlapped_boundaries(self) -> int:
        return 0 if self._engine is None else self._engine.overlapped_boundaries

    @property
    def buckets_started_in_backward(self) -> int:
        return 0 if self._engine is None else self._engine.buckets_started_in_backward

    @property
    def timeline(self) -> list[dict]:
        return [] if self._engine is None else list(self._engine.timeline)

    def close(self, *, combine: bool = True) -> None:
        """End the optimizer: with local steps, first combine what is open (``flush()``, collective; pass
        ``combine=False`` to leave each rank's own model as it is), then stop the lanes (overlap's,
        ``delay=1``'s), remove the hooks and free their communicators. Every later call raises at once.
        Collective: every rank closes alike. Where a closing backward ran, it first hands the buckets that
        backward has not handed over to the lane and waits until they are reduced (every rank then hands
        over every bucket, so the collectives match even where the ranks had handed different buckets
        over). A window whose buckets were reduced during backward and not stepped is abandoned: the
        parameters keep their values. An optimizer collected without ``close()`` drops its lanes instead,
        never waiting for a collective (:meth:`adasum.runtime.lane.Lane.drop`)."""
        if self._closed:
            return
        try:
            if combine and self._local is not None:
                self.flush()
        finally:
            self._closed = True
            if self.overlap:
                self._engine.finish()
                self._engine.close()
            if self._local is not None:
                self._local.close()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def boundaries(self) -> int:
        """Windows closed with a combine so far (with ``local_steps``: combines)."""
        return self._ledger.combines

    @boundaries.setter
    def boundaries(self, n: int) -> None:
        self._ledger.combines = int(n)

    @property
    def _vote_comm(self) -> MPI.Intracomm:
        """Where the window's agreements run: the overlap's lane while there is one (its first job at a
        closing backward is the agreement, so a rank whose windows are out of step meets it there), else
        ``comm``."""
        return self._engine.comm if self.overlap else self.comm

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"rank {self.comm.Get_rank()}: {what} after close(): this DistributedOptimizer "
                               "was closed; make a new one (its state_dict() still works)")

    def __getattr__(self, name: str):
        optimizer = self.__dict__.get("optimizer")
        if optimizer is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(optimizer, name)

    def __getstate__(self):
        raise TypeError("a DistributedOptimizer cannot be pickled or copied (it holds an MPI communicator); "
                        "save its state_dict() instead")

    def __repr__(self) -> str:
        return (f"DistributedOptimizer(op={self.op!r}, accumulation_steps={self.accumulation_steps}, "
                f"overlap={self.overlap}, compression={self.compression!r}, size={self.comm.Get_size()}, "
                f"optimizer={self.optimizer!r})")

    # --- helpers ----------------------------------------------------------------------------------------------

    def _params(self) -> list[torch.Tensor]:
        return trained_params(self.optimizer)


def _op_name(op: str | Op) -> str:
    try:
        return Op(op).value
    except ValueError:
        raise ValueError(f"op must be one of 'adasum', 'sum', 'mean', got {op!r}") from None
