"""Horovod's torch API, mapped onto this library, so that a script written for ``horovod.torch`` runs after
changing only its import::

    import adasum.horovod as hvd     # was: import horovod.torch as hvd

    hvd.init()
    torch.cuda.set_device(hvd.local_rank())
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), op=hvd.Adasum,
                                   backward_passes_per_step=2, compression=hvd.Compression.fp16)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)

Every name maps onto the library's own API and adds no behaviour of its own. Where the meaning differs from
Horovod's:

- ``Adasum`` runs at any number of ranks (Horovod's needs a power of two), combining with the size-weighted
  tree described in the README; at a power of two it is the same tree.
- ``DistributedOptimizer`` is :class:`adasum.torch.DistributedOptimizer`. As in Horovod, the script calls
  ``step()`` once after ``backward_passes_per_step`` backward passes, whose gradients add up in ``.grad``
  (they are not divided by that count). ``overlap=True`` (a keyword passed on to the library's optimizer)
  takes effect only when ``backward_passes_per_step`` is 1: the library cannot tell which backward is the
  last one before ``step()``. ``named_parameters`` is only checked against the optimizer's parameters; the other Horovod
  arguments (``gradient_predivide_factor``, ``groups``, ``process_set``, ``sparse_as_dense``) are not
  supported and raise if given a non-default value.
- ``Compression.fp16`` sends 16-bit values and combines them in float32 (Horovod compresses only the
  allreduce's buffer; here Adasum's dot products also run on what arrived).
- There is no background negotiation: every rank must call the collectives in the same order, as in MPI.
"""

from __future__ import annotations

import torch
from mpi4py import MPI

from . import world
from .allreduce import adasum_allreduce, adasum_allreduce_inplace
from .torch import DistributedOptimizer as _DistributedOptimizer
from .torch import broadcast_optimizer_state as _broadcast_optimizer_state
from .torch import broadcast_parameters as _broadcast_parameters

__all__ = ["init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank", "Adasum",
           "Average", "Sum", "Compression", "DistributedOptimizer", "broadcast_parameters",
           "broadcast_optimizer_state", "allreduce", "allreduce_"]

Adasum = "adasum"
Average = "mean"
Sum = "sum"


class Compression:
    """Horovod's compression choices: ``none`` (full precision) and ``fp16``; ``bf16`` is this library's."""

    none = None
    fp16 = "fp16"
    bf16 = "bf16"


def init(comm=None) -> None:
    """MPI is initialised when mpi4py is imported; only ``comm=None`` (``MPI.COMM_WORLD``) is supported."""
    if comm is not None:
        raise ValueError("adasum.horovod.init supports only the whole world (comm=None); pass comm= to "
                         "adasum's own API for sub-communicators")


def shutdown() -> None:
    """Nothing to do: mpi4py finalises MPI at exit."""


def is_initialized() -> bool:
    return MPI.Is_initialized() and not MPI.Is_finalized()


def size() -> int:
    return world.size()


def rank() -> int:
    return world.rank()


def local_size() -> int:
    return world.local_size()


def local_rank() -> int:
    return world.local_rank()


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step: int = 1, op=Average, gradient_predivide_factor: float = 1.0,
                         groups=None, sparse_as_dense: bool = False, process_set=None, **kwargs):
    """:class:`adasum.torch.DistributedOptimizer` with ``op``, ``compression`` and, since the script calls
    ``step()`` once per ``backward_passes_per_step`` backward passes, ``accumulation_steps=1`` (the
    passes' gradients add up in ``.grad`` as in Horovod). Extra keyword arguments go to the library's
    optimizer (``overlap=``, ``bucket_bytes=``, …)."""
    if gradient_predivide_factor != 1.0 or groups is not None or sparse_as_dense or process_set is not None:
        raise ValueError("adasum.horovod.DistributedOptimizer does not support gradient_predivide_factor, "
                         "groups, sparse_as_dense or process_set")
    if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
            or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be a positive integer, got {backward_passes_per_step!r}")
    if named_parameters is not None:
        named = {id(p) for _, p in named_parameters}
        mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
        if not mine <= named:
            raise ValueError("named_parameters does not name every parameter of the optimizer")
    if backward_passes_per_step > 1:
        kwargs["overlap"] = False
    return _DistributedOptimizer(optimizer, op=op, compression=compression, **kwargs)


def broadcast_parameters(params, root_rank: int) -> None:
    """``params``: a ``state_dict()``, ``named_parameters()`` or a list of tensors; in place."""
    _broadcast_parameters(params, root=root_rank)


def broadcast_optimizer_state(optimizer, root_rank: int) -> None:
    _broadcast_optimizer_state(optimizer, root=root_rank)


def allreduce(tensor: torch.Tensor, average=None, name=None, compression=Compression.none, op=None):
    """A new tensor: ``op`` (default ``Average``) over every rank. ``name`` is accepted and unused."""
    op = _op(average, op)
    if compression is None:
        return adasum_allreduce(tensor, op=op)
    wire = tensor.to(torch.float16 if compression == Compression.fp16 else torch.bfloat16)
    adasum_allreduce_inplace(wire, op=op)
    return wire.to(tensor.dtype)


def allreduce_(tensor: torch.Tensor, average=None, name=None, op=None):
    """In place: ``op`` (default ``Average``) over every rank; returns ``tensor``."""
    return adasum_allreduce_inplace(tensor, op=_op(average, op))


def _op(average, op):
    if average is not None:
        if op is not None:
            raise ValueError("pass either average= or op=, not both")
        return Average if average else Sum
    return Average if op is None else op
