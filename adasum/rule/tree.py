"""The tree over ranks as plain numbers: who folds, who pairs with whom at each level, how many ranks each
side stands for, and which range of a buffer a rank keeps while halving. No MPI and no data: the schedules
(recursive halving, recursive doubling, the compiled small call, the hierarchical mode's tree over nodes)
all take their geometry from here, so they compute the same tree.

The tree (see docs/design.md): for P = 2^k + r ranks (0 <= r < 2^k) the first r adjacent pairs (0,1), …,
(2r-2, 2r-1) fold first: the odd rank of a pair hands its vector to the even one and receives the result at
the end. The 2^k survivors, numbered 0 … 2^k-1 in rank order (their *virtual* ranks), form a binary tree of
adjacent pairs: at level l (1 … k) virtual rank v pairs with v XOR 2^(l-1); the lower of the two holds the
left vector. ``counts`` (ranks per leaf, 1 each for plain Adasum, ranks per node for the hierarchical mode)
weigh the two sides of every combine.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

__all__ = ["Level", "Role", "role", "real_rank", "kept_ranges"]


class Level(NamedTuple):
    """One level of the tree, as a surviving rank sees it."""

    partner: int          # the real rank paired with at this level
    count_left: int       # ranks the left (lower) subtree stands for
    count_right: int      # ranks the right (upper) subtree stands for
    upper: bool           # this rank holds the right vector
    sum_partners: tuple   # real ranks to swap partial sums with, in order, to sum over this level's subtree


class Role(NamedTuple):
    """What one rank does in the tree of ``size`` ranks."""

    size: int
    rank: int
    out_of: int | None      # folded-out rank: the even partner it hands its vector to (else None)
    fold: tuple | None      # even rank of a folded pair: (partner, count_self, count_partner) (else None)
    virtual: int | None     # virtual rank among the 2^k survivors (None for a folded-out rank)
    levels: tuple           # one Level per level of the tree (empty for a folded-out rank)

    @property
    def depth(self) -> int:
        """k: the number of levels of the tree over the survivors."""
        return self.size.bit_length() - 1


def _split(size: int) -> tuple[int, int]:
    k = size.bit_length() - 1
    return k, size - (1 << k)


def real_rank(size: int, v: int) -> int:
    """The real rank of virtual rank ``v`` (the even rank of a folded pair, or a rank past the pairs)."""
    _, extra = _split(size)
    return 2 * v if v < extra else v + extra


@functools.lru_cache(maxsize=1024)
def role(size: int, rank: int, counts: tuple[int, ...] | None = None) -> Role:
    """The role of ``rank`` among ``size`` ranks; ``counts[r]``: how many ranks rank r stands for."""
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in a tree of {size} ranks")
    counts = counts if counts is not None else (1,) * size
    if len(counts) != size:
        raise ValueError(f"counts has {len(counts)} entries for {size} ranks")
    k, extra = _split(size)
    if rank < 2 * extra and rank % 2 == 1:
        return Role(size, rank, rank - 1, None, None, ())
    fold = (rank + 1, counts[rank], counts[rank + 1]) if rank < 2 * extra else None
    v = rank // 2 if rank < 2 * extra else rank - extra
    vcounts = [counts[2 * u] + counts[2 * u + 1] if u < extra else counts[u + extra] for u in range(1 << k)]
    levels = []
    for level in range(1, k + 1):
        d = 1 << (level - 1)
        base = (v >> level) << level
        levels.append(Level(real_rank(size, v ^ d), sum(vcounts[base:base + d]), sum(vcounts[base + d:base + 2 * d]),
                            bool(v & d), tuple(real_rank(size, v ^ (1 << j)) for j in range(level))))
    return Role(size, rank, None, fold, v, tuple(levels))


def kept_ranges(n: int, r: Role) -> list[tuple[int, int]]:
    """Recursive halving of ``[0, n)``: the range this (surviving) rank holds before level 1 and after each
    level; at every level it keeps the lower half of its range if it holds the left vector, else the upper
    half (the lower half gets the smaller middle on odd lengths). ``[0, n)`` for a tree of one."""
    out = [(0, n)]
    lo, hi = 0, n
    for level in r.levels:
        mid = lo + (hi - lo) // 2
        lo, hi = (mid, hi) if level.upper else (lo, mid)
        out.append((lo, hi))
    return out

