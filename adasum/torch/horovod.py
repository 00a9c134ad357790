"""Horovod's torch API, mapped onto this library, so that a script written for ``horovod.torch`` runs after
changing only its import::

    import adasum.horovod as hvd     # was: import horovod.torch as hvd

    hvd.init()
    torch.cuda.set_device(hvd.local_rank())
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), op=hvd.Adasum,
                                   backward_passes_per_step=2, compression=hvd.Compression.fp16)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)

Every name maps onto the library's own API. The world is ``MPI.COMM_WORLD``. Where the meaning differs
from Horovod's:

- ``Adasum`` runs at any number of ranks (Horovod's needs a power of two), combining with the size-weighted
  tree described in docs/semantics.md; at a power of two it is the same tree.
- ``DistributedOptimizer`` is :class:`adasum.torch.DistributedOptimizer` with Horovod's ``synchronize()``
  and ``skip_synchronize()``. As in Horovod, the script calls ``step()`` once after
  ``backward_passes_per_step`` backward passes, whose gradients add up in ``.grad`` (they are not divided
  by that count). ``overlap=True`` (a keyword passed on to the library's optimizer) takes effect only when
  ``backward_passes_per_step`` is 1: the library cannot tell which backward is the last one before
  ``step()``. ``named_parameters`` is only checked against the optimizer's parameters; the other Horovod
  arguments (``gradient_predivide_factor``, ``groups``, ``process_set``, ``sparse_as_dense``) are not
  supported and raise if given a non-default value.
- ``Compression.fp16`` sends 16-bit values, scaled by a power of two that every rank agrees on, and
  combines them in float32 (for Adasum the dot products also run on what arrived): half the bytes of
  float32 on the wire.
- There is no background negotiation: every rank must call the collectives in the same order, as in MPI.
  Each collective here first checks, in one small exchange, that the ranks passed the same op, dtype and
  shape (and whether they track gradients), and raises ``ValueError`` on every rank where they did not.
- Gradients through ``allreduce``, ``allgather`` and ``broadcast`` are those of the sum over the ranks of
  each rank's loss; every rank must run backward through the result when any does.
- Not provided (they raise ``NotImplementedError`` saying so): asynchronous calls and handles,
  ``alltoall``, ``reducescatter``, grouped collectives, sparse allreduce and process sets.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np
import torch
from mpi4py import MPI

from ..runtime import exchange, world
from ..call.allreduce import adasum_allreduce
from ..runtime.context import check_root
from .compress import Wire
from . import DistributedOptimizer as _DistributedOptimizer
from . import broadcast_optimizer_state as _broadcast_optimizer_state
from . import broadcast_parameters as _broadcast_parameters

__all__ = ["init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank", "cross_rank",
           "cross_size", "Adasum", "Average", "Sum", "Min", "Max", "Product", "Compression",
           "DistributedOptimizer", "broadcast_parameters", "broadcast_optimizer_state", "allreduce", "allreduce_",
           "allgather", "broadcast", "broadcast_", "broadcast_object", "allgather_object", "barrier", "join",
           "mpi_built", "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built",
           "mpi_threads_supported", "mpi_enabled", "gloo_enabled"]

Adasum = "adasum"
Average = "mean"
Sum = "sum"
Min = "min"
Max = "max"
Product = "product"

_MPI_OPS = {Min: MPI.MIN, Max: MPI.MAX, Product: MPI.PROD}
_OPS = (Adasum, Average, Sum, *_MPI_OPS)


class Compression:
    """Horovod's compression choices: ``none`` (full precision) and ``fp16``; ``bf16`` is this library's.
    Either 16-bit choice sends half the bytes of float32 (see :class:`adasum.torch.compress.Wire`)."""

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


def cross_rank() -> int:
    """The index of this rank's node (nodes ordered by their lowest rank; a node is the ranks that share
    memory, as for :func:`local_rank`). Collective the first time, as ``local_rank()``."""
    return world.node_rank()


def cross_size() -> int:
    """The number of nodes. Collective the first time, as ``local_rank()``."""
    return world.node_count()


# --- what this library is built with ------------------------------------------------------------------------

def mpi_built() -> bool:
    """True: every collective here runs over MPI (mpi4py)."""
    return True


def mpi_enabled() -> bool:
    """True: MPI is the only controller and transport."""
    return True


def mpi_threads_supported() -> bool:
    """Whether MPI was initialised with ``MPI_THREAD_MULTIPLE`` (needed for ``overlap=True``)."""
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def gloo_built() -> bool:
    """False: there is no Gloo controller (``adasum.torch.init_process_group`` sets up torch's own)."""
    return False


def gloo_enabled() -> bool:
    """False: there is no Gloo controller."""
    return False


def nccl_built() -> bool:
    """False: CUDA tensors are reduced over MPI, never through NCCL."""
    return False


def ddl_built() -> bool:
    """False: IBM DDL is not used."""
    return False


def ccl_built() -> bool:
    """False: oneCCL is not used."""
    return False


def cuda_built() -> bool:
    """Whether CUDA tensors can be reduced here: true where torch was built with CUDA (the library reduces
    them on the device and sends them over MPI)."""
    return torch.version.cuda is not None


def rocm_built() -> bool:
    """Whether torch was built for ROCm (its GPU tensors take the same path as CUDA's)."""
    return getattr(torch.version, "hip", None) is not None


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
    return _HorovodOptimizer(optimizer, op=op, compression=compression, **kwargs)


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
    Adasum. ``step()`` never reduces the gradients twice, inside ``skip_synchronize()`` or not, and reduces
    them as usual where ``synchronize()`` was not called.
    """

    def synchronize(self) -> None:
        """Make ``.grad`` what the local step will use: reduced over the ranks for ``op=Sum``/``Average``
        (collective), each rank's own for ``op=Adasum``."""
        self.finalize_gradients()

    @contextlib.contextmanager
    def skip_synchronize(self):
        """A context for ``step()`` after ``synchronize()``; ``step()`` does not reduce the gradients
        again (it never does), so this only marks the pattern."""
        yield


def broadcast_parameters(params, root_rank: int) -> None:
    """``params``: a ``state_dict()``, ``named_parameters()`` or a list of tensors; in place."""
    _broadcast_parameters(params, root=root_rank)


def broadcast_optimizer_state(optimizer, root_rank: int) -> None:
    _broadcast_optimizer_state(optimizer, root=root_rank)



def broadcast_object(obj, root_rank: int = 0, name=None):
    """``root_rank``'s ``obj`` (pickled) on every rank. ``name`` is accepted and unused."""
    root = check_root(MPI.COMM_WORLD, root_rank, "root_rank")
    return exchange.bcast(MPI.COMM_WORLD, obj, root=root, what="broadcast_object")


def allgather_object(obj, name=None) -> list:
    """Every rank's ``obj`` (pickled), in rank order. ``name`` is accepted and unused."""
    everyone = exchange.allgather(MPI.COMM_WORLD, obj, what="allgather_object")
    return everyone


def barrier() -> None:
    """Return once every rank has called ``barrier()``."""
    exchange.any_true(MPI.COMM_WORLD, False, what="barrier")


def join(device=-1) -> int:
    """Wait until every rank has called ``join()``; returns the rank that called it last (the one that
    waited least), the same on every rank. ``device`` is accepted and unused.

    Horovod's ``join`` lets a rank that ran out of data stop early: a background thread answers the other
    ranks' allreduces with zeros until they join too. There is no background thread here, so a rank that
    joins takes part in no later collective: every rank must have made the same collective calls before
    calling ``join()``. Uneven data has to be evened out first (the same number of steps on every rank).
    Where a rank calls ``join()`` while another is in any other collective of the library, every rank
    raises at once (the agreement carries the kind of call), naming both calls and saying that uneven data
    is not supported.
    """
    start = time.monotonic()
    exchange.any_true(MPI.COMM_WORLD, False, what="join")
    waited = time.monotonic() - start
    waits = exchange.allgather(MPI.COMM_WORLD, waited, what="join's waiting times")
    return int(np.argmin(waits))


# --- tensor collectives ---------------------------------------------------------------------------------------

def allreduce(tensor: torch.Tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set=None) -> torch.Tensor:
    """A new tensor: ``op`` over every rank, of ``tensor`` multiplied by ``prescale_factor``, the result
    multiplied by ``postscale_factor``. ``name`` is accepted and unused.

    ``op``: ``Average`` (the default), ``Sum``, ``Adasum`` (the library's), or ``Min``, ``Max``,
    ``Product`` (MPI's own reduction of the values; 16-bit floats travel as float32, booleans as bytes).
    ``compression``: ``Compression.fp16`` (or ``bf16``) sends floating tensors as 16-bit values, half the
    bytes of float32, with ``Sum``, ``Average`` and ``Adasum``; the result has ``tensor``'s dtype.

    Differentiable with ``Sum`` and ``Average``: the backward is the same allreduce of the incoming
    gradient (the gradient of the sum over the ranks of each rank's loss); every rank must run it.
    ``Adasum``, ``Min``, ``Max`` and ``Product`` raise where ``tensor`` requires a gradient: Adasum's
    coefficients depend on every rank's tensor, and its gradient is not the Adasum of the gradients.
    """
    op, error = _parse(average, op, compression, tensor, process_set)
    grad = torch.is_grad_enabled() and isinstance(tensor, torch.Tensor) and tensor.requires_grad
    if error is None and grad and op not in (Sum, Average):
        error = (f"allreduce with op={op!r} has no gradient here (only Sum and Average do): detach the "
                 "tensor or use Sum/Average")
    _agree("allreduce", _describe(tensor, op=op, compression=compression, grad=grad), error)
    return _Allreduce.apply(tensor, op, compression, float(prescale_factor), float(postscale_factor))


def allreduce_(tensor: torch.Tensor, average=None, name=None, op=None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0, process_set=None) -> torch.Tensor:
    """In place: :func:`allreduce` without compression, written into ``tensor``, which it returns."""
    with torch.no_grad():
        # a non-tensor goes on to allreduce, which refuses it on every rank
        out = allreduce(_detached(tensor), average, name, Compression.none, op, prescale_factor,
                        postscale_factor, process_set)
        tensor.copy_(out)
    return tensor


def allgather(tensor: torch.Tensor, name=None, process_set=None) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along dimension 0, in rank order; the ranks may differ in the
    size of dimension 0, not in the other dimensions or the dtype. Differentiable: rank ``r``'s gradient is
    the sum over the ranks of the incoming gradient's rows of rank ``r``."""
    _unsupported_process_set(process_set)
    problem = _not_a_tensor(tensor)
    grad = problem is None and torch.is_grad_enabled() and tensor.requires_grad
    mine = tensor.detach().to("cpu").contiguous() if problem is None else None
    parts = exchange.allgather(MPI.COMM_WORLD, (problem, mine if mine is not None and mine.dim() else None, grad),
                               what="allgather")
    me = rank()
    problems = [f"rank {r}: {p}" for r, (p, _, _) in enumerate(parts) if p is not None]
    if problems:
        exchange.raise_found(me, "allgather: " + "; ".join(problems))
    parts = [(p, g) for _, p, g in parts]
    if any(p is None for p, _ in parts):
        exchange.raise_found(me, "allgather needs tensors of at least one dimension; 0-d on "
                                 f"rank(s) {[r for r, (p, _) in enumerate(parts) if p is None]}")
    first = parts[0][0]
    differ = [f"rank {r}: {p.dtype}, {tuple(p.shape)}, requires_grad={g}" for r, (p, g) in enumerate(parts)
              if p.dtype != first.dtype or p.shape[1:] != first.shape[1:] or g != parts[0][1]]
    if differ:
        exchange.raise_found(me, "allgather: the ranks differ in dtype, trailing shape or requires_grad; "
                                 f"rank 0: {first.dtype}, {tuple(first.shape)}, requires_grad={parts[0][1]}; "
                                 + "; ".join(differ))
    out = torch.cat([p for p, _ in parts]).to(tensor.device)
    return _Allgather.apply(tensor, out, [p.shape[0] for p, _ in parts])


def broadcast(tensor: torch.Tensor, root_rank: int, name=None, process_set=None) -> torch.Tensor:
    """A new tensor holding ``root_rank``'s ``tensor`` on every rank (the ranks pass the same shape and
    dtype). Differentiable: the root's gradient is the sum over the ranks of the incoming gradient, the
    other ranks' is zero."""
    _unsupported_process_set(process_set)
    problem = _not_a_tensor(tensor)
    grad = problem is None and torch.is_grad_enabled() and tensor.requires_grad
    _agree("broadcast", _describe(tensor, root_rank=root_rank, grad=grad), problem or _root_problem(root_rank))
    return _Broadcast.apply(tensor, root_rank)


def broadcast_(tensor: torch.Tensor, root_rank: int, name=None, process_set=None) -> torch.Tensor:
    """In place: ``root_rank``'s ``tensor`` written into every rank's ``tensor``, which it returns."""
    with torch.no_grad():
        out = broadcast(_detached(tensor), root_rank, process_set=process_set)  # refuses a non-tensor everywhere
        tensor.copy_(out)
    return tensor


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, compression, prescale, postscale):
        ctx.args = (op, compression, prescale, postscale)
        return _reduce(tensor.detach(), op, compression, prescale, postscale)

    @staticmethod
    def backward(ctx, grad):
        return _reduce(grad, *ctx.args), None, None, None, None


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, out, rows):
        ctx.rows = rows
        return out

    @staticmethod
    def backward(ctx, grad):
        start = sum(ctx.rows[:rank()])
        summed = _reduce(grad, Sum, None, 1.0, 1.0)
        return summed[start:start + ctx.rows[rank()]], None, None


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank):
        ctx.root = root_rank
        out = tensor.detach().to("cpu").contiguous().clone()
        raw = out.reshape(-1).view(torch.uint8).numpy()
        exchange.bcast_buffer(MPI.COMM_WORLD, raw, root=root_rank, what="broadcast")
        return out.to(tensor.device)

    @staticmethod
    def backward(ctx, grad):
        summed = _reduce(grad, Sum, None, 1.0, 1.0)
        return (summed if rank() == ctx.root else torch.zeros_like(summed)), None


_WIRES = {name: Wire(name) for name in ("fp16", "bf16")}


def _reduce(tensor: torch.Tensor, op: str, compression, prescale: float, postscale: float) -> torch.Tensor:
    """``op`` of ``tensor`` over the world, as a new tensor (no check of the arguments: :func:`allreduce`).
    The result has ``tensor``'s dtype: as in Horovod, integer tensors are scaled in float64 and cast back
    (toward zero), and their ``Average`` is their sum divided by the size, cast back the same way."""
    if prescale != 1.0:
        tensor = _scaled(tensor, prescale)
    if op in _MPI_OPS:
        out = _mpi_reduce(tensor, op)
    elif compression is None and op == Average and _integral(tensor):
        return _scaled(adasum_allreduce(tensor, op=Sum), postscale, size())
    elif compression is None:
        out = adasum_allreduce(tensor, op=op)
    else:
        out = tensor.detach().clone()
        wire = _WIRES[compression]
        if op == Adasum:
            wire.adasum_([out], MPI.COMM_WORLD, names=["allreduce"])
        else:
            wire.sum_([out], MPI.COMM_WORLD, mean=op == Average, names=["allreduce"])
    return _scaled(out, postscale) if postscale != 1.0 else out


def _integral(tensor: torch.Tensor) -> bool:
    return not (tensor.is_floating_point() or tensor.is_complex())


def _scaled(tensor: torch.Tensor, factor: float, divisor: int = 1) -> torch.Tensor:
    """``tensor`` divided by ``divisor`` and multiplied by ``factor``, in ``tensor``'s dtype: integers (and
    booleans) through float64, cast back toward zero, as Horovod scales them."""
    if _integral(tensor):
        return (tensor.to(torch.float64) / divisor * factor).to(tensor.dtype)
    return tensor / divisor * factor if divisor != 1 else tensor * factor


def _mpi_reduce(tensor: torch.Tensor, op: str) -> torch.Tensor:
    """MPI's MIN, MAX or PROD of ``tensor`` over the world: a nonblocking allreduce waited through the stall
    inspector, counted as ``allreduce_bytes``."""
    wide = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.bool: torch.uint8}
    send = tensor.detach().to("cpu", wide.get(tensor.dtype, tensor.dtype)).contiguous().numpy()
    recv = np.empty_like(send)
    with exchange.call_on(MPI.COMM_WORLD, f"allreduce ({op})") as call:
        req = call.lcomm.Iallreduce(send, recv, op=_MPI_OPS[op])
        exchange.wait(call, req, f"allreduce ({op})", send.nbytes, field="allreduce_bytes")
    return torch.from_numpy(recv).to(tensor.device, tensor.dtype)


def _parse(average, op, compression, tensor, process_set) -> tuple[str | None, str | None]:
    """(the op, None), or (None, why the arguments are refused)."""
    if process_set is not None:
        return None, "process sets are not supported: every collective runs on the whole world"
    if not isinstance(tensor, torch.Tensor):
        return None, f"expected a torch.Tensor, got {type(tensor).__name__}"
    if average is not None:
        if op is not None:
            return None, "pass either average= or op=, not both"
        op = Average if average else Sum
    op = Average if op is None else op
    if op not in _OPS:
        return None, f"op must be one of Average, Sum, Adasum, Min, Max, Product, got {op!r}"
    if compression not in (None, Compression.fp16, Compression.bf16):
        return None, f"compression must be Compression.none, fp16 or bf16, got {compression!r}"
    if compression is not None and (op in _MPI_OPS or not tensor.is_floating_point()):
        return None, (f"compression applies to floating tensors with Sum, Average or Adasum, not "
                      f"{tensor.dtype} with op={op!r}")
    if op in (Min, Max) and tensor.is_complex():
        return None, f"op={op!r} is not defined for the complex dtype {tensor.dtype}"
    return op, None


def _describe(tensor, **what) -> dict:
    if isinstance(tensor, torch.Tensor):
        what.update(dtype=str(tensor.dtype), shape=tuple(tensor.shape))
    return what


def _agree(what: str, mine: dict, error: str | None = None) -> None:
    """Collective: raise ValueError on every rank where any rank reports ``error`` or the ranks' ``mine``
    differ (one small exchange, waited through the stall inspector)."""
    everyone = exchange.allgather(MPI.COMM_WORLD, (error, mine), what=what)
    me = rank()
    errors = [f"rank {r}: {e}" for r, (e, _) in enumerate(everyone) if e]
    if errors:
        exchange.raise_found(me, f"{what}: " + "; ".join(errors))
    first = everyone[0][1]
    differ = [f"rank {r} has {d}" for r, (_, d) in enumerate(everyone) if d != first]
    if differ:
        exchange.raise_found(me, f"{what}: the ranks disagree: rank 0 has {first}; " + "; ".join(differ))


def _not_a_tensor(tensor) -> str | None:
    """Why ``tensor`` cannot be a collective's argument (it is not a torch tensor), or None."""
    if isinstance(tensor, torch.Tensor):
        return None
    return f"the tensor argument is a {type(tensor).__module__}.{type(tensor).__qualname__}, not a torch.Tensor"


def _detached(tensor):
    return tensor.detach() if isinstance(tensor, torch.Tensor) else tensor


def _root_problem(root_rank) -> str | None:
    """Why ``root_rank`` is not a rank of the world, or None."""
    try:
        check_root(MPI.COMM_WORLD, root_rank, "root_rank")
    except ValueError as exc:
        return str(exc)
    return None


def _unsupported_process_set(process_set) -> None:
    if process_set is not None:
        raise NotImplementedError("process sets are not supported: every collective runs on the whole world")


# --- what is not provided -------------------------------------------------------------------------------------

def _not_provided(name: str, why: str):
    def call(*args, **kwargs):
        raise NotImplementedError(f"adasum.horovod.{name} is not provided: {why}")

    call.__name__ = name
    call.__doc__ = f"Not provided: raises NotImplementedError ({why})."
    return call


_SYNC_ONLY = "every call here is synchronous (no background thread); call the synchronous form"
for _name in ("allreduce_async", "allreduce_async_", "allgather_async", "broadcast_async", "broadcast_async_",
              "poll", "synchronize"):
    globals()[_name] = _not_provided(_name, _SYNC_ONLY)
for _name in ("alltoall", "alltoall_async", "reducescatter", "reducescatter_async"):
    globals()[_name] = _not_provided(_name, "only allreduce, allgather and broadcast are implemented")
for _name in ("grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async", "grouped_allgather",
              "grouped_reducescatter"):
    globals()[_name] = _not_provided(_name, "call allreduce (or adasum.adasum_allreduce with a list of "
                                            "tensors) for each group")
for _name in ("sparse_allreduce_async",):
    globals()[_name] = _not_provided(_name, "sparse tensors are not supported")
for _name in ("add_process_set", "remove_process_set", "ProcessSet"):
    globals()[_name] = _not_provided(_name, "process sets are not supported: every collective runs on the "
                                            "whole world")
del _name
