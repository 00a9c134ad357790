"""The serial reference: the rule and the tree of docs/design.md in plain float64 numpy, the ground truth
of the tests.

It follows the definition literally — fold the first adjacent pairs until a power of two is left, then
combine adjacent pairs level by level — with none of the distributed schedule's splitting of vectors.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .combine import combine

__all__ = ["tree_combine", "reference_allreduce", "reference_hierarchical"]


def tree_combine(vectors: Sequence[np.ndarray], counts: Sequence[int] | None = None) -> np.ndarray:
    """Adasum of one layer's vectors, one per leaf, over the tree of docs/design.md.

    ``counts`` gives how many ranks each leaf stands for (1 each by default); subtrees of unequal size are
    weighted by their counts.
    """
    nodes = [(np.asarray(v, dtype=np.float64).ravel(), int(c))
             for v, c in zip(vectors, counts if counts is not None else [1] * len(vectors))]
    if not nodes:
        raise ValueError("tree_combine needs at least one vector")
    p = len(nodes)
    extra = p - (1 << (p.bit_length() - 1))
    # Fold the first `extra` adjacent pairs so that a power of two of subtrees is left.
    folded = [_pair(nodes[2 * i], nodes[2 * i + 1]) for i in range(extra)]
    nodes = folded + nodes[2 * extra:]
    while len(nodes) > 1:
        nodes = [_pair(nodes[i], nodes[i + 1]) for i in range(0, len(nodes), 2)]
    return nodes[0][0]


def _pair(left, right):
    (a, na), (b, nb) = left, right
    return combine(a, b, na, nb), na + nb


def reference_allreduce(per_rank: Sequence[Sequence[np.ndarray]], op: str = "adasum") -> list[np.ndarray]:
    """What every rank should get from ``adasum_allreduce``, given each rank's list of tensors.

    ``per_rank[r][i]`` is tensor ``i`` on rank ``r``. Results are float64 arrays of the tensors' shapes.
    """
    op = str(getattr(op, "value", op))
    size = len(per_rank)
    out = []
    for layer in zip(*per_rank):
        shape = np.shape(layer[0])
        stacked = [np.asarray(t, dtype=np.float64) for t in layer]
        if op == "adasum":
            out.append(tree_combine(stacked).reshape(shape))
        elif op == "sum":
            out.append(np.sum(stacked, axis=0))
        elif op == "mean":
            out.append(np.sum(stacked, axis=0) / size)
        else:
            raise ValueError(f"unknown op {op!r}")
    return out


def reference_hierarchical(per_rank: Sequence[Sequence[np.ndarray]],
                           nodes: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """Hierarchical Adasum: the mean over each node's ranks, then the tree over nodes weighted by ranks.

    ``nodes`` lists the ranks of each node, nodes in order of their lowest rank.
    """
    out = []
    for layer in zip(*per_rank):
        shape = np.shape(layer[0])
        means = [np.mean([np.asarray(layer[r], dtype=np.float64) for r in ranks], axis=0) for ranks in nodes]
        out.append(tree_combine(means, [len(ranks) for ranks in nodes]).reshape(shape))
    return out
