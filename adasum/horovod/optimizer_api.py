"""Horovod's ``DistributedOptimizer``, ``broadcast_parameters`` and ``broadcast_optimizer_state`` on this
library's :class:`adasum.torch.DistributedOptimizer`."""

from __future__ import annotations

import contextlib
import warnings

import torch
from mpi4py import MPI

from ..runtime import exchange, world
from ..torch import DistributedOptimizer as _DistributedOptimizer
from ..torch import broadcast_optimizer_state as _broadcast_optimizer_state
from ..torch import broadcast_parameters as _broadcast_parameters
from ..torch.window.tensors import trained_params
from .basics import Average, Compression, wire_of
from .process_sets import resolve
from .sparse import SparseGradients, hidden

__all__ = ["DistributedOptimizer", "broadcast_parameters", "broadcast_optimizer_state"]

SYNCHRONIZE_WARNING = ("optimizer.step() called without optimizer.skip_synchronize() context after "
                       "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
                       "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in your code.")


def _names(optimizer, named_parameters) -> tuple[dict, str | None]:
    """({parameter: name}, None), or (_, why ``named_parameters`` is refused), as Horovod checks it."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if named_parameters is None:
        return {p: f"allreduce.noname.{i}.{j}" for i, g in enumerate(optimizer.param_groups)
                for j, p in enumerate(g["params"])}, None
    named = list(named_parameters)
    if any(not isinstance(item, tuple) or len(item) != 2 for item in named):
        return {}, "named_parameters must be (name, parameter) pairs, as model.named_parameters() gives"
    names = [n for n, _ in named]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        return {}, f"parameter names in named_parameters must be unique; found duplicates: {duplicates}"
    by_param = {p: n for n, p in named}
    unnamed = [i for i, p in enumerate(params) if p not in by_param]
    if unnamed:
        return {}, (f"named_parameters does not name every parameter of the optimizer: {len(unnamed)} of "
                    f"{len(params)} are missing (positions {unnamed[:8]}{'...' if len(unnamed) > 8 else ''})")
    return {p: by_param[p] for p in params}, None


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step: int = 1, op=Average, gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0, groups=None, sparse_as_dense: bool = False, process_set=None,
                         **kwargs):
    """:class:`adasum.torch.DistributedOptimizer` with ``op``, ``compression`` and, since the script calls
    ``step()`` once per ``backward_passes_per_step`` backward passes, ``accumulation_steps=1`` (the
    passes' gradients add up in ``.grad`` as in Horovod). Collective over the process set (default: the
    world); on a rank outside ``process_set`` it steps on the rank's own gradients, as in Horovod.
    ``named_parameters`` is checked as Horovod checks it (unique names, every parameter named: ValueError on
    every rank). ``num_groups`` is accepted and unused. Extra keyword arguments go to the library's
    optimizer (``overlap=``, ``bucket_bytes=``, ...).

    Sparse gradients (``nn.Embedding(sparse=True)``) are reduced as Horovod reduces them, with ``op=Sum``
    or ``Average``: every rank's rows gathered and summed (averaged), or with ``sparse_as_dense=True`` made
    dense, reduced and made sparse again (:mod:`.sparse`); with ``op=Adasum`` each rank's local step takes
    its own sparse gradient. They are reduced in ``step()`` (or ``synchronize()``): with ``overlap=True``
    a sparse gradient fails the step on every rank."""
    ps = resolve(process_set)
    comm = ps.comm() if ps.included() else MPI.COMM_SELF
    names, problem = _names(optimizer, named_parameters)
    wire, refused = wire_of(compression)
    problem = problem or refused
    if problem is None and (gradient_predivide_factor != 1.0 or groups is not None):
        problem = "gradient_predivide_factor and groups are not supported"
    if problem is None and (isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int)
                            or backward_passes_per_step < 1):
        problem = f"backward_passes_per_step must be a positive integer, got {backward_passes_per_step!r}"
    exchange.raise_everywhere(comm, None if problem is None else f"rank {world.rank()}: {problem}",
                              what="DistributedOptimizer's arguments")
    if backward_passes_per_step > 1:
        kwargs["overlap"] = False
    opt = _HorovodOptimizer(optimizer, op=op, compression=wire, comm=comm, **kwargs)
    opt.__dict__["_parameter_names"] = names
    local = opt.options.uses_local_steps
    opt.__dict__["_sparse"] = SparseGradients(None if local else ps, comm, opt.op, wire, sparse_as_dense, names)
    opt.__dict__["_sparse_of"] = lambda new: SparseGradients(None if local else ps, new, opt.op, wire,
                                                             sparse_as_dense, names)
    opt.__dict__["_process_set"] = ps
    return opt


class _HorovodOptimizer(_DistributedOptimizer):
    """:class:`adasum.torch.DistributedOptimizer` with Horovod's ``synchronize()`` and
    ``skip_synchronize()``, for Horovod's clipping pattern::

        loss.backward()
        optimizer.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        with optimizer.skip_synchronize():
            optimizer.step()

    ``synchronize()`` is :meth:`~adasum.torch.DistributedOptimizer.finalize_gradients`: with ``op=Sum`` or
    ``Average`` it reduces the gradients over the ranks into ``.grad`` (collective), so the clipping sees the
    reduced gradient, the same on every rank. With ``op=Adasum`` the ranks reduce the weight deltas of their
    local steps, not the gradients: ``synchronize()`` communicates nothing and the clipping applies to each
    rank's own gradient before its local step; ``step()`` then combines the clipped ranks' deltas with
    Adasum. ``step()`` never reduces the gradients twice; as in Horovod, ``step()`` after ``synchronize()``
    outside ``skip_synchronize()`` warns.
    """

    def rejoin(self, comm=None) -> None:
        """:meth:`adasum.torch.DistributedOptimizer.rejoin` on the new world (an optimizer of the whole
        world only: a process set's communicators are gone with the old world)."""
        ps = self.__dict__.get("_process_set")
        if ps is not None and ps.process_set_id != 0:
            raise ValueError(f"rank {world.rank()}: a DistributedOptimizer of the process set {ps.ranks} cannot "
                             "go on after the world shrank; make a new one on a process set of the new world")
        super().rejoin(comm)
        self.__dict__["_sparse"] = self.__dict__["_sparse_of"](self.comm)

    def synchronize(self) -> None:
        """Make ``.grad`` what the local step will use: reduced over the ranks for ``op=Sum``/``Average``
        (collective), each rank's own for ``op=Adasum``."""
        try:
            sparse = self._sparse_reduced()
            with hidden(sparse):
                self.finalize_gradients()
        except BaseException:
            self.__dict__.pop("_sparse_done", None)
            raise
        self.__dict__["_synchronized"] = True

    def _sparse_reduced(self) -> list:
        """The parameters whose sparse gradients are reduced (collective where this boundary's are not yet)."""
        if "_sparse_done" not in self.__dict__:
            self.__dict__["_sparse_done"] = self.__dict__["_sparse"].reduce(trained_params(self.optimizer),
                                                                            self.skip_nonfinite)
        return self.__dict__["_sparse_done"]

    @contextlib.contextmanager
    def skip_synchronize(self):
        """A context for ``step()`` after ``synchronize()``: ``step()`` does not reduce the gradients again
        (it never does) and does not warn."""
        self.__dict__["_skipping"] = True
        try:
            yield
        finally:
            self.__dict__["_skipping"] = False

    def step(self, closure=None):
        if self.__dict__.get("_synchronized") and not self.__dict__.get("_skipping"):
            warnings.warn(SYNCHRONIZE_WARNING)
        self.__dict__["_synchronized"] = False
        loss = None
        if closure is not None:  # its backward first: the sparse gradients it makes are reduced below
            with torch.enable_grad():
                loss = closure()
        try:
            with hidden(self._sparse_reduced()):
                super().step()
        finally:
            self.__dict__.pop("_sparse_done", None)
        return loss


def broadcast_parameters(params, root_rank: int, prefix=None) -> None:
    """``params``: a ``state_dict()``, ``named_parameters()`` or a list of tensors; in place, from
    ``root_rank`` over the world. ``prefix`` is accepted and unused."""
    _broadcast_parameters(params, root=root_rank)


def broadcast_optimizer_state(optimizer, root_rank: int, model=None) -> None:
    """``root_rank``'s optimizer state (hyperparameters and per-parameter state) on every rank. As in
    Horovod, where the optimizer has no state yet, every parameter that requires a gradient and has none
    gets a zero ``.grad`` first (the optimizer does not step). ``model`` is accepted and unused."""
    inner = optimizer.optimizer if isinstance(optimizer, _DistributedOptimizer) else optimizer
    if not inner.state_dict()["state"]:
        with torch.no_grad():
            for group in inner.param_groups:
                for p in group["params"]:
                    if p.requires_grad and p.grad is None:
                        p.grad = torch.zeros_like(p)
    _broadcast_optimizer_state(optimizer, root=root_rank)
