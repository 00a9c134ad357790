"""The serial tree at every rank count."""

import numpy as np
import pytest

from adasum.rule.combine import combine
from adasum.rule.reference import reference_allreduce, reference_hierarchical, tree_combine


@pytest.mark.parametrize("p", range(1, 18))
def test_orthogonal_sum_and_parallel_mean_at_any_p(p):
    rng = np.random.default_rng(p)
    eye = np.eye(p) * rng.uniform(0.5, 2.0, size=p)
    np.testing.assert_allclose(tree_combine(list(eye)), eye.sum(axis=0), rtol=1e-15)
    x = rng.standard_normal(9)
    scales = rng.uniform(0.1, 3.0, size=p)
    np.testing.assert_allclose(tree_combine([s * x for s in scales]), scales.mean() * x, rtol=1e-12)


def test_pairing_order_power_of_two():
    v = [np.random.default_rng(i).standard_normal(4) for i in range(4)]
    want = combine(combine(v[0], v[1]), combine(v[2], v[3]))
    np.testing.assert_array_equal(tree_combine(v), want)


def test_pairing_order_with_fold():
    # P = 6 = 4 + 2: fold (0,1) and (2,3), then the tree over [01, 23, 4, 5] with size weights.
    v = [np.random.default_rng(i).standard_normal(4) for i in range(6)]
    f01, f23 = combine(v[0], v[1]), combine(v[2], v[3])
    want = combine(combine(f01, f23, 2, 2), combine(v[4], v[5]), 4, 2)
    np.testing.assert_array_equal(tree_combine(v), want)
    # P = 3 = 2 + 1: fold (0,1), then combine it (two ranks) with rank 2 (one rank).
    np.testing.assert_array_equal(tree_combine(v[:3]), combine(combine(v[0], v[1]), v[2], 2, 1))


def test_single_rank_is_identity():
    x = np.arange(5.0)
    np.testing.assert_array_equal(tree_combine([x]), x)


def test_reference_allreduce_ops_and_shapes():
    per_rank = [[np.full((2, 3), r + 1.0), np.array([r])] for r in range(3)]
    s = reference_allreduce(per_rank, "sum")
    assert s[0].shape == (2, 3)
    np.testing.assert_array_equal(s[0], np.full((2, 3), 6.0))
    np.testing.assert_array_equal(reference_allreduce(per_rank, "mean")[1], [1.0])
    # Parallel inputs: Adasum is their mean.
    np.testing.assert_allclose(reference_allreduce(per_rank, "adasum")[0], np.full((2, 3), 2.0))


def test_reference_hierarchical_means_then_tree():
    per_rank = [[np.array([1.0, 0.0])], [np.array([3.0, 0.0])], [np.array([0.0, 5.0])]]
    out = reference_hierarchical(per_rank, [[0, 1], [2]])
    # Node means [2, 0] and [0, 5] are orthogonal: their sum.
    np.testing.assert_array_equal(out[0], [2.0, 5.0])
