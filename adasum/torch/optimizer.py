"""``DistributedOptimizer``: any torch optimizer, data-parallel over MPI with Adasum on weight deltas
(docs/design.md), or with a plain sum/mean of the gradients, with local micro-batch accumulation.

This is the object users see, and it is small: it counts micro-batches (:mod:`.window.accumulate`), and at a
boundary hands buckets of parameters to a reduce strategy (:mod:`.window.strategies`: Adasum of weight deltas, or
sum/mean of gradients), in ``step()`` or, with ``overlap=True``, on the overlap engine's thread during
backward (:mod:`.overlap`). Before anything is applied the ranks vote on whether a bucket failed anywhere,
so an error on one rank is an error on every rank. Every MPI call goes through the collective or
:mod:`adasum.runtime.exchange`, so the stall inspector names a rank that does not arrive.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from mpi4py import MPI

from ..runtime.context import check_comm
from ..runtime.launch import check_launch
from .checks import check_agreement, check_arguments, buffers_problem
from .options import Options
from .state import optimizer_state as state_dicts
from .window.amp import LossScale
from .window.compress import Wire
from .window.module_buffers import buffers_of
from .window.outer import describe_outer, outer_problem
from .window.tensors import trained_params
from .window.training_loop import Steps, assemble

__all__ = ["DistributedOptimizer"]


class _Wrapping(torch.optim.Optimizer):
    """What an optimizer that holds another one (``.optimizer``) shows of it: its ``param_groups``, ``state``
    and ``defaults``, and any other attribute, read from it. ``torch.optim.Optimizer.__init__`` is not
    called: the wrapped optimizer owns groups, state and defaults."""

    optimizer: torch.optim.Optimizer

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

    def __getattr__(self, name: str):
        optimizer = self.__dict__.get("optimizer")
        if optimizer is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(optimizer, name)

    def __getstate__(self):
        raise TypeError("a DistributedOptimizer cannot be pickled or copied (it holds an MPI communicator); "
                        "save its state_dict() instead")


class DistributedOptimizer(_Wrapping):
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
        comm: an mpi4py intracommunicator; default ``MPI.COMM_WORLD``.
        grad_scaler: a ``torch.amp.GradScaler`` whose ``scale(loss).backward()`` produced the gradients. The
            optimizer then unscales at the boundary and updates the scale itself, from the non-finite check
            that all ranks share, so every rank keeps the same scale. Do not call the scaler's ``step``,
            ``unscale_`` or ``update`` yourself.
        module: the model (its ``buffers()``) or an iterable of buffer tensors to keep alike on every rank
            at each boundary, as the ``buffers`` setting says; None (the default): the buffers are left alone
            (each rank's BatchNorm statistics then follow its own batches).
        outer_optimizer: with local steps, any torch optimizer built on the same parameters, stepped at each
            combine from the window's start on the pseudo-gradient ``-(combined delta)`` (DiLoCo; default:
            the built-in outer SGD of ``outer_lr``/``outer_momentum``).
        options: an :class:`~adasum.torch.Options`; keywords replace its fields.
        **settings: the fields of :class:`~adasum.torch.Options` (``op``, ``accumulation_steps``,
            ``overlap``, ``compression``, ``local_steps``, ``delay`` …), which says what each one does.

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
            (:attr:`adasum.torch.overlap.engine.OverlapEngine.timeline`); empty without overlap.
    """

    # GradScaler.step(opt) hands scaling over to optimizers that say this; step() then tells the user to
    # pass the scaler to the constructor instead (the scaler's own update would diverge across ranks).
    _step_supports_amp_scaling = True

    def __init__(self, optimizer, *, comm: MPI.Intracomm | None = None, grad_scaler=None, module=None,
                 outer_optimizer: torch.optim.Optimizer | None = None, options: Options | None = None, **settings):
        # torch.optim.Optimizer.__init__ is not called: the wrapped optimizer owns groups, state, defaults.
        if isinstance(optimizer, DistributedOptimizer):
            raise TypeError("optimizer is already a DistributedOptimizer; wrap the torch optimizer only once")
        check_arguments(optimizer)
        opts = self.options = Options.of(options, settings, "DistributedOptimizer")
        comm = check_comm(comm)
        mine = [p for p in (buffers_problem(module, opts.buffers), outer_problem(outer_optimizer, optimizer, opts)) if p]
        opts.raise_problems(comm, "DistributedOptimizer", "; ".join(mine) or None)
        check_launch()  # a job whose processes MPI does not see raises here
        self.optimizer, self.comm, self.grad_scaler = optimizer, comm, grad_scaler
        self._module = module  # kept for rejoin()
        self.outer_optimizer = outer_optimizer  # local steps' outer optimizer, where the user gave one
        wire = Wire(opts.compression)
        self.op, self.compression, self.bucket_bytes, self.start_copy = (
            opts.op, wire.name, opts.bucket_bytes, opts.start_copy)
        self.skip_nonfinite, self.hierarchical = bool(opts.skip_nonfinite), bool(opts.hierarchical)
        self.overlap_requested = bool(opts.overlap)
        self.buffers = opts.buffers if module is not None else None
        self._closed = False
        kept = [] if self.buffers is None else buffers_of(module)
        loss = LossScale(grad_scaler)
        overlap = self._agree(wire, kept, loss)
        self.local_steps, self.outer_lr, self.outer_momentum, self.delay = (
            int(opts.local_steps), float(opts.outer_lr), float(opts.outer_momentum), int(opts.delay))
        self._parts = assemble(self, module, kept, wire, loss, overlap)
        self._steps = Steps(self._parts)

    def rejoin(self, comm: MPI.Intracomm | None = None) -> None:
        """Go on over ``comm`` (default: the current world) after the world shrank
        (:mod:`adasum.torch.elastic`): the lanes of the old communicator are dropped, never waited for, the
        settings are checked again across the new ranks (collective over ``comm``) and the window, counters
        and the Adasum tree start afresh at the new size. The wrapped optimizer and its state are kept; load
        the committed :meth:`state_dict` afterwards to restore the counters."""
        self._check_open("rejoin()")
        parts = self._parts
        if parts.engine is not None:
            parts.engine.drop()
        if parts.local is not None and parts.local.lane is not None:
            parts.local.lane.drop("the world shrank")
        self.comm = check_comm(comm)
        wire, loss = Wire(self.options.compression), LossScale(self.grad_scaler)
        kept = [] if self.buffers is None else buffers_of(self._module)
        overlap = self._agree(wire, kept, loss)
        self._parts = assemble(self, self._module, kept, wire, loss, overlap)
        self._steps = Steps(self._parts)

    def _agree(self, wire: Wire, kept: list[torch.Tensor], loss: LossScale) -> bool:
        """Check every rank's settings, parameters and buffers against the others' (collective; a difference
        raises on every rank); returns whether the boundaries may overlap with backward."""
        # Overlap needs a second thread in MPI; without MPI_THREAD_MULTIPLE every boundary runs in step().
        opts, comm = self.options, self.comm
        overlap = opts.overlap and comm.Get_size() > 1 and MPI.Query_thread() == MPI.THREAD_MULTIPLE
        mine = dict(opts.as_dict(), skip_nonfinite=self.skip_nonfinite, hierarchical=self.hierarchical,
                    grad_scaler=loss.enabled, overlap=overlap, compression=str(wire.dtype), buffers=self.buffers,
                    buffer_count=len(kept), overlap_requested=self.overlap_requested,
                    outer_optimizer=describe_outer(self.outer_optimizer))
        check_agreement(comm, mine, trained_params(self.optimizer), [(tuple(b.shape), str(b.dtype)) for b in kept])
        return overlap

    # --- the loop ---------------------------------------------------------------------------------------------

    def step(self, closure: Callable[[], Any] | None = None):
        """Record one micro-batch; where it closes a window, reduce and update (collective there).

        ``closure`` (forward and backward of this micro-batch, as torch optimizers and Lightning pass it) is
        evaluated first, once, at every call; its loss is returned. The wrapped optimizer then steps
        without it, so optimizers that evaluate the closure several times (LBFGS) are not supported.
        """
        self._check_open("step()")
        if "grad_scale" in self.__dict__ or "found_inf" in self.__dict__:
            self.__dict__.pop("grad_scale", None)
            self.__dict__.pop("found_inf", None)
            raise RuntimeError("DistributedOptimizer was passed to GradScaler.step(); instead give the scaler "
                               "to the constructor (DistributedOptimizer(..., grad_scaler=scaler)) and call "
                               "optimizer.step() directly: the scaler's own update would differ across ranks")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._steps.step()
        return loss

    def force_boundary(self) -> None:
        """Make the next ``step()`` close the window, however few micro-batches it holds (the end of the
        data, before evaluating or saving). Every rank must force the same step."""
        self._check_open("force_boundary()")
        self._steps.force_boundary()

    def flush(self) -> bool:
        """Close and combine what is open, now, without a new micro-batch: the accumulation window (if it
        holds micro-batches), and with local steps the window of local steps (and ``delay=1``'s combine in
        flight). Returns whether it combined anything. Afterwards every rank holds the same parameters.

        For loops that learn only after the last micro-batch that the data ended, and at the end of
        training. Collective, even where nothing is open: the ranks check that they recorded as many
        micro-batches and windows as each other, and a rank that skipped or added a ``step()`` makes every
        rank raise, naming the ranks and their counts.
        """
        self._check_open("flush()")
        return self._steps.flush()

    def no_sync(self):
        """Backward passes inside do not close a window, whatever the count says: their gradients only
        accumulate, and with ``overlap`` no bucket is reduced during them. For frameworks that count the
        micro-batches themselves and call ``step()`` once per window (``accumulation_steps=1``)."""
        self._check_open("no_sync()")
        return self._steps.no_sync()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients, unless a window is open (then the gradients are still accumulating)."""
        self._check_open("zero_grad()")
        self._steps.zero_grad(set_to_none)

    def finalize_gradients(self) -> bool:
        """If the next ``step()`` closes a window, make ``.grad`` what the local step will use, now: divided
        by the window's micro-batch count, unscaled by the ``grad_scaler``, and for ``op="sum"``/``"mean"``
        reduced over the ranks (collective). Returns whether it did; off the boundary it does nothing.

        Call it before clipping or inspecting gradients::

            if optimizer.finalize_gradients():
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
        """
        self._check_open("finalize_gradients()")
        return self._steps.finalize_gradients()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, **kwargs) -> torch.Tensor | None:
        """At a boundary: :meth:`finalize_gradients`, then ``torch.nn.utils.clip_grad_norm_`` over the
        parameters, returning the total norm; off the boundary nothing, returning None.

        With ``op="sum"``/``"mean"`` this clips the reduced gradient (the same norm on every rank), with
        ``op="adasum"`` each rank's own averaged gradient before its local step.
        """
        if not self.finalize_gradients():
            return None
        return torch.nn.utils.clip_grad_norm_(trained_params(self.optimizer), max_norm, norm_type, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict plus one key, ``"adasum"``: the window's micro-batch count and
        forced flag, the boundary and skip counters, the loss-scale growth tracker, and, while a window is
        open, the accumulated gradients (one entry per parameter, None where there is none) and the open
        window of local steps. Per rank: with ``op="adasum"`` the wrapped optimizer's state differs between
        ranks."""
        return state_dicts.state_dict(self._parts, self._steps)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state from :meth:`state_dict`, or a plain state of the wrapped optimizer (the counters then
        start from zero). A state taken inside a window of local steps loads only into the same local-steps
        settings (a ValueError otherwise, before anything changes)."""
        self._check_open("load_state_dict()")
        state_dicts.load_state_dict(self._parts, self._steps, state_dict)

    def _restore_window(self) -> None:
        """After a checkpoint's model (the root rank's) was loaded over a loaded open window: this rank's own
        parameters (local steps) and module buffers again."""
        if self._parts.local is not None:
            self._parts.local.restore_parameters()
        if self._parts.buffers is not None:
            self._parts.buffers.restore()

    # --- what the loop shows ------------------------------------------------------------------------------

    accumulation_steps = property(lambda self: self._parts.window.steps)
    micro_steps = property(lambda self: self._parts.window.seen,
                           doc="Micro-batches recorded in the open window (0 right after a boundary).")
    sync_gradients = property(lambda self: self._parts.window.closes_next,
                              doc="Whether the next ``step()`` closes a window (the moment to clip).")
    is_boundary = property(lambda self: self._steps.is_boundary)
    took_local_step = property(lambda self: self._steps.took_local_step)
    step_was_skipped = property(lambda self: self._steps.step_was_skipped)
    skipped_updates = property(lambda self: self._steps.skipped_updates)
    holds_own_parameters = property(lambda self: self._parts.local is not None and (
        self._parts.local.taken > 0 or self._parts.local.pending), doc="Whether this rank's parameters are "
        "its own, not yet combined (a window of local steps is open, or with ``delay=1`` a combine is on its "
        "way): :meth:`flush` combines them.")

    boundaries = property(lambda self: self._parts.closing.combines,
                          doc="Windows closed with a combine so far (with ``local_steps``: combines).")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the wrapped optimizer. Collective in effect: every rank must add the same shapes
        (the next combine checks it). Inside a window of local steps the group's parameters join the window
        at their first local step."""
        self._check_open("add_param_group()")
        self.optimizer.add_param_group(param_group)
        if self._parts.engine is not None:
            self._parts.engine.install()

    overlap = property(lambda self: self._parts.engine is not None and not self._parts.engine.closed,
                       doc="Whether boundaries may be reduced during backward (False once closed).")

    @property
    def overlap_comm(self) -> MPI.Intracomm | None:
        """The communicator the overlap thread reduces on (a duplicate of ``comm``; None without overlap):
        ``adasum.count_traffic(opt.overlap_comm)`` counts what the overlapped buckets send."""
        return self._parts.engine.comm if self.overlap else None

    overlapped_boundaries = property(lambda self: _engine_attr(self, "overlapped_boundaries", 0))
    buckets_started_in_backward = property(lambda self: _engine_attr(self, "buckets_started_in_backward", 0))
    timeline = property(lambda self: list(_engine_attr(self, "timeline", [])))

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
            if combine and self._parts.local is not None:
                self.flush()
        finally:
            self._closed = True
            if self.overlap:
                self._parts.engine.finish()
                self._parts.engine.close()
            if self._parts.local is not None:
                self._parts.local.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"rank {self.comm.Get_rank()}: {what} after close(): this DistributedOptimizer "
                               "was closed; make a new one (its state_dict() still works)")

    def __repr__(self) -> str:
        return (f"DistributedOptimizer(op={self.op!r}, accumulation_steps={self.accumulation_steps}, "
                f"overlap={self.overlap}, compression={self.compression!r}, size={self.comm.Get_size()}, "
                f"optimizer={self.optimizer!r})")


def _engine_attr(opt: DistributedOptimizer, name: str, default):
    """An attribute of ``opt``'s overlap engine, or ``default`` without one."""
    engine = opt._parts.engine
    return default if engine is None else getattr(engine, name)
