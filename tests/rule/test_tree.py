"""The tree geometry (adasum.rule.tree), serially, for every P from 1 to 64: both schedules simulated on P
simulated ranks with the pairwise rule, against the serial reference (which does not use adasum.rule.tree)."""

from __future__ import annotations

import numpy as np
import pytest

from adasum.rule import tree
from adasum.rule.combine import coefficients, combine
from adasum.schedules.fusion import pieces
from adasum.rule.reference import tree_combine

SIZES = list(range(1, 65))


def _inputs(p: int, n: int = 11, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng([seed, p])
    return [rng.standard_normal(n) for _ in range(p)]


def _subtree(size: int, v: int, level: int) -> range:
    """The virtual ranks of the subtree of ``level`` levels that virtual rank ``v`` belongs to."""
    base = (v >> level) << level
    return range(base, base + (1 << level))


@pytest.mark.parametrize("p", SIZES)
def test_roles_fold_pairs_and_levels(p):
    k = p.bit_length() - 1
    extra = p - (1 << k)
    roles = [tree.role(p, r) for r in range(p)]
    out = [r for r in roles if r.out_of is not None]
    assert [r.rank for r in out] == [2 * i + 1 for i in range(extra)]
    assert all(r.out_of == r.rank - 1 and r.levels == () for r in out)
    survivors = [r for r in roles if r.out_of is None]
    assert [r.virtual for r in survivors] == list(range(1 << k))
    assert [tree.real_rank(p, r.virtual) for r in survivors] == [r.rank for r in survivors]
    for r in survivors:
        assert len(r.levels) == k
        for i, level in enumerate(r.levels):
            partner = roles[level.partner]
            # pairs are mutual, on opposite sides, with the same counts
            assert partner.levels[i].partner == r.rank
            assert partner.levels[i].upper != level.upper
            assert (partner.levels[i].count_left, partner.levels[i].count_right) == (level.count_left, level.count_right)
            # the two sides stand for all the ranks of the subtree
            members = _subtree(p, r.virtual, i + 1)
            ranks = {tree.real_rank(p, v) for v in members}
            ranks |= {q + 1 for q in ranks if q < 2 * extra}
            assert level.count_left + level.count_right == len(ranks)
            # the partial sums, swapped by recursive doubling with sum_partners, cover the subtree once
            assert {tree.real_rank(p, v) for v in members} == {r.rank, *level.sum_partners} | \
                {q for v in members for q in roles[tree.real_rank(p, v)].levels[i].sum_partners}
            assert len(level.sum_partners) == i + 1
        covered = {r.rank: {r.rank} for r in survivors}
        for i in range(k):
            for j in range(i + 1):
                covered = {r.rank: covered[r.rank] | covered[r.levels[i].sum_partners[j]] for r in survivors}
            for r in survivors:
                want = {tree.real_rank(p, v) for v in _subtree(p, r.virtual, i + 1)}
                assert covered[r.rank] == want, f"P={p}, level {i + 1}, rank {r.rank}"
            covered = {r.rank: {r.rank} for r in survivors}


def _simulate_doubling(vectors, counts=None):
    """Recursive doubling on simulated ranks, driven by tree.role alone."""
    p = len(vectors)
    counts = tuple(counts) if counts is not None else None
    roles = [tree.role(p, r, counts) for r in range(p)]
    held = [np.array(v, dtype=np.float64) for v in vectors]
    for r in roles:  # fold
        if r.fold is not None:
            partner, c_self, c_partner = r.fold
            held[r.rank] = combine(held[r.rank], held[partner], c_self, c_partner)
    k = max((len(r.levels) for r in roles), default=0)
    for i in range(k):
        new = list(held)
        for r in roles:
            if r.out_of is not None:
                continue
            level = r.levels[i]
            mine, theirs = held[r.rank], held[level.partner]
            left, right = (theirs, mine) if level.upper else (mine, theirs)
            new[r.rank] = combine(left, right, level.count_left, level.count_right)
        held = new
    for r in roles:
        if r.out_of is not None:
            held[r.rank] = held[r.out_of]
    return held


def _simulate_halving(vectors, bounds, counts=None):
    """Recursive halving on simulated ranks over a buffer of several layers (``bounds``), driven by
    tree.role and tree.kept_ranges: each rank combines only its range, with every layer's dot products
    summed over the ranks of the subtree in the order the roles give."""
    p, n = len(vectors), int(bounds[-1])
    counts = tuple(counts) if counts is not None else None
    roles = [tree.role(p, r, counts) for r in range(p)]
    buf = [np.array(v, dtype=np.float64) for v in vectors]
    nl = len(bounds) - 1

    def partials(mine, theirs, lo, hi, upper):
        out = np.zeros((nl, 3))
        layers, spans = pieces(bounds, lo, hi)
        for layer, (s, e) in zip(layers, spans):
            a, b = mine[lo + s:lo + e], theirs[lo + s:lo + e]
            left, right = (b, a) if upper else (a, b)
            out[layer] = [left @ right, left @ left, right @ right]
        return out

    def apply(mine, theirs, lo, hi, sums, c_left, c_right, upper):
        ca, cb = coefficients(sums[:, 0], sums[:, 1], sums[:, 2], c_left, c_right)
        mine_c, theirs_c = (cb, ca) if upper else (ca, cb)
        out = mine.copy()
        layers, spans = pieces(bounds, lo, hi)
        for layer, (s, e) in zip(layers, spans):
            out[lo + s:lo + e] = mine_c[layer] * mine[lo + s:lo + e] + theirs_c[layer] * theirs[lo + s:lo + e]
        return out

    for r in roles:
        if r.fold is not None:
            partner, c_self, c_partner = r.fold
            sums = partials(buf[r.rank], buf[partner], 0, n, False)
            buf[r.rank] = apply(buf[r.rank], buf[partner], 0, n, sums, c_self, c_partner, False)
    survivors = [r for r in roles if r.out_of is None]
    ranges = {r.rank: tree.kept_ranges(n, r) for r in survivors}
    for i in range(survivors[0].depth if survivors else 0):
        # every rank's partials on its kept range, then summed over the subtree by the recorded partners
        part = {}
        for r in survivors:
            level = r.levels[i]
            lo, hi = ranges[r.rank][i + 1]
            part[r.rank] = partials(buf[r.rank], buf[level.partner], lo, hi, level.upper)
        sums = dict(part)
        for j in range(i + 1):
            step = {}
            for r in survivors:
                other = sums[r.levels[i].sum_partners[j]]
                step[r.rank] = other + sums[r.rank] if r.virtual & (1 << j) else sums[r.rank] + other
            sums = step
        new = {}
        for r in survivors:
            level = r.levels[i]
            lo, hi = ranges[r.rank][i + 1]
            new[r.rank] = apply(buf[r.rank], buf[level.partner], lo, hi, sums[r.rank],
                                level.count_left, level.count_right, level.upper)
        for rank, v in new.items():
            buf[rank] = v
    # allgather: the final ranges of all survivors tile the buffer
    final = np.empty(n)
    covered = np.zeros(n, dtype=int)
    for r in survivors:
        lo, hi = ranges[r.rank][-1]
        final[lo:hi] = buf[r.rank][lo:hi]
        covered[lo:hi] += 1
    assert (covered == 1).all(), "the kept ranges of the survivors must tile the buffer exactly once"
    return final


@pytest.mark.parametrize("p", SIZES)
def test_doubling_geometry_computes_the_reference_tree(p):
    vectors = _inputs(p)
    want = tree_combine(vectors)
    got = _simulate_doubling(vectors)
    for r, v in enumerate(got):
        np.testing.assert_allclose(v, want, rtol=1e-12, atol=1e-12, err_msg=f"P={p}, rank {r}")
    assert len({v.tobytes() for v in got}) == 1, f"P={p}: ranks differ"


@pytest.mark.parametrize("p", SIZES)
def test_halving_geometry_computes_the_reference_tree_per_layer(p):
    sizes = [0, 1, 7, 3, 30, 2, 13]
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    vectors = _inputs(p, int(bounds[-1]), seed=1)
    got = _simulate_halving(vectors, bounds)
    for i in range(len(sizes)):
        s, e = bounds[i], bounds[i + 1]
        want = tree_combine([v[s:e] for v in vectors]) if e > s else np.zeros(0)
        np.testing.assert_allclose(got[s:e], want, rtol=1e-11, atol=1e-12, err_msg=f"P={p}, layer {i}")


@pytest.mark.parametrize("p", SIZES)
def test_properties_hold_through_the_geometry(p):
    """Parallel inputs give the mean over all P, orthogonal ones their sum, at every P."""
    base = np.random.default_rng(p).standard_normal(70)
    parallel = [base * (1 + r) for r in range(p)]
    np.testing.assert_allclose(_simulate_doubling(parallel)[0], np.mean(parallel, axis=0), rtol=1e-12)
    orthogonal = [np.eye(70)[r] * (r + 1) for r in range(p)]
    np.testing.assert_allclose(_simulate_doubling(orthogonal)[0], np.sum(orthogonal, axis=0), rtol=1e-12, atol=1e-15)
    bounds = np.array([0, 70])
    np.testing.assert_allclose(_simulate_halving(orthogonal, bounds), np.sum(orthogonal, axis=0), rtol=1e-12,
                               atol=1e-15)


@pytest.mark.parametrize("p", [2, 3, 5, 6, 7, 12, 13])
def test_counts_weigh_subtrees_as_the_reference_does(p):
    counts = [1 + (r * 7) % 3 for r in range(p)]
    vectors = _inputs(p, 9, seed=2)
    want = tree_combine(vectors, counts)
    np.testing.assert_allclose(_simulate_doubling(vectors, counts)[0], want, rtol=1e-12)
    np.testing.assert_allclose(_simulate_halving(vectors, np.array([0, 4, 9]), counts),
                               np.concatenate([tree_combine([v[:4] for v in vectors], counts),
                                               tree_combine([v[4:] for v in vectors], counts)]), rtol=1e-11)


def test_kept_ranges_halve_the_range_at_every_level():
    for p in (4, 8, 6):
        for rank in range(p):
            r = tree.role(p, rank)
            if r.out_of is not None:
                continue
            rg = tree.kept_ranges(10, r)
            assert rg[0] == (0, 10)
            for (lo, hi), (klo, khi), level in zip(rg, rg[1:], r.levels):
                mid = lo + (hi - lo) // 2
                assert (klo, khi) == ((mid, hi) if level.upper else (lo, mid))


def test_role_rejects_bad_arguments():
    with pytest.raises(ValueError, match="rank 5 is not in a tree of 4 ranks"):
        tree.role(4, 5)
    with pytest.raises(ValueError, match="counts has 2 entries for 3 ranks"):
        tree.role(3, 0, (1, 1))
