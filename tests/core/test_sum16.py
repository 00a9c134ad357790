"""sum and mean of 16-bit floats travel as 16 bits (half a float32 allreduce's bytes) and equal, bit for bit,
the float32 sum of every rank's values in rank order, rounded once."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")  # the expected sums are torch's roundings

import adasum  # noqa: E402

pytestmark = pytest.mark.mpi(min_size=2)


def _values(rank: int, n: int) -> np.ndarray:
    g = np.random.default_rng(100 + rank)
    x = g.standard_normal(n).astype(np.float32) * np.float32(2.0) ** g.integers(-20, 20, n).astype(np.float32)
    x[:3] = [65000.0, -65000.0, 1e-7][:n]  # near float16's largest and below its smallest normal
    return x


def _expected(size: int, n: int, dtype: torch.dtype, mean: bool) -> torch.Tensor:
    acc = torch.zeros(n, dtype=torch.float32)
    for r in range(size):  # what every rank sent (16 bits), added in float32 in rank order
        acc += torch.from_numpy(_values(r, n)).to(dtype).to(torch.float32)
    if mean:
        acc /= size
    return acc.to(dtype)


@pytest.mark.parametrize("op", ["sum", "mean"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("n", [1, 5, 1000, 70_001])
def test_torch_16bit_sum_is_the_rank_order_float32_sum_rounded_once(comm, op, dtype, n):
    size, rank = comm.Get_size(), comm.Get_rank()
    x = torch.from_numpy(_values(rank, n)).to(dtype)
    with adasum.count_traffic(comm) as t:
        got = adasum.adasum_allreduce([x, x[:2].clone()], op=op, comm=comm)
    want = _expected(size, n, dtype, op == "mean")
    assert got[0].dtype == dtype
    assert torch.equal(got[0].view(torch.int16), want.view(torch.int16)), \
        f"rank {rank}: {int((got[0] != want).sum())} of {n} elements differ"
    assert torch.equal(got[1], want[:2])
    assert t.allreduce_bytes == 2 * (n + min(n, 2))  # 16 bits per element: half of what a float32 allreduce sends


@pytest.mark.parametrize("op", ["sum", "mean"])
def test_numpy_float16_sum_matches_too(comm, op):
    size, rank = comm.Get_size(), comm.Get_rank()
    x = _values(rank, 4097).astype(np.float16)
    got = adasum.adasum_allreduce([x], op=op, comm=comm)[0]
    want = _expected(size, 4097, torch.float16, op == "mean").numpy()
    assert got.dtype == np.float16 and np.array_equal(got.view(np.int16), want.view(np.int16))


def test_nan_and_overflow_survive_the_16bit_sum(comm):
    """A NaN on one rank makes the sum NaN everywhere; a bf16 sum past float32's range becomes infinite."""
    size, rank = comm.Get_size(), comm.Get_rank()
    x = torch.zeros(8, dtype=torch.bfloat16)
    x[0] = float("nan") if rank == size - 1 else 1.0
    x[1] = 3e38
    got = adasum.adasum_allreduce([x], op="sum", comm=comm)[0]
    assert torch.isnan(got[0]) and torch.isinf(got[1]) and got[1] > 0
    assert torch.equal(got[2:], torch.zeros(6, dtype=torch.bfloat16))
