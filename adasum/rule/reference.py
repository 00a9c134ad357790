"""The serial reference: the rule and the tree of docs/design.md in plain float64 numpy, the ground truth
of the tests.

It follows the definition literally — fold the first adjacent pairs until a power of two is left, then
combine adjacent pairs level by level — with none of the distributed schedule's splitting of vectors.

Given a ``dtype``, it computes the way the library computes for that dtype: every pairwise result (dot
products and combine in float64) is rounded once to ``dtype`` before the next level takes it, as the
library stores each level's result in the input dtype (SPEC §1); the node means of the hierarchical mode
too. Without one, everything stays float64.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .combine import combine
from .sixteen import round_to

__all__ = ["tree_combine", "reference_allreduce", "reference_hierarchical"]


def tree_combine(vectors: Sequence[np.ndarray], counts: Sequence[int] | None = None,
                 dtype: str | None = None) -> np.ndarray:
    """Adasum of one layer's vectors, one per leaf, over the tree of docs/design.md.

    ``counts`` gives how many ranks each leaf stands for (1 each by default); subtrees of unequal size are
    weighted by their counts. ``dtype``: every pairwise result is rounded to it (the vectors should hold
    values of that dtype already); the result is float64 in any case.
    """
    nodes = [(np.asarray(v, dtype=np.float64).ravel(), int(c))
             for v, c in zip(vectors, counts if counts is not None else [1] * len(vectors))]
    if not nodes:
        raise ValueError("tree_combine needs at least one vector")
    p = len(nodes)
    extra = p - (1 << (p.bit_length() - 1))
    # Fold the first `extra` adjacent pairs so that a power of two of subtrees is left.
    folded = [_pair(nodes[2 * i], nodes[2 * i + 1], dtype) for i in range(extra)]
    nodes = folded + nodes[2 * extra:]
    while len(nodes) > 1:
        nodes = [_pair(nodes[i], nodes[i + 1], dtype) for i in range(0, len(nodes), 2)]
    return nodes[0][0]


def _pair(left, right, dtype=None):
    (a, na), (b, nb) = left, right
    out = combine(a, b, na, nb)
    return (out if dtype is None else round_to(out, dtype)), na + nb


def reference_allreduce(per_rank: Sequence[Sequence[np.ndarray]], op: str = "adasum",
                        dtype: str | None = None) -> list[np.ndarray]:
    """What every rank should get from ``adasum_allreduce``, given each rank's list of tensors.

    ``per_rank[r][i]`` is tensor ``i`` on rank ``r``. Results are float64 arrays of the tensors' shapes.
    ``dtype`` (Adasum only): round every level's results to it, as the library does (the module's
    docstring).
    """
    op = str(getattr(op, "value", op))
    size = len(per_rank)
    out = []
    for layer in zip(*per_rank):
        shape = np.shape(layer[0])
        stacked = [np.asarray(t, dtype=np.float64) for t in layer]
        if op == "adasum":
            out.append(tree_combine(stacked, dtype=dtype).reshape(shape))
        elif op == "sum":
            out.append(np.sum(stacked, axis=0))
        elif op == "mean":
            out.append(np.sum(stacked, axis=0) / size)
        else:
            raise ValueError(f"unknown op {op!r}")
    return out


def reference_hierarchical(per_rank: Sequence[Sequence[np.ndarray]],
                           nodes: Sequence[Sequence[int]], dtype: str | None = None) -> list[np.ndarray]:
    """Hierarchical Adasum: the mean over each node's ranks, then the tree over nodes weighted by ranks.

    ``nodes`` lists the ranks of each node, nodes in order of their lowest rank. ``dtype``: the node means
    and every level's results are rounded to it.
    """
    out = []
    for layer in zip(*per_rank):
        shape = np.shape(layer[0])
        means = [np.mean([np.asarray(layer[r], dtype=np.float64) for r in ranks], axis=0) for ranks in nodes]
        if dtype is not None:
            means = [round_to(m, dtype) for m in means]
        out.append(tree_combine(means, [len(ranks) for ranks in nodes], dtype).reshape(shape))
    return out
