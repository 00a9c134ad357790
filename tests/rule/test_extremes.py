"""float64 at the edges of its range: the dot products and squared norms are scaled (as BLAS nrm2 scales),
so parallel inputs from the smallest normal number to about 1e300 still give their mean, and orthogonal ones
their sum, under both schedules, for numpy arrays and torch tensors, flat and hierarchical."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import torch  # imported at first use: the numpy tests run without torch

import adasum
from adasum.rule.combine import combine

from helpers import as_f64, assert_identical_across_ranks

pytestmark = pytest.mark.mpi

MAGNITUDES = [np.finfo(np.float64).tiny, 1e-200, 1e-160, 1.0, 1e150, 1e200, 1e300]


@pytest.fixture(params=["doubling", "halving"])
def schedule(request):
    old = adasum.configure(small_message_bytes=None if request.param == "doubling" else 0)
    yield request.param
    adasum.configure(old)


def _parallel(rank: int, mag: float) -> list[np.ndarray]:
    base = np.random.default_rng(7).standard_normal(1001)
    return [base * mag * (rank + 1) / 2, np.arange(1.0, 6.0) * mag * (rank + 1) / 4, np.zeros(3)]


CASES = ([(mag, "numpy", False) for mag in MAGNITUDES]
         + [(mag, kind, hierarchical) for mag in (MAGNITUDES[0], 1e300) for kind, hierarchical in
            (("torch", False), ("numpy", True), ("torch", True))])


@pytest.mark.parametrize("mag,kind,hierarchical", CASES)
def test_parallel_float64_gives_the_mean_at_any_magnitude(comm, schedule, mag, kind, hierarchical):
    size, rank = comm.Get_size(), comm.Get_rank()
    mean = np.mean([np.concatenate(_parallel(r, mag)) for r in range(size)], axis=0)
    x = _parallel(rank, mag)
    if kind == "torch":
        x = [torch.from_numpy(v) for v in x]
    out = adasum.adasum_allreduce(x, hierarchical=hierarchical)
    got = np.concatenate([as_f64(o) for o in out])
    assert np.isfinite(got).all(), f"rank {rank}: non-finite result at magnitude {mag:g}"
    np.testing.assert_allclose(got / mag, mean / mag, rtol=1e-12, atol=0)
    assert_identical_across_ranks(comm, out)


@pytest.mark.parametrize("mag", [1e-200, 1e200])
def test_orthogonal_float64_gives_the_sum_at_the_edges(comm, schedule, mag):
    size, rank = comm.Get_size(), comm.Get_rank()
    x = [np.eye(size, 40)[rank] * mag * (rank + 1)]
    out = adasum.adasum_allreduce(x)
    want = np.sum([np.eye(size, 40)[r] * mag * (r + 1) for r in range(size)], axis=0)
    np.testing.assert_allclose(out[0] / mag, want / mag, rtol=1e-12)


def test_nan_still_poisons_its_layer(comm, schedule):
    size, rank = comm.Get_size(), comm.Get_rank()
    x = _parallel(rank, 1e200)
    if rank == size - 1:
        x[0][3] = np.nan
    out = adasum.adasum_allreduce(x)
    assert not np.isfinite(out[0]).all() and np.isfinite(out[1]).all()


def test_reference_rule_is_scaled_too():
    a = np.array([3e200, 4e200])  # a·a overflows unscaled
    np.testing.assert_allclose(combine(a, a) / 1e200, a / 1e200)
    # Subnormal: a·a underflows to 0 unscaled, which would make both coefficients 1 and the result 2a.
    # Scaled, the coefficients are exactly 1/2 and halving these numbers is exact.
    tiny = np.ldexp([3.0, 4.0], -1060)
    assert 0 < tiny[0] < np.finfo(np.float64).tiny
    assert np.array_equal(combine(tiny, tiny), tiny)
    other = np.ldexp([-4.0, 3.0], -1060)  # orthogonal: the sum
    assert np.array_equal(combine(tiny, other), tiny + other)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_subnormal_float64_gives_the_mean_and_the_sum(comm, schedule, kind):
    """Data whose largest magnitude is subnormal: 2**-k that scales it lies beyond the float64 range."""
    size, rank = comm.Get_size(), comm.Get_rank()
    unit = np.ldexp(1.0, -1060)
    parallel = np.array([3.0, 4.0, 1.0, -2.0]) * unit * (rank + 1)  # exact: small integers times unit
    orthogonal = np.eye(size, 6)[rank] * unit * (rank + 1)
    x = [parallel, orthogonal]
    if kind == "torch":
        x = [torch.from_numpy(v) for v in x]
    out = adasum.adasum_allreduce(x)
    np.testing.assert_allclose(as_f64(out[0]) / unit, np.array([3.0, 4.0, 1.0, -2.0]) * (size + 1) / 2,
                               rtol=2.0 ** -12)
    want = np.sum([np.eye(size, 6)[r] * (r + 1) for r in range(size)], axis=0)
    np.testing.assert_array_equal(as_f64(out[1]) / unit, want)
    assert_identical_across_ranks(comm, out)
