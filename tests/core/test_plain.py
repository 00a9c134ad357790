"""``sum`` and ``mean`` of host tensors where they lie (adasum.call.plain) and in one compiled call
(adasum.call.small_plain): exact results, the copies and collectives they make, the same bits whichever
path each rank takes, and the ranks that disagree, take the general path or come late."""

from __future__ import annotations

import logging
import platform
import re
import time

import numpy as np
import pytest
from helpers import torch  # imported at first use: the numpy tests run without torch

import adasum
from adasum import AdasumMismatchError
from adasum.call import plain
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


# Below LIMIT in float32 and float64: calls of these shapes are the compiled small plain call's.
SMALL = [(500,), (1,), (0,), (5, 7), (20, 20), (64,)]


def _compiled_here() -> bool:
    """Whether small host calls run as one compiled call here (native_mpi on): the platforms the extension
    binds MPI on, with the compiled kernels in use."""
    return (platform.system() == "Linux" and platform.machine() in ("x86_64", "aarch64")
            and adasum.kernels_backend() == "c")


def _random(rank: int, dtype: str, seed: int = 7) -> list[np.ndarray]:
    """Values whose sums round: the paths must agree bit for bit, not only to within rounding."""
    rng = np.random.default_rng([seed, rank])
    scale = 1000 if np.dtype(dtype).kind in "iu" else 1
    return [(rng.standard_normal(s) * scale).astype(dtype) for s in SMALL]


def _one_buffer(mine: list, kind: str) -> list:
    """Copies of ``mine`` as views of one flat buffer (for torch, of one tensor: one storage)."""
    flat = np.concatenate([x.reshape(-1) for x in mine])
    if kind == "torch":
        return [v.view(x.shape) for v, x in zip(torch.from_numpy(flat).split([x.size for x in mine]), mine)]
    return [v.reshape(x.shape) for v, x in zip(np.split(flat, np.cumsum([x.size for x in mine])[:-1]), mine)]


def _every_way(mine: list, kind: str, op: str) -> tuple[list[bytes], list[tuple]]:
    """The call made in place on separate tensors, in place on views of one buffer, and out of place:
    each result's bytes, and what each call counted (compiled calls, collectives, copied bytes)."""
    results, counts = [], []
    for way in ("separate", "views", "out of place"):
        tensors = _one_buffer(mine, kind) if way == "views" else [x.copy() for x in mine]
        if kind == "torch" and way != "views":
            tensors = [torch.from_numpy(t) for t in tensors]
        with adasum.count_traffic() as t:
            if way == "out of place":
                out = adasum.adasum_allreduce(tensors, op=op)
                assert all(type(o) is type(x) for o, x in zip(out, tensors))
            else:
                out = adasum.adasum_allreduce_inplace(tensors, op=op)
                assert out is tensors
        assert [tuple(o.shape) for o in out] == SMALL
        results.append(b"".join(_np(o).tobytes() for o in out))
        counts.append((t.compiled_calls, t.collectives, t.copied_bytes))
    return results, counts


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("dtype", ["float32", "float64", "int64", "int32"])
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_the_compiled_small_plain_call_gives_the_bits_of_the_python_one(comm, kind, dtype, op):
    """The small call made in one compiled call (agreement, packing, the allreduce, the mean's division)
    and the same call made step by step in Python: the same bits, the same collectives and copies, in place
    on separate tensors, on views of one buffer (reduced where they lie) and out of place."""
    if op == "mean" and dtype.startswith("int"):
        pytest.skip("mean takes floats only")
    size, rank = comm.Get_size(), comm.Get_rank()
    mine = _random(rank, dtype)
    seen = {}
    try:
        for native in (False, True):
            adasum.configure(native_mpi=native)
            seen[native] = _every_way(mine, kind, op)
    finally:
        adasum.configure(native_mpi=True)
    (python, python_counts), (native, native_counts) = seen[False], seen[True]
    assert native == python
    assert len(set(python)) == 1  # every way of passing the tensors gives the same bits
    compiled = int(_compiled_here() and size > 1)
    nbytes = sum(x.nbytes for x in mine)
    assert [c[0] for c in native_counts] == [compiled] * 3, f"rank {rank}: {native_counts}"
    assert [c[0] for c in python_counts] == [0] * 3
    assert [c[1:] for c in native_counts] == [c[1:] for c in python_counts]
    if size > 1:
        assert [c[1:] for c in python_counts] == [(2, 2 * nbytes), (2, 0), (2, nbytes)]
    exact = [sum(_random(r, dtype)[i].astype(np.float64) for r in range(size)) for i in range(len(SMALL))]
    got = np.frombuffer(native[0], dtype=dtype)
    want = np.concatenate([(e / size if op == "mean" else e).reshape(-1) for e in exact])
    np.testing.assert_allclose(got, want, rtol=1e-5 if dtype == "float32" else 1e-12, atol=1e-5)
    assert_identical_across_ranks(comm, [got])


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_ranks_may_mix_the_compiled_and_the_python_plain_call(comm, kind, op):
    """In one call, some ranks make the compiled small plain call, some the Python one (native_mpi off, or
    tensors it does not take: not contiguous), some with their tensors back to back (which votes for one
    fused message): the same collectives, the same bits as every rank on the Python path; and a rank
    that disagrees makes every rank raise, whichever way it made the call, before anything is written."""
    size, rank, last = comm.Get_size(), comm.Get_rank(), comm.Get_size() - 1
    mine = _random(rank, "float32", seed=9)
    adasum.configure(native_mpi=False)
    try:
        want, _ = _every_way(mine, kind, op)
    finally:
        adasum.configure(native_mpi=True)
    way = rank % 4  # 0: compiled, 1: Python, 2: not contiguous (Python), 3: views of one buffer (compiled)
    try:
        adasum.configure(native_mpi=way != 1)
        for inplace in (True, False):
            if way == 2:
                spread = [np.zeros((*x.shape, 2), x.dtype) for x in mine]
                for s, x in zip(spread, mine):
                    s[..., 1] = x
                tensors = [s[..., 1] for s in spread]  # every other element
            else:
                tensors = [x.copy() for x in mine]
            if kind == "torch":
                tensors = [torch.from_numpy(t) for t in tensors]
            if way == 3:
                tensors = _one_buffer(mine, kind)
            with adasum.count_traffic() as t:
                out = (adasum.adasum_allreduce_inplace if inplace else adasum.adasum_allreduce)(tensors, op=op)
            assert t.collectives == 2
            assert t.compiled_calls == int(_compiled_here() and way in (0, 3))
            assert b"".join(np.ascontiguousarray(_np(o)).tobytes() for o in out) == want[0]
        bad = [x.copy() for x in mine]
        if rank == last:
            bad[4] = bad[4][:-1].copy()
        tensors = [torch.from_numpy(b) for b in bad] if kind == "torch" else bad
        with pytest.raises(AdasumMismatchError, match=rf"\(raised on rank {rank}\) tensor 4 differs: rank {last} "
                                                      r"has shape \(19, 20\) float32, rank 0 has shape \(20, 20\)"):
            adasum.adasum_allreduce_inplace(tensors, op=op)
        for b, x in zip(bad[:4], mine[:4]):
            assert b.tobytes() == x.tobytes()  # nothing written
    finally:
        adasum.configure(native_mpi=True)
    again = adasum.adasum_allreduce([x.copy() for x in mine], op=op)  # the communicator still works
    assert b"".join(_np(o).tobytes() for o in again) == want[0]


@pytest.mark.mpi(min_size=2)
def test_overlapping_tensors_in_place_take_the_python_path(comm):
    """In place on tensors that share memory the results are written back one by one (the Python path);
    the compiled call leaves them to it before sending anything."""
    size = comm.Get_size()
    base = np.arange(100, dtype=np.float64)
    with adasum.count_traffic() as t:
        adasum.adasum_allreduce_inplace([base[:60], base[40:]], op="sum")
    assert t.compiled_calls == 0 and t.collectives == 2
    np.testing.assert_array_equal(base, np.arange(100, dtype=np.float64) * size)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("native", [False, True], ids=["python", "compiled"])
def test_an_allreduce_waiting_past_the_patience_goes_to_the_stall_inspector(comm, caplog, monkeypatch, native):
    """After the agreement, a rank late to the allreduce itself (here: rank 1, slowed on the Python path) is
    waited for by the stall inspector like a rank late to the agreement: the compiled call hands its
    request over, the lowest waiting rank warns naming the late rank, and the call completes."""
    size, rank = comm.Get_size(), comm.Get_rank()
    mine = _random(rank, "float64", seed=11)
    old = adasum.configure(stall_warning=0.3, stall_timeout=None, native_mpi=native and rank != 1)
    try:
        if rank == 1:
            agree = plain.agree

            def slow(*args, **kwargs):  # agrees, then comes late to the allreduce
                out = agree(*args, **kwargs)
                time.sleep(1.2)
                return out

            monkeypatch.setattr(plain, "agree", slow)
        dup = comm.Dup()
        with caplog.at_level(logging.WARNING, logger="adasum"), adasum.count_traffic(dup) as t:
            out = adasum.adasum_allreduce(mine, op="mean", comm=dup)
        monkeypatch.undo()
        want = [sum(_random(r, "float64", seed=11)[i] for r in range(size)) / size for i in range(len(SMALL))]
        for got, w in zip(out, want):
            np.testing.assert_allclose(got, w, rtol=1e-12, atol=1e-15)
        assert_identical_across_ranks(comm, out)
        assert t.compiled_calls == int(native and rank != 1 and _compiled_here())
        warned = [r.getMessage() for r in caplog.records if "has not entered it" in r.getMessage()]
        if rank == 0:
            assert len(warned) == 1, warned
            assert re.search(r"call #1 on a communicator of \d+ ranks \(an exchange \(a collective of "
                             r"adasum_allreduce, \d+ bytes\)\) has waited \d+\.\d s for rank 1, which has not "
                             r"entered it", warned[0]), warned
        else:
            assert not warned, warned
        for _ in range(3):  # later calls drain the waiting ranks' messages and work
            adasum.adasum_allreduce(mine, op="mean", comm=dup)
        dup.Free()
    finally:
        adasum.configure(old)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("size", [8, 5000], ids=["compiled-small", "direct"])
def test_mean_is_the_sum_divided_in_the_dtype_bit_for_bit(comm, kind, dtype, size):
    """Whatever the path (and a power-of-two world divides by multiplying with the exact reciprocal), the
    mean is the sum divided by the world size as numpy rounds the division, down to subnormal results."""
    rank, p = comm.Get_rank(), comm.Get_size()
    tiny = np.finfo(dtype).tiny
    rng = np.random.default_rng(rank)
    values = rng.standard_normal(size).astype(dtype)
    values[:4] = np.array([tiny * 3, -tiny * 5, np.finfo(dtype).max / 8, 1.0], dtype=dtype)
    wrap = (lambda a: torch.from_numpy(a.copy())) if kind == "torch" else (lambda a: a.copy())
    total = adasum.adasum_allreduce(wrap(values), op="sum", comm=comm)
    mean = adasum.adasum_allreduce(wrap(values), op="mean", comm=comm)
    total, mean = np.asarray(total), np.asarray(mean)
    assert np.array_equal(mean, np.divide(total, np.dtype(dtype).type(p))), (p, dtype)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("op", ["adasum", "sum", "mean"])
def test_one_rank_in_place_copies_nothing_and_keeps_every_bit(kind, op):
    """On one rank the tensors already hold the result: an in-place call checks them and moves nothing
    (it used to pack them into a buffer and write them back); out of place it still returns copies."""
    from mpi4py import MPI

    comm = MPI.COMM_SELF
    rng = np.random.default_rng(5)
    layers = [rng.standard_normal(n).astype(dt) for n, dt in ((300, np.float32), (7, np.float32), (50, np.float64))]
    if kind == "torch":
        layers = [torch.from_numpy(x) for x in layers]
        layers.append(torch.randn(6, 4, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16))

    def values(x):
        return x.float().numpy().copy() if kind == "torch" else x.copy()

    before = [values(x) for x in layers]
    with adasum.count_traffic(comm) as t:
        out = adasum.adasum_allreduce_inplace(layers, op=op, comm=comm)
    assert out is layers and t.copied_bytes == 0
    for b, x in zip(before, layers):
        np.testing.assert_array_equal(values(x), b)
    copies = adasum.adasum_allreduce(layers, op=op, comm=comm)
    for c, x in zip(copies, layers):
        assert c is not x and c.shape == x.shape
        if kind == "torch":
            assert c.data_ptr() != x.data_ptr() and torch.equal(c, x)
        else:
            assert not np.shares_memory(c, x) and np.array_equal(c, x)
    ro = np.ones(4, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only|writ"):
        adasum.adasum_allreduce_inplace([ro], op=op, comm=comm)
