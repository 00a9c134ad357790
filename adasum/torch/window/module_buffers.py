"""Keeping a model's buffers (BatchNorm's running statistics, counters) alike on every rank.

Parameters stay alike because every rank applies the same combined update; buffers change in the forward
pass, from each rank's own batches, so they drift apart unless they are reconciled. :class:`BufferSync`
does it at each boundary of the optimizer (``buffers=`` of :class:`~adasum.torch.DistributedOptimizer`):

- ``"average"`` (the default where a module is given): what changed since the last boundary is averaged
  over the ranks. Every rank keeps the buffers' values at the last boundary (alike everywhere: the
  constructor starts from rank 0's); at a boundary the changes ``buffer - kept`` travel in one sum over the
  optimizer's communicator, and every buffer becomes ``kept + sum / P``. Floating buffers take the mean;
  integer and boolean ones (``num_batches_tracked``) the mean rounded down, in their own dtype, so a
  counter that advanced alike on every rank stays that count. A buffer no rank changed keeps its exact
  bits (a constant such as a rotary-embedding table is not disturbed by rounding), and a running mean
  becomes exactly the running mean of the batch means of all ranks. One collective per boundary (per device
  of the buffers), none on the micro-batches in between; memory: one copy of the buffers.
- ``"broadcast"``: at each boundary every rank takes rank 0's buffers (DDP's choice of whose statistics
  count, ``broadcast_buffers=True``, made once per window rather than before every forward, so the
  micro-batches of a window make no MPI call and the buffers are alike after every ``step()``).

Averaging is the default because it is what a single process training on the ranks' batches together
would hold (up to the variance between the ranks' batch means, which per-rank BatchNorm never sees), it
uses every rank's data rather than one rank's, and it costs one small sum per boundary.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from mpi4py import MPI

from ...call.allreduce import adasum_allreduce
from ..state.broadcast import broadcast_parameters

__all__ = ["BufferSync", "BUFFER_MODES"]

BUFFER_MODES = ("average", "broadcast")


class BufferSync:
    """``buffers`` (tensors, from :func:`buffers_of`) kept alike over ``comm`` by ``mode`` (``"average"`` or
    ``"broadcast"``, see the module's text). Construction is collective for ``"average"`` (rank 0's buffers
    are copied to every rank)."""

    def __init__(self, mode: str, buffers: list[torch.Tensor], comm: MPI.Intracomm,
                 module: torch.nn.Module | None = None):
        self.mode = mode
        self.comm = comm
        self.buffers = list(buffers)
        self.module = module  # read again at each boundary: ``module.to(...)`` replaces buffer tensors
        self.kept: list[torch.Tensor] = []
        if mode == "average" and comm.Get_size() > 1:
            broadcast_parameters(self.buffers, root=0, comm=comm)
            self.kept = [b.detach().clone() for b in self.buffers]

    def sync(self) -> None:
        """Collective: make the buffers alike on every rank of ``comm``."""
        if self.comm.Get_size() == 1:
            return
        self._follow_module()
        if not self.buffers:
            return
        if self.mode == "broadcast":
            broadcast_parameters(self.buffers, root=0, comm=self.comm)
            return
        size = self.comm.Get_size()
        by_device: dict[torch.device, list[int]] = {}
        for i, b in enumerate(self.buffers):
            by_device.setdefault(b.device, []).append(i)
        with torch.no_grad():
            for indices in by_device.values():
                changes = [_change(self.buffers[i], self.kept[i]) for i in indices]
                summed = adasum_allreduce(changes, op="sum", comm=self.comm)
                for i, total in zip(indices, summed):
                    buf, kept = self.buffers[i], self.kept[i]
                    if buf.is_floating_point():
                        buf.copy_(kept + total / size)
                    else:
                        buf.copy_(kept.to(torch.int64) + torch.div(total, size, rounding_mode="floor"))
                    kept.copy_(buf)


    def state_dict(self, window_open: bool) -> dict[str, Any]:
        """The values at the last boundary (what each rank's change is taken against), and, where a window is
        open, this rank's own values (a checkpoint's model holds the root's)."""
        self._follow_module()
        state: dict[str, Any] = {"kept": [k.detach().to("cpu", copy=True) for k in self.kept]}
        if window_open:
            state["values"] = [b.detach().to("cpu", copy=True) for b in self.buffers]
        return state

    def check_state(self, state: dict[str, Any]) -> None:
        """Raise ValueError where ``state`` does not fit these buffers (before anything changes)."""
        for key in ("kept", "values"):
            saved = state.get(key)
            if saved and (len(saved) != len(self.buffers) or any(
                    tuple(s.shape) != tuple(b.shape) for s, b in zip(saved, self.buffers))):
                raise ValueError(f"rank {self.comm.Get_rank()}: the state's module buffers ({key}, {len(saved)} "
                                 f"tensors) do not fit the {len(self.buffers)} buffers kept alike")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._follow_module()
        if state.get("kept") and self.kept:
            self.kept = [k.to(device=b.device, dtype=b.dtype) for k, b in zip(state["kept"], self.buffers)]
        self._own = state.get("values")
        self.restore()

    def restore(self) -> None:
        """This rank's own values of a loaded open window, again (after a checkpoint's model was loaded)."""
        own = getattr(self, "_own", None)
        if own:
            self._follow_module()
            with torch.no_grad():
                for b, v in zip(self.buffers, own):
                    b.copy_(v)

    def _follow_module(self) -> None:
        """Take the module's current buffer tensors where it replaced them (moved, cast or assigned), keeping
        the values of the last boundary; a module whose buffers changed in number or shape raises."""
        if self.module is None:
            return
        current = buffers_of(self.module)
        if [id(b) for b in current] == [id(b) for b in self.buffers]:
            return
        if [b.shape for b in current] != [b.shape for b in self.buffers]:
            raise ValueError(f"rank {self.comm.Get_rank()}: the module's buffers changed in number or shape since "
                             f"the optimizer was made ({len(self.buffers)} then, {len(current)} now); make the "
                             "optimizer again to keep them alike")
        self.kept = [k.to(device=b.device, dtype=b.dtype) for k, b in zip(self.kept, current)]
        self.buffers = current


def buffers_of(source) -> list[torch.Tensor]:
    """The buffers to keep alike: a module's ``buffers()`` or the tensors of an iterable, each once, without
    uninitialized (lazy) ones; complex dtypes raise TypeError."""
    if isinstance(source, torch.nn.Module):
        tensors = list(source.buffers())
    elif isinstance(source, torch.Tensor):
        tensors = [source]
    elif isinstance(source, Iterable):
        tensors = list(source)
    else:
        raise TypeError(f"module must be a torch.nn.Module or an iterable of tensors, got {type(source).__name__}")
    seen: set[int] = set()
    out = []
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"module: entry {i} is a {type(t).__name__}, not a tensor")
        if torch.nn.parameter.is_lazy(t) or id(t) in seen:
            continue
        if t.is_complex():
            raise TypeError(f"module: buffer {i} has the complex dtype {t.dtype}, which cannot be kept alike; "
                            "pass the other buffers as an iterable of tensors")
        seen.add(id(t))
        out.append(t)
    return out


def _change(buf: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """This rank's change of ``buf`` since the last boundary: in its own dtype for floating buffers, as
    int64 for integer and boolean ones."""
    if buf.is_floating_point():
        return (buf.detach() - kept).contiguous()
    return (buf.detach().to(torch.int64) - kept.to(torch.int64)).contiguous()
