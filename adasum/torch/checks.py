"""The checks of :class:`~adasum.torch.DistributedOptimizer`'s arguments and state: each rank's own, and
the agreement of every rank's settings (a difference raises on every rank, naming the rank and the value)."""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from mpi4py import MPI

from ..runtime import exchange

__all__ = ["check_agreement", "check_arguments", "buffers_problem", "check_accumulated"]


def check_agreement(comm: MPI.Intracomm, mine: dict[str, Any], params: list[torch.Tensor],
                     buffers: list[tuple[tuple[int, ...], str]] = (), who: str = "DistributedOptimizer") -> None:
    """Every rank must use the same settings, parameter shapes and buffer shapes; raise on every rank if
    not (each rank's settings were checked before: :meth:`~adasum.torch.Options.raise_problems`), naming
    ``who`` made them. ``overlap_requested`` is not agreed."""
    rank = comm.Get_rank()
    if comm.Get_size() == 1:
        return
    mine = dict(mine, parameters=len(params))
    shapes = hashlib.blake2b(repr(([(tuple(p.shape), str(p.dtype)) for p in params], list(buffers))).encode(),
                             digest_size=8).hexdigest()
    everyone = exchange.allgather(comm, (mine, shapes), what=f"{who}'s settings")
    first, first_shapes = everyone[0]
    for key in first:
        if key == "overlap_requested":
            continue
        odd = [r for r, (s, _) in enumerate(everyone) if s[key] != first[key]]
        if odd:
            raise ValueError(f"(raised on rank {rank}) ranks disagree on {key} of {who}: "
                             + ", ".join(f"rank {r} has {everyone[r][0][key]!r}" for r in odd)
                             + f", rank 0 has {first[key]!r}")
    odd = [r for r, (_, h) in enumerate(everyone) if h != first_shapes]
    if odd:
        raise ValueError(f"(raised on rank {rank}) the parameter or buffer shapes or dtypes of rank(s) "
                         f"{', '.join(map(str, odd))} differ from rank 0's")


def check_arguments(optimizer) -> None:
    if not callable(getattr(optimizer, "step", None)) or not hasattr(optimizer, "param_groups"):
        raise TypeError(f"optimizer must be a torch optimizer with param_groups and step(), got "
                        f"{type(optimizer).__name__}")


def buffers_problem(module, buffers) -> str | None:
    """What is wrong with ``buffers`` for ``module`` (None: nothing)."""
    if module is None and buffers == "broadcast":
        return "buffers='broadcast' needs the model: pass module=model (or an iterable of its buffers)"
    return None


def check_accumulated(grads, params: list[torch.Tensor]) -> None:
    """A state's accumulated gradients (or None) must fit the parameters, one per parameter."""
    if grads is not None and len(grads) != len(params):
        raise ValueError(f"the state holds accumulated gradients for {len(grads)} parameters, the optimizer "
                         f"has {len(params)}")
    for i, (p, g) in enumerate(zip(params, grads or [])):
        if g is not None and tuple(g.shape) != tuple(p.shape):
            raise ValueError(f"accumulated gradient {i} has shape {tuple(g.shape)}, parameter {i} has "
                             f"{tuple(p.shape)}")
