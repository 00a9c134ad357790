"""The pairwise rule and its size weights, serially."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from adasum.rule.combine import coefficients, combine

# Multiples of 1/64 in [-1000, 1000]: squared norms of float64 values below about 1e-154 underflow, a
# limit docs/semantics.md states; the properties are about the rule, not about that range.
finite = st.integers(-64_000, 64_000).map(lambda i: i / 64)
vectors = st.integers(1, 40).flatmap(lambda n: st.tuples(arrays(np.float64, n, elements=finite),
                                                          arrays(np.float64, n, elements=finite)))


def test_orthogonal_gives_sum():
    a = np.array([3.0, 0.0, 0.0, 1.5])
    b = np.array([0.0, -2.0, 7.0, 0.0])
    np.testing.assert_array_equal(combine(a, b), a + b)


@pytest.mark.parametrize("c", [1.0, 2.0, 0.25, -1.0, -3.0])
def test_collinear_gives_mean(c):
    a = np.array([1.0, -2.0, 0.5, 4.0])
    np.testing.assert_allclose(combine(a, c * a), (a + c * a) / 2, rtol=1e-15, atol=1e-15)


def test_identical_inputs_come_back_unchanged():
    a = np.random.default_rng(0).standard_normal(1000)
    np.testing.assert_array_equal(combine(a, a), a)


def test_zero_vectors():
    b = np.array([1.0, 2.0])
    np.testing.assert_array_equal(combine(np.zeros(2), b), b)
    np.testing.assert_array_equal(combine(b, np.zeros(2)), b)
    np.testing.assert_array_equal(combine(np.zeros(2), np.zeros(2)), np.zeros(2))


def test_zero_side_keeps_nan_of_the_other():
    out = combine(np.zeros(2), np.array([np.nan, 1.0]))
    assert np.isnan(out).all()


def test_weighted_rule_gives_mean_of_counts():
    # a stands for two ranks holding x, b for one rank holding 4x: the mean over three ranks is 2x.
    x = np.array([1.0, -1.0, 2.0])
    np.testing.assert_allclose(combine(x, 4 * x, 2, 1), 2 * x, rtol=1e-14)


def test_equal_counts_are_the_plain_rule():
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal(50), rng.standard_normal(50)
    np.testing.assert_array_equal(combine(a, b, 3, 3), combine(a, b))


def test_coefficients_vectorised_per_layer():
    ca, cb = coefficients([0.0, 2.0, 1.0], [1.0, 2.0, 0.0], [4.0, 2.0, 1.0])
    np.testing.assert_array_equal(ca, [1.0, 0.5, 1.0])
    np.testing.assert_array_equal(cb, [1.0, 0.5, 0.5])


@settings(max_examples=200, deadline=None)
@given(vectors)
def test_symmetric(ab):
    a, b = ab
    np.testing.assert_allclose(combine(a, b), combine(b, a), rtol=1e-12, atol=1e-9)


@settings(max_examples=200, deadline=None)
@given(vectors, st.floats(1e-3, 1e3))
def test_homogeneous(ab, c):
    a, b = ab
    np.testing.assert_allclose(combine(c * a, c * b), c * combine(a, b), rtol=1e-9, atol=1e-6 * c)


@settings(max_examples=200, deadline=None)
@given(vectors)
def test_sum_minus_half_of_each_projection(ab):
    # Adasum(a, b) = a + b - ½·proj_a(b) - ½·proj_b(a): the sum, minus half of what the two share.
    a, b = ab
    na, nb = a @ a, b @ b
    proj_a_b = (a @ b) / na * a if na else np.zeros_like(a)
    proj_b_a = (a @ b) / nb * b if nb else np.zeros_like(b)
    np.testing.assert_allclose(combine(a, b), a + b - proj_a_b / 2 - proj_b_a / 2, rtol=1e-9, atol=1e-7)


def test_few_layer_path_matches_the_vectorised_one():
    """Calls with few layers take Python floats; every rank must get numpy's bits, NaN and Inf included."""
    vals = [0.0, 1.0, -2.5, np.inf, -np.inf, np.nan, 1e308, 1e-308, 5e-324, 3.0]
    grid = np.array(list(itertools.product(vals, [0.0, 1.0, np.inf, np.nan, 1e-308, 2.0, 1e308],
                                           [0.0, 4.0, np.inf]))).T
    dots, norms_a, norms_b = grid
    assert len(dots) > 32  # the whole grid at once takes the vectorised path
    many = coefficients(dots, norms_a, norms_b, 3, 2)
    few = [coefficients(dots[i:i + 8], norms_a[i:i + 8], norms_b[i:i + 8], 3, 2) for i in range(0, len(dots), 8)]
    for side in (0, 1):
        np.testing.assert_array_equal(np.concatenate([f[side] for f in few]), many[side])
