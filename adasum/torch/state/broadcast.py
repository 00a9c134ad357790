"""Making every rank start identical: parameters and optimizer state copied from a root rank.

Both calls are collective: every rank of ``comm`` calls them with the same root. Mismatches (a tensor
missing, a shape or dtype that differs from the root's) raise the same error on every rank before any
data moves.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch
from mpi4py import MPI

from ...runtime import exchange
from ...runtime.context import check_comm, check_root
from ...runtime.exchange import raise_everywhere

__all__ = ["broadcast_parameters", "broadcast_optimizer_state"]


def broadcast_parameters(params, *, root: int = 0, comm: MPI.Intracomm | None = None) -> None:
    """Overwrite, in place on every rank, ``params`` with the root rank's values.

    ``params`` is a ``torch.nn.Module`` (its ``state_dict()``: parameters and buffers), a mapping of names
    to tensors, an iterable of ``(name, tensor)`` pairs (``model.named_parameters()``) or of tensors. All
    tensors travel in one broadcast of their bytes, whatever their dtypes and devices.
    """
    comm, rank = _comm_and_rank(comm, root)
    items = _named_tensors(params)
    desc = [(name, tuple(t.shape), str(t.dtype)) for name, t in items]
    root_desc = exchange.bcast(comm, desc if rank == root else None, root=root, what="the broadcast's tensors")
    raise_everywhere(comm, _difference(desc, root_desc, rank, root))

    # Each tensor starts at a multiple of 16 bytes so that its slice can be viewed as its own dtype.
    spans, end = [], 0
    for _, t in items:
        n = t.numel() * t.element_size()
        spans.append((end, end + n))
        end += -(-n // 16) * 16
    buf = torch.empty(end, dtype=torch.uint8)
    if rank == root:
        for (_, t), (lo, hi) in zip(items, spans):
            if hi > lo:
                buf[lo:hi].copy_(_bytes_of(t))
    exchange.bcast_buffer(comm, buf.numpy(), root=root, what="broadcast_parameters")
    if rank != root:
        with torch.no_grad():
            for (_, t), (lo, hi) in zip(items, spans):
                if hi > lo:
                    t.copy_(buf[lo:hi].view(t.dtype).view(t.shape))


def broadcast_optimizer_state(optimizer, *, root: int = 0, comm: MPI.Intracomm | None = None) -> None:
    """Load the root rank's optimizer state (hyperparameters of every param group and per-parameter state
    such as momentum or Adam moments) on every rank.

    For a wrapper of an optimizer (:class:`~adasum.torch.DistributedOptimizer`, ``ReplicaDeltas``: an object
    whose ``optimizer`` is a torch optimizer) this is the wrapped optimizer's state; the wrapper's own
    counters and any accumulated gradients stay as they are on each rank. The state travels pickled,
    through host memory.
    """
    comm, rank = _comm_and_rank(comm, root)
    inner = getattr(optimizer, "optimizer", None)
    inner = inner if isinstance(inner, torch.optim.Optimizer) else optimizer
    state = to_cpu(inner.state_dict()) if rank == root else None
    state = exchange.bcast(comm, state, root=root, what="broadcast_optimizer_state")
    mine = [len(g["params"]) for g in inner.param_groups]
    theirs = [len(g["params"]) for g in state["param_groups"]]
    problem = None
    if mine != theirs:
        problem = (f"rank {rank}: the optimizer has param groups of sizes {mine}, rank {root} (the root) has "
                   f"{theirs}")
    raise_everywhere(comm, problem)
    if rank != root:
        inner.load_state_dict(state)


def _comm_and_rank(comm, root: int):
    comm = check_comm(comm)
    check_root(comm, root)
    return comm, comm.Get_rank()


def _named_tensors(params) -> list[tuple[str, torch.Tensor]]:
    if isinstance(params, torch.nn.Module):
        params = params.state_dict()
    if isinstance(params, Mapping):
        items = list(params.items())
    elif isinstance(params, torch.Tensor):
        items = [("0", params)]
    elif isinstance(params, Iterable):
        items = [(str(i), x) if isinstance(x, torch.Tensor) else tuple(x) for i, x in enumerate(params)]
    else:
        raise TypeError(f"params must be a module, a mapping of names to tensors or an iterable of tensors, "
                        f"got {type(params).__name__}")
    for name, t in items:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"params entry {name!r} is a {type(t).__name__}, not a tensor")
    return [(str(name), t) for name, t in items]


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


def _difference(mine, theirs, rank: int, root: int) -> str | None:
    if len(mine) != len(theirs):
        return f"rank {rank}: {len(mine)} tensors to broadcast, rank {root} (the root) has {len(theirs)}"
    for i, (a, b) in enumerate(zip(mine, theirs)):
        if a != b:
            return (f"rank {rank}: tensor {i} is {a[0]!r} of shape {a[1]} {a[2]}, rank {root} (the root) has "
                    f"{b[0]!r} of shape {b[1]} {b[2]}")
    return None


def to_cpu(obj: Any) -> Any:
    """A copy of a nested state (dicts, lists, tuples) with every tensor moved to host memory."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu")
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_cpu(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(to_cpu(v) for v in obj)
    return obj
