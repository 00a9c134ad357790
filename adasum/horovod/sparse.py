"""Sparse gradients (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag(sparse=True)``) in
:func:`adasum.horovod.DistributedOptimizer` with ``op=Sum`` or ``Average``, as Horovod reduces them.

The library's reductions take dense tensors only, so where a gradient is a sparse COO tensor the façade
reduces it itself, before the library reduces the dense ones:

- by default every rank's indices and values are gathered (one grouped ``allgather`` of the façade,
  negotiated and stall-watched) and coalesced, which sums the rows that several ranks touched; ``Average``
  divides the values by the set's size. Every rank gathers the same rows in the same order, so every rank
  holds the same gradient, bit for bit;
- with ``sparse_as_dense=True`` the gradient is made dense, reduced as a dense gradient (``op`` and the
  optimizer's ``compression``), and made sparse again (the same sparse dimensions) for the optimizer.

A rank where such a parameter has no gradient takes part with no rows, and gets the reduced gradient. The
ranks first agree which parameters have sparse gradients (one small vote per ``step()``; the positions are
exchanged only where some rank has one): a parameter whose gradient is sparse on one rank and dense on
another, or sparse with other sparse dimensions, raises ``ValueError`` on every rank, naming it. Where a
reduced sparse gradient holds a NaN or Inf and the optimizer skips non-finite updates, the parameter is
handed to the library with a non-finite dense gradient instead, so the library skips the update on every
rank as it does for a dense one.

With ``op=Adasum`` nothing happens here: the ranks combine the weight deltas of their local steps, which
the wrapped optimizer (``SparseAdam``, say) takes on each rank's own sparse gradient.
"""

from __future__ import annotations

import contextlib

import torch
from mpi4py import MPI

from ..runtime import exchange, world
from ..torch.window.tensors import all_finite, mark_nonfinite
from . import plans
from .basics import Average, Sum
from .process_sets import ProcessSet

__all__ = ["SparseGradients", "hidden"]


class SparseGradients:
    """The sparse-gradient reduction of one optimizer (the module docstring): over ``ps`` (None: this rank
    steps on its own gradients), with ``op`` and the optimizer's ``wire``; ``names`` maps each parameter to
    its name for the errors."""

    def __init__(self, ps: ProcessSet | None, comm: MPI.Intracomm, op: str, wire: str | None, as_dense: bool,
                 names: dict):
        self.ps = ps if op in (Sum, Average) and comm.Get_size() > 1 else None
        self.comm = comm
        self.op = op
        self.wire = wire
        self.as_dense = bool(as_dense)
        self.names = names

    def reduce(self, params: list[torch.Tensor], skip_nonfinite: bool) -> list[torch.Tensor]:
        """Collective over the set: reduce the sparse gradients of ``params`` (the optimizer's trained
        parameters, in the same order on every rank) into their ``.grad``. Returns the parameters that now
        hold a reduced sparse gradient, which the library's dense reduction must leave out (:func:`hidden`)."""
        if self.ps is None:
            return []
        mine = {i: p.grad.sparse_dim() for i, p in enumerate(params) if p.grad is not None and p.grad.is_sparse}
        if not exchange.any_true(self.comm, bool(mine), what="DistributedOptimizer's sparse-gradient vote"):
            return []
        everyone = exchange.allgather(self.comm, mine, what="DistributedOptimizer's sparse gradients")
        dims = self._agree(params, everyone)
        positions = sorted(dims)
        with torch.no_grad():
            grads = (self._as_dense if self.as_dense else self._gathered)([params[i] for i in positions],
                                                                          [dims[i] for i in positions])
            reduced = []
            for i, g in zip(positions, grads):
                p = params[i]
                if skip_nonfinite and not all_finite([g]):
                    # The same on every rank (every rank reduced the same rows): the library's dense
                    # reduction carries the NaN and skips the update everywhere.
                    p.grad = torch.zeros_like(p)
                    mark_nonfinite([p.grad])
                    continue
                p.grad = g
                reduced.append(p)
        return reduced

    def _name(self, p: torch.Tensor, i: int) -> str:
        return f"parameter {self.names.get(p, i)!r} (shape {tuple(p.shape)})"

    def _agree(self, params: list[torch.Tensor], everyone: list[dict]) -> dict[int, int]:
        """{position: sparse dimensions} of every parameter that is sparse on some rank; raises ValueError on
        every rank where a rank's gradient of one is dense, or sparse with other sparse dimensions."""
        first: dict[int, tuple[int, int]] = {}  # position: (lowest rank with a sparse gradient, its dims)
        for r, m in enumerate(everyone):
            for i, d in m.items():
                first.setdefault(i, (r, d))
        problems = []
        for i, (r, d) in sorted(first.items()):
            g = params[i].grad
            if g is not None and not g.is_sparse:
                problems.append(f"{self._name(params[i], i)} has a dense gradient here and a sparse one on rank "
                                f"{r}: a parameter's gradient must be sparse (or absent) on every rank")
            elif g is not None and g.sparse_dim() != d:
                problems.append(f"{self._name(params[i], i)} has a sparse gradient of {g.sparse_dim()} sparse "
                                f"dimension(s) here and of {d} on rank {r}")
        problem = f"rank {world.rank()}: " + "; ".join(problems) if problems else None
        exchange.raise_everywhere(self.comm, problem, what="DistributedOptimizer's sparse gradients")
        return {i: d for i, (_, d) in first.items()}

    def _gathered(self, params: list[torch.Tensor], dims: list[int]) -> list[torch.Tensor]:
        """Every rank's rows, gathered and coalesced (and divided by the size for ``Average``)."""
        parts = []
        for p, d in zip(params, dims):
            if p.grad is None:
                g = torch.sparse_coo_tensor(torch.zeros(d, 0, dtype=torch.long, device=p.device),
                                            p.new_zeros((0, *p.shape[d:])), p.shape, check_invariants=False)
            else:
                g = p.grad.coalesce()
            parts += [g.indices().t().contiguous(), g.values().contiguous()]
        out = plans.run(plans.grouped_allgather(parts, process_set=self.ps, grad=False))
        n = self.ps.size()
        grads = []
        for k, p in enumerate(params):
            # the gathered indices are checked (in bounds) before anything reads them
            g = torch.sparse_coo_tensor(out[2 * k].t(), out[2 * k + 1], p.shape, check_invariants=True).coalesce()
            if self.op == Average:
                g = torch.sparse_coo_tensor(g.indices(), g.values() / n, p.shape, is_coalesced=True,
                                            check_invariants=False)
            grads.append(g)
        return grads

    def _as_dense(self, params: list[torch.Tensor], dims: list[int]) -> list[torch.Tensor]:
        """The dense gradients reduced with ``op`` and the wire, sparse again with the same sparse dims."""
        dense = [torch.zeros_like(p) if p.grad is None else p.grad.to_dense() for p in params]
        out = plans.run(plans.grouped_allreduce(dense, op=self.op, compression=self.wire, process_set=self.ps,
                                                grad=False))
        return [o.to_sparse(d) for o, d in zip(out, dims)]


@contextlib.contextmanager
def hidden(params: list[torch.Tensor]):
    """``params`` (whose sparse gradients were reduced already) left out of the library's reduction, which
    takes the parameters that require a gradient; the wrapped optimizer still steps them on their ``.grad``."""
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(True)
