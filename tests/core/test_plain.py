"""``sum`` and ``mean`` of host tensors where they lie (adasum.call.plain): exact results, the copies and
collectives they make, and the ranks that disagree or take the general path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import adasum
from adasum import AdasumMismatchError
from helpers import assert_identical_across_ranks

pytestmark = pytest.mark.mpi(min_size=1)

LIMIT = 1 << 12  # plain_direct_bytes in these tests: float32 layers of 1024 elements and more go direct


@pytest.fixture(autouse=True)
def small_limit():
    old = adasum.configure(plain_direct_bytes=LIMIT)
    yield
    adasum.configure(old)


def _values(rank: int, shapes, seed: int = 0) -> list[np.ndarray]:
    """Multiples of 1/8 below 2^10: every sum over a few ranks is exact in float32 and float64."""
    rng = np.random.default_rng([seed, rank])
    return [rng.integers(-8000, 8000, size=s).astype(np.float64) / 8 for s in shapes]


SHAPES = [(3000,), (0,), (5, 7), (2048, 2), (1,), (40, 40)]


def _make(vals, kind: str, dtype: str):
    if kind == "torch":
        return [torch.from_numpy(v.astype(dtype)) for v in vals]
    return [v.astype(dtype) for v in vals]


def _np(x) -> np.ndarray:
    return x.numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("dtype", ["float32", "float64", "int32"])
@pytest.mark.parametrize("op", ["sum", "mean"])
@pytest.mark.parametrize("inplace", [False, True])
def test_exact_against_the_serial_sum(comm, kind, dtype, op, inplace):
    if op == "mean" and dtype == "int32":
        pytest.skip("mean takes floats only")
    size, rank = comm.Get_size(), comm.Get_rank()
    every = [_values(r, SHAPES) for r in range(size)]
    if dtype == "int32":
        every = [[np.round(v) for v in vals] for vals in every]
    mine = _make(every[rank], kind, dtype)
    kept = [_np(t).copy() for t in mine]
    if inplace:
        out = adasum.adasum_allreduce_inplace(mine, op=op)
        assert out is mine
    else:
        out = adasum.adasum_allreduce(mine, op=op)
        for t, k in zip(mine, kept):  # the inputs are untouched
            np.testing.assert_array_equal(_np(t), k)
    for i, got in enumerate(out):
        exact = sum(vals[i] for vals in every)
        want = (exact / size if op == "mean" else exact).astype(dtype)
        assert type(got) is type(mine[i]) and tuple(got.shape) == SHAPES[i]
        np.testing.assert_array_equal(_np(got), want)
    assert_identical_across_ranks(comm, [_np(t) for t in out])


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_non_contiguous_tensors_in_place(comm, kind):
    size, rank = comm.Get_size(), comm.Get_rank()
    every = [_values(r, [(4000, 2), (6, 4)], seed=3) for r in range(size)]
    base = _make(every[rank], kind, "float32")
    mine = [base[0][:, 1], base[1][::2]]  # a large and a small strided view
    adasum.adasum_allreduce_inplace(mine, op="sum")
    exact = [sum(v[i] for v in every) for i in range(2)]
    np.testing.assert_array_equal(_np(base[0])[:, 1], exact[0][:, 1].astype(np.float32))
    np.testing.assert_array_equal(_np(base[0])[:, 0], every[rank][0][:, 0].astype(np.float32))  # untouched
    np.testing.assert_array_equal(_np(base[1])[::2], exact[1][::2].astype(np.float32))
    np.testing.assert_array_equal(_np(base[1])[1::2], every[rank][1][1::2].astype(np.float32))


@pytest.mark.mpi(min_size=2)
def test_large_tensors_go_to_mpi_without_a_copy(comm):
    layers = [np.ones(4096, np.float32), np.ones(10, np.float32), np.ones(2048, np.float64), np.ones(3)]
    small = 10 * 4 + 3 * 8
    with adasum.count_traffic() as t:
        adasum.adasum_allreduce_inplace(layers, op="sum")
    # the agreement, two tensors where they lie, one packed message per dtype of the small ones
    assert t.collectives == 1 + 2 + 2
    assert t.copied_bytes == 2 * small  # packed, then written back
    old = adasum.configure(plain_direct_bytes=0)
    try:
        with adasum.count_traffic() as t:
            adasum.adasum_allreduce_inplace(layers, op="sum")
    finally:
        adasum.configure(old)
    assert t.collectives == 1 + 2 and t.copied_bytes == 2 * sum(x.nbytes for x in layers)
    size = comm.Get_size()
    assert all(np.all(x == size ** 2) for x in layers)


@pytest.mark.mpi(min_size=2)
def test_a_rank_on_the_general_path_makes_every_rank_pack(comm):
    """Staging is not agreed for sum: a rank that stages takes the general path (one fused buffer per dtype),
    and its vote makes the others pack every tensor too, so that the ranks post the same collectives."""
    size, rank = comm.Get_size(), comm.Get_rank()
    every = [_values(r, SHAPES, seed=5) for r in range(size)]
    mine = _make(every[rank], "numpy", "float32")
    old = adasum.configure(gpu_transport="staged" if rank == 1 else "auto")
    try:
        for _ in range(2):
            out = adasum.adasum_allreduce(mine, op="sum")
            for i, got in enumerate(out):
                np.testing.assert_array_equal(got, sum(v[i] for v in every).astype(np.float32))
    finally:
        adasum.configure(old)


@pytest.mark.mpi(min_size=2)
def test_shape_mismatch_raises_on_every_rank(comm):
    rank = comm.Get_rank()
    shapes = [(5000,), (3, 4)] if rank != 1 else [(5000,), (4, 3)]
    mine = _make(_values(rank, shapes), "torch", "float32")
    before = [t.clone() for t in mine]
    with pytest.raises(AdasumMismatchError, match=r"tensor 1 differs: rank 1 has shape \(4, 3\) float32, rank 0 "
                                                  r"has shape \(3, 4\) float32"):
        adasum.adasum_allreduce_inplace(mine, op="mean")
    for t, b in zip(mine, before):
        assert torch.equal(t, b)


@pytest.mark.mpi(min_size=2)
def test_direct_threshold_mismatch_is_refused(comm):
    rank = comm.Get_rank()
    old = adasum.configure(plain_direct_bytes=LIMIT * (2 if rank == 1 else 1))
    try:
        with pytest.raises(AdasumMismatchError, match=r"they differ in 'plain direct bytes'"):
            adasum.adasum_allreduce(np.ones(5000, np.float32), op="sum")
    finally:
        adasum.configure(old)
    np.testing.assert_array_equal(adasum.adasum_allreduce(np.ones(5000, np.float32), op="sum"), comm.Get_size())


def test_in_place_torch_tensors_are_marked_as_changed(comm):
    t = torch.ones(3000)
    version = t._version
    adasum.adasum_allreduce_inplace([t], op="sum")
    assert t._version > version or comm.Get_size() == 1
    assert torch.all(t == comm.Get_size())


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_views_of_one_buffer_go_as_one_message_without_a_copy(comm, kind):
    """Tensors back to back in one block (views of one flat buffer, as a device round trip's host copies
    are) vote for the fused message and are reduced where they lie; a rank whose tensors lie apart packs
    them into the one message."""
    size, rank = comm.Get_size(), comm.Get_rank()
    sizes = [3000, 5, 2048, 1]
    flat = np.arange(sum(sizes), dtype=np.float32) + rank
    apart = rank == 1
    if kind == "torch":
        flat = torch.from_numpy(flat)
    views = [v.clone() if apart and kind == "torch" else (v.copy() if apart else v)
             for v in (flat.split(sizes) if kind == "torch" else np.split(flat, np.cumsum(sizes)[:-1]))]
    with adasum.count_traffic() as t:
        adasum.adasum_allreduce_inplace(views, op="mean")
    assert t.collectives == 2  # the agreement and the one message
    assert t.copied_bytes == (2 * 4 * sum(sizes) if apart else 0)
    want = np.arange(sum(sizes), dtype=np.float64) + (size - 1) / 2
    np.testing.assert_array_equal(np.concatenate([_np(v) for v in views]), want.astype(np.float32))
