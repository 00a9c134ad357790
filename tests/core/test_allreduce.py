"""adasum_allreduce at any world size against the serial reference and the rule's properties."""

from __future__ import annotations

import gc
import platform

import numpy as np
import pytest
from helpers import torch  # imported at first use: the numpy tests run without torch
from mpi4py import MPI

import adasum
from adasum import AdasumMismatchError
from adasum.runtime.context import context_for
from adasum.rule.reference import reference_allreduce
from helpers import (EPS, KIND_DTYPES, KINDS, all_ranks_data, as_f64, assert_identical_across_ranks, kind_context,
                     make, rel_l2)

pytestmark = pytest.mark.mpi(min_size=1)


@pytest.fixture(autouse=True, params=["halving", "doubling"])
def algorithm(request):
    """Every test runs under both schedules: recursive halving (threshold 0) and recursive doubling of
    whole vectors (every call below the threshold)."""
    before = adasum.get_small_message_bytes()
    adasum.set_small_message_bytes(0 if request.param == "halving" else 1 << 40)
    yield request.param
    adasum.set_small_message_bytes(before)


def _tolerance(dtype: str, size: int) -> float:
    """The accepted relative L2 error against the float64 reference of the dtype-rounded inputs.

    32/64-bit: 100·eps. 16-bit types round the combined vector to the dtype after every level of the
    tree, so the bound grows with the depth: 4·eps·(levels + 1).
    """
    if dtype in ("float32", "float64"):
        return 100 * EPS[dtype]
    levels = max(1, (size - 1).bit_length())
    return 4 * EPS[dtype] * (levels + 1)


def _layer_sizes(rng) -> list[int]:
    sizes = [0, 1, int(rng.integers(2, 40)) * 2 + 1, int(rng.integers(100, 300)), 0, 7, int(rng.integers(1, 5))]
    sizes.append(sum(sizes) + int(rng.integers(1, 500)))  # one layer larger than all others together
    order = rng.permutation(len(sizes))
    return [sizes[i] for i in order]


def _random_layers(seed: int, rank: int, sizes, dtype: str, kind: str):
    """Rank ``rank``'s layers as float64 values already rounded to ``dtype`` (what the library sees)."""
    rng = np.random.default_rng([seed, rank])
    shapes = [(s,) if i % 3 else ((1, s) if s % 2 else (2, s // 2)) for i, s in enumerate(sizes)]
    # Each layer has a shared part, so layers are neither orthogonal nor parallel across ranks.
    shared = [np.random.default_rng([seed, 99, i]).standard_normal(shape) for i, shape in enumerate(shapes)]
    vals = [0.7 * sh + rng.standard_normal(sh.shape) * rng.uniform(0.2, 3.0) for sh in shared]
    return [as_f64(make(v, kind, dtype)) for v in vals]


@pytest.mark.parametrize("kind,dtype", KIND_DTYPES)
@pytest.mark.parametrize("op", ["adasum", "sum", "mean"])
def test_matches_reference(comm, kind, dtype, op):
    size, rank = comm.Get_size(), comm.Get_rank()
    for seed in range(3):
        sizes = _layer_sizes(np.random.default_rng(seed))
        data = all_ranks_data(comm, lambda r: _random_layers(seed, r, sizes, dtype, kind))
        inputs = [make(v, kind, dtype) for v in data[rank]]
        before = [as_f64(t).copy() for t in inputs]
        with kind_context(kind):
            out = adasum.adasum_allreduce(inputs, op=op)
        want = reference_allreduce(data, op)
        assert len(out) == len(inputs)
        for i, (o, t, w) in enumerate(zip(out, inputs, want)):
            assert type(o) is type(t) and tuple(o.shape) == tuple(t.shape) and o.dtype == t.dtype
            err = rel_l2(as_f64(o), w)
            assert err <= _tolerance(dtype, size), f"{op} {kind} {dtype} tensor {i}: relative error {err:.3g}"
        for b, t in zip(before, inputs):  # out-of-place leaves the inputs alone
            np.testing.assert_array_equal(as_f64(t), b)
        assert_identical_across_ranks(comm, out)


@pytest.mark.parametrize("kind,dtype", KIND_DTYPES)
def test_orthogonal_inputs_give_exact_sum(comm, kind, dtype):
    size, rank = comm.Get_size(), comm.Get_rank()
    # Rank r owns disjoint blocks of every layer, so all ranks' vectors are exactly orthogonal.
    layers = []
    for n in (size, 3 * size + 1, 64 * size):
        v = np.zeros(n)
        v[rank::size] = (rank + 1) * np.linspace(0.5, 1.5, len(v[rank::size]))
        layers.append(v)
    with kind_context(kind):
        out = adasum.adasum_allreduce([make(v, kind, dtype) for v in layers])
    for o, n in zip(out, (size, 3 * size + 1, 64 * size)):
        want = np.zeros(n)
        for r in range(size):
            want[r::size] = (r + 1) * np.linspace(0.5, 1.5, len(want[r::size]))
        np.testing.assert_array_equal(as_f64(o), as_f64(make(want, kind, dtype)))


@pytest.mark.parametrize("kind,dtype", KIND_DTYPES)
def test_parallel_inputs_give_mean(comm, kind, dtype):
    size, rank = comm.Get_size(), comm.Get_rank()
    u = np.random.default_rng(7).uniform(0.5, 1.0, size=301)
    with kind_context(kind):
        same = adasum.adasum_allreduce(make(u, kind, dtype))
        # Identical inputs come back unchanged (up to the last bit of the coefficients).
        np.testing.assert_allclose(as_f64(same), as_f64(make(u, kind, dtype)), rtol=2 * EPS[dtype])
        # Parallel inputs of different lengths give their mean; anti-parallel ones too.
        # Rank 1's vector points the other way; no subtree's mean comes near zero, where the rule's
        # coefficients would be ill-conditioned.
        scales = np.array([-0.25 if r == 1 else 1.0 + r for r in range(size)], dtype=np.float64)
        out = adasum.adasum_allreduce(make(scales[rank] * u, kind, dtype))
    want = scales.mean() * as_f64(make(u, kind, dtype))
    assert rel_l2(as_f64(out), want) <= 8 * EPS[dtype]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_parallel_extreme_magnitudes_stay_finite(comm, dtype):
    """Squared norms of such vectors overflow or underflow in the dtype itself; in float64 they do not."""
    size, rank = comm.Get_size(), comm.Get_rank()
    info = torch.finfo(getattr(torch, dtype))
    tiny, top = float(info.tiny), float(np.sqrt(info.max)) / 2.5
    scales = np.geomspace(tiny, top, 12)
    u = np.random.default_rng(3).uniform(1.0, 2.0, size=257)
    c = 1.0 + rank / size  # every rank a different length, all >= 1 so no input is subnormal
    layers = [make(s * c * u, "torch", dtype) for s in scales]
    out = adasum.adasum_allreduce(layers)
    mean_c = np.mean([1.0 + r / size for r in range(size)])
    for s, o in zip(scales, out):
        got = as_f64(o)
        assert np.isfinite(got).all(), f"non-finite result at scale {s:.3g}"
        assert rel_l2(got, s * mean_c * u) <= 8 * EPS[dtype], f"scale {s:.3g}"


@pytest.mark.parametrize("kind", KINDS)
def test_inplace_single_and_noncontiguous(comm, kind):
    size, rank = comm.Get_size(), comm.Get_rank()
    data = [np.random.default_rng([11, r]).standard_normal((6, 10)) for r in range(size)]
    want = reference_allreduce([[d[:, ::2]] for d in data], "adasum")[0]
    with kind_context(kind):
        # one array in, one array out; a non-contiguous view
        base = make(data[rank], kind, "float64")
        out = adasum.adasum_allreduce(base[:, ::2])
        assert tuple(out.shape) == (6, 5)
        np.testing.assert_allclose(as_f64(out), want, rtol=1e-12, atol=1e-12)
        # in place, into the non-contiguous view; the other columns stay untouched
        view = base[:, ::2]
        res = adasum.adasum_allreduce_inplace(view)
        np.testing.assert_allclose(as_f64(base[:, ::2]), want, rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(as_f64(base[:, 1::2]), data[rank][:, 1::2])
        assert res is view  # the in-place call returns what it was given
        # in place on a contiguous list, with the Op enum
        pair = [make(data[rank][0], kind, "float32"), make(data[rank][1], kind, "float32")]
        adasum.adasum_allreduce_inplace(pair, op=adasum.Op.SUM)
    np.testing.assert_allclose(as_f64(pair[0]), sum(d[0] for d in data), rtol=1e-5, atol=1e-5)
    assert_identical_across_ranks(comm, pair)


def test_mixed_dtypes_and_kinds_in_one_call(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    data = [[np.random.default_rng([5, r, i]).standard_normal(n) for i, n in enumerate((33, 8, 100))]
            for r in range(size)]
    mine = data[rank]
    inputs = [mine[0].astype(np.float32), torch.from_numpy(mine[1]), mine[2].astype(np.float64)]
    out = adasum.adasum_allreduce(inputs)
    want = reference_allreduce([[d[0].astype(np.float32), d[1], d[2]] for d in data])
    assert isinstance(out[1], torch.Tensor) and out[1].dtype == torch.float64
    assert out[0].dtype == np.float32
    for o, w, tol in zip(out, want, (100 * EPS["float32"], 1e-13, 1e-13)):
        assert rel_l2(as_f64(o), w) <= tol


def test_zero_size_and_empty_inputs(comm):
    out = adasum.adasum_allreduce([np.zeros(0, np.float32), np.zeros((3, 0))])
    assert [o.shape for o in out] == [(0,), (3, 0)]
    assert adasum.adasum_allreduce([]) == []


def test_integer_sum(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    out = adasum.adasum_allreduce([np.arange(5, dtype=np.int64) * (rank + 1), torch.full((3,), rank, dtype=torch.int32)],
                                  op="sum")
    np.testing.assert_array_equal(out[0], np.arange(5) * size * (size + 1) // 2)
    assert out[1].tolist() == [size * (size - 1) // 2] * 3


def test_non_finite_input_poisons_that_layer_everywhere(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    a = np.ones(50, dtype=np.float32) * (rank + 1)
    b = np.linspace(0, 1, 20).astype(np.float32)
    if rank == size - 1:
        a[17] = np.nan if size % 2 else np.inf
    out = adasum.adasum_allreduce([a, b])
    assert not np.isfinite(out[0]).all()
    assert np.isfinite(out[1]).all()
    flags = comm.allgather(bool(np.isfinite(out[0]).any()))
    assert len(set(flags)) == 1


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_sub_communicators(comm, kind):
    size, rank = comm.Get_size(), comm.Get_rank()
    color = rank % 2
    # Within each half the rank order is reversed, so the tree's pairing follows the sub-communicator.
    sub = comm.Split(color, key=size - rank)
    try:
        members = [r for r in sorted(range(size), key=lambda r: size - r) if r % 2 == color]
        data = {r: [np.random.default_rng([17, r, i]).standard_normal(n) for i, n in enumerate((5, 40, 3))]
                for r in range(size)}
        out = adasum.adasum_allreduce([make(v, kind, "float64") for v in data[rank]], comm=sub)
        want = reference_allreduce([data[r] for r in members])
        assert members[sub.Get_rank()] == rank
        for o, w in zip(out, want):
            assert rel_l2(as_f64(o), w) <= 1e-13
        assert_identical_across_ranks(sub, out)
    finally:
        sub.Free()


def test_comm_self_returns_input(comm):
    x = np.arange(4.0)
    np.testing.assert_array_equal(adasum.adasum_allreduce(x, comm=MPI.COMM_SELF), x)


def test_no_float64_copy_of_whole_buffer(comm):
    """Dot products are accumulated in float64 block by block: peak extra memory stays far below the
    float64 copy of the buffer (numpy reports its allocations to tracemalloc)."""
    import tracemalloc

    n = 1 << 20  # 4 MiB of float32; a float64 copy would be 8 MiB
    x = np.random.default_rng(comm.Get_rank()).standard_normal(n).astype(np.float32)
    adasum.adasum_allreduce(x)  # warm the kept receive buffers
    tracemalloc.start()
    try:
        adasum.adasum_allreduce(x)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # the output buffer (4 MiB) plus small change; no 8 MiB float64 temporary
    assert peak < x.nbytes + (2 << 20), f"peak traced memory {peak / 2**20:.1f} MiB"


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_inplace_on_views_of_one_buffer_needs_no_copy(comm, kind):
    """Layers that are consecutive views of one flat buffer are reduced in that buffer itself."""
    import tracemalloc

    size, rank = comm.Get_size(), comm.Get_rank()
    sizes = (1 << 18, 5, 0, 1 << 17, 3)
    data = [np.random.default_rng([23, r]).standard_normal(sum(sizes)) for r in range(size)]
    split = np.cumsum(sizes)[:-1]
    want = reference_allreduce([np.split(d, split) for d in data])
    flat = make(data[rank], kind, "float32")
    views = list(flat.split(list(sizes))) if kind == "torch" else np.split(flat, split)
    # warm-up on separate copies of the same size: the kept buffers have grown (how large depends on the
    # schedule and on what earlier tests left), so the peak below is what this call itself allocates
    adasum.adasum_allreduce_inplace([make(data[rank], kind, "float32")[:5], make(data[rank], kind, "float32")[5:]])
    tracemalloc.start()
    try:
        adasum.adasum_allreduce_inplace(views)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    for v, w in zip(views, want):
        assert rel_l2(as_f64(v), w) <= 100 * EPS["float32"]
    if kind == "numpy" and size > 1:
        # no fused copy (1.5 MiB): only the kept receive buffer, half the size, may be new
        assert peak < flat.nbytes * 0.6 + (256 << 10), f"peak {peak / 2**20:.2f} MiB"
    # the same layers out of order cannot be aliased; the result is the same
    again = [make(data[rank], kind, "float32")[:5], make(data[rank], kind, "float32")[5:]]
    adasum.adasum_allreduce_inplace(again[::-1])
    assert_identical_across_ranks(comm, views)


@pytest.fixture(params=["packed", "direct", "split"])
def chunk_bytes(request):
    """How halving treats separate tensors, by call size (the settings direct_min_bytes and
    split_min_bytes): "packed" as small calls (packed, written back), "direct" as mid-size ones (read and
    combined where they lie, what is sent packed first), "split" as large ones (one message per layer
    piece of at least chunk_bytes, here 64, and per run of smaller pieces)."""
    changes = {"packed": {}, "direct": {"direct_min_bytes": 0},
               "split": {"direct_min_bytes": 0, "split_min_bytes": 0, "chunk_bytes": 64}}[request.param]
    old = adasum.configure(**changes)
    yield request.param
    adasum.configure(old)


def test_unpacked_inputs_give_the_bits_of_the_packed_path(comm, algorithm, chunk_bytes):
    """Separate tensors are read where they lie (out of place and in place) and, in place, combined and
    gathered there too; the result must be bitwise that of the packed path (views of one flat buffer,
    reduced in that buffer)."""
    rank = comm.Get_rank()
    rng = np.random.default_rng([11, rank])
    sizes = (1000, 3, 0, 4097, 77)
    layers = [rng.standard_normal(n).astype(np.float32) for n in sizes]
    flat = np.concatenate(layers)
    views = np.split(flat, np.cumsum(sizes)[:-1])
    before = [t.copy() for t in layers]
    out = adasum.adasum_allreduce(layers)
    for i, (t, b) in enumerate(zip(layers, before)):
        np.testing.assert_array_equal(t, b, err_msg=f"input {i} modified")
    inplace = [t.copy() for t in layers]
    adasum.adasum_allreduce_inplace(inplace)
    adasum.adasum_allreduce_inplace(views)
    for i, (o, c, v) in enumerate(zip(out, inplace, views)):
        assert o.tobytes() == v.tobytes(), f"tensor {i}: out of place differs from the packed path"
        assert c.tobytes() == v.tobytes(), f"tensor {i}: in place differs from the packed path"
    assert_identical_across_ranks(comm, out)


def test_ranks_may_hold_their_tensors_differently(comm, algorithm, chunk_bytes):
    """Some ranks pass views of one buffer, some separate arrays, some non-contiguous ones: the messages
    are cut the same way on every rank, and the bits are those of the all-views call."""
    rank = comm.Get_rank()
    rng = np.random.default_rng([12, rank])
    sizes = (5000, 1, 0, 333, 20000, 64)
    layers = [rng.standard_normal(n).astype(np.float64) for n in sizes]
    views = np.split(np.concatenate(layers), np.cumsum(sizes)[:-1])
    adasum.adasum_allreduce_inplace(views)
    if rank % 3 == 0:
        mine = np.split(np.concatenate(layers), np.cumsum(sizes)[:-1])
    elif rank % 3 == 1:
        mine = [t.copy() for t in layers]
    else:
        mine = [np.repeat(t, 2)[::2] for t in layers]  # non-contiguous: packed
    adasum.adasum_allreduce_inplace(mine)
    for i, (m, v) in enumerate(zip(mine, views)):
        assert np.ascontiguousarray(m).tobytes() == v.tobytes(), f"rank {rank} tensor {i} differs"


def test_in_place_on_overlapping_tensors_writes_each_result(comm, algorithm):
    """The same tensor twice (or overlapping views) cannot be combined in place piece by piece: the call
    packs them and writes each result back in order, as for any other in-place call."""
    x = np.random.default_rng([13, comm.Get_rank()]).standard_normal(3000)
    want = adasum.adasum_allreduce([x, x[1000:]])
    adasum.adasum_allreduce_inplace([x, x[1000:]])
    np.testing.assert_array_equal(x[:1000], want[0][:1000])
    np.testing.assert_array_equal(x[1000:], want[1])


@pytest.mark.parametrize("many", [False, True], ids=["two", "forty"])
def test_in_place_on_overlapping_torch_tensors_writes_each_result(comm, algorithm, many):
    """Torch tensors reach the compiled small call as addresses; overlapping ones in place are found there
    before anything is sent (a few tensors pair by pair, many sorted) and take the path that writes each
    result back in order: the bits of the same call out of place, written back in order. Apart, the same
    tensors take the compiled call."""
    rng = np.random.default_rng([23, comm.Get_rank()])
    x = torch.from_numpy(rng.standard_normal(1300))  # small calls: 12.5 KiB at most
    parts = [x[i * 30:i * 30 + 40] for i in range(40)] if many else [x[:600], x[200:600]]
    want = adasum.adasum_allreduce(parts)
    expect = x.clone()
    for part, w in zip(parts, want):  # written back one by one, in order
        expect[part.storage_offset():part.storage_offset() + part.numel()] = w
    with adasum.count_traffic() as t:
        adasum.adasum_allreduce_inplace(parts)
    assert t.compiled_calls == 0 or comm.Get_size() == 1
    assert x.numpy().tobytes() == expect.numpy().tobytes()
    apart = [p.clone() for p in want]
    with adasum.count_traffic() as t:
        adasum.adasum_allreduce_inplace(apart)
    if algorithm == "doubling" and comm.Get_size() > 1 and platform.system() == "Linux" \
            and platform.machine() in ("x86_64", "aarch64") and adasum.kernels_backend() == "c":
        # where small host calls run as one compiled call
        assert t.compiled_calls == 1


@pytest.mark.parametrize("op", ["adasum", "sum", "mean"])
@pytest.mark.parametrize("n", [1, 64, 40_000])
def test_negated_torch_views_are_read_and_written_as_their_values(comm, algorithm, op, n):
    """``z.conj().imag`` is a float tensor whose memory holds the negated values (torch's negative bit):
    every path reads it as its values, not its memory (the small calls take tensors' addresses), and in
    place writes the result as torch would; the bits of the same call on resolved copies."""
    rng = np.random.default_rng([29, comm.Get_rank(), n])
    z = torch.complex(torch.from_numpy(rng.standard_normal(n).astype(np.float32)),
                      torch.from_numpy(rng.standard_normal(n).astype(np.float32)))
    u = torch.from_numpy(rng.standard_normal(n + 3).astype(np.float32))
    neg = z.conj().imag
    assert neg.is_neg()
    want = adasum.adasum_allreduce([neg.resolve_neg().clone(), u.clone()], op=op)
    got = adasum.adasum_allreduce([neg, u.clone()], op=op)
    assert got[0].resolve_neg().numpy().tobytes() == want[0].numpy().tobytes()
    assert got[1].numpy().tobytes() == want[1].numpy().tobytes()
    mine = [z.clone().conj().imag, u.clone()]
    adasum.adasum_allreduce_inplace(mine, op=op)
    assert mine[0].resolve_neg().numpy().tobytes() == want[0].numpy().tobytes()
    assert mine[1].numpy().tobytes() == want[1].numpy().tobytes()


def test_torch_cpu_tensors_apart_are_combined_where_they_lie(comm, algorithm, chunk_bytes):
    """In place on separate CPU tensors (2-D ones too): the bits of the packed path, and autograd sees the
    tensors as modified in place."""
    rank = comm.Get_rank()
    rng = np.random.default_rng([14, rank])
    shapes = [(30, 7), (1,), (0, 3), (5000,), (64, 65)]
    layers = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    flat = np.concatenate([x.ravel() for x in layers])
    tensors = [torch.from_numpy(x.copy()) for x in layers]
    versions = [t._version for t in tensors]
    adasum.adasum_allreduce_inplace(tensors)
    got = np.concatenate([t.numpy().ravel() for t in tensors])
    # the packed path: the same layers as views of one buffer, reduced in that buffer
    views = np.split(flat.copy(), np.cumsum([x.size for x in layers])[:-1])
    adasum.adasum_allreduce_inplace(views)
    assert got.tobytes() == np.concatenate(views).tobytes()
    if comm.Get_size() > 1:
        assert all(t._version > v for t, v in zip(tensors, versions))


@pytest.mark.parametrize("op", ["adasum", "sum", "mean"])
def test_torch_views_of_one_tensor_are_marked_modified(comm, algorithm, op):
    """In place on views of one flat tensor (reduced in its memory, with no copy): autograd sees every
    view as modified in place, as it does for a torch in-place operation, on the first call and on a
    later one with the same tensors (the kept plan)."""
    rank = comm.Get_rank()
    flat = torch.from_numpy(np.random.default_rng([15, rank]).standard_normal(6000).astype(np.float32))
    views = list(flat.split([1000, 0, 2000, 3000]))
    for _ in range(2):
        want = adasum.adasum_allreduce([v.clone() for v in views], op=op)
        versions = [t._version for t in views]
        adasum.adasum_allreduce_inplace(views, op=op)
        for i, (t, w) in enumerate(zip(views, want)):
            assert t.numpy().tobytes() == w.numpy().tobytes(), f"rank {rank}: tensor {i} differs"
        if comm.Get_size() > 1:
            assert all(t._version > v for t, v in zip(views, versions)), f"rank {rank}: {versions}"


def test_torch_cpu_tensors_travel_as_numpy_arrays_do(comm, algorithm, chunk_bytes):
    """Torch CPU tensors make the messages numpy arrays make (the same count and bytes), in place and out of
    place, and the results are bitwise those of numpy."""
    rank = comm.Get_rank()
    rng = np.random.default_rng([16, rank])
    layers = [rng.standard_normal(n).astype(np.float32) for n in (3000, 1, 0, 700, 5000, 64)]
    runs = {}
    for kind in ("numpy", "torch"):
        wrap = (lambda x: torch.from_numpy(x.copy())) if kind == "torch" else (lambda x: x.copy())
        inplace = [wrap(x) for x in layers]
        with adasum.count_traffic(comm) as t1:
            adasum.adasum_allreduce_inplace(inplace, comm=comm)
        with adasum.count_traffic(comm) as t2:
            out = adasum.adasum_allreduce([wrap(x) for x in layers], comm=comm)
        runs[kind] = ((t1, t2), [np.asarray(t).tobytes() for t in inplace + list(out)])
    assert runs["torch"][0] == runs["numpy"][0], f"rank {rank}: torch {runs['torch'][0]} numpy {runs['numpy'][0]}"
    assert runs["torch"][1] == runs["numpy"][1], f"rank {rank}: torch results differ from numpy's"
    if comm.Get_size() > 1:
        assert runs["numpy"][0][0].messages > 0


def _mixed_layers(rank: int, dtype: str):
    rng = np.random.default_rng([15, rank])
    sizes = (700, 1, 0, 33, 2000, 64)
    return [rng.standard_normal(n).astype(dtype) for n in sizes]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_compiled_small_call_gives_the_bits_of_the_python_one(comm, algorithm, dtype):
    """The small call made in one compiled call (agreement, messages and kernels) and the same call made
    step by step in Python: the same bits, in place on separate arrays, on views of one buffer, on torch
    CPU tensors and out of place."""
    compiled_here = platform.system() == "Linux" and platform.machine() in ("x86_64", "aarch64")
    rank = comm.Get_rank()
    layers = _mixed_layers(rank, dtype)
    results = {}
    try:
        for native in (False, True):
            adasum.configure(native_mpi=native)
            with adasum.count_traffic(comm) as traffic:
                separate = [x.copy() for x in layers]
                adasum.adasum_allreduce_inplace(separate, comm=comm)
                views = np.split(np.concatenate(layers), np.cumsum([len(x) for x in layers])[:-1])
                adasum.adasum_allreduce_inplace(views, comm=comm)
                tensors = [torch.from_numpy(x.copy()) for x in layers]
                adasum.adasum_allreduce_inplace(tensors, comm=comm)
                out = adasum.adasum_allreduce(layers, comm=comm)
            # the second pass finds the plans of the first: all four calls are compiled where they can be
            compiled = 4 if native and compiled_here and adasum.current_settings().kernels == "c" and algorithm == "doubling" and comm.Get_size() > 1 else 0
            assert traffic.compiled_calls == compiled, f"rank {rank}: {traffic.compiled_calls} compiled calls"
            results[native] = [np.concatenate(r).tobytes() for r in
                               (separate, views, [t.numpy() for t in tensors], [np.asarray(o) for o in out])]
    finally:
        adasum.configure(native_mpi=True)
    assert results[True] == results[False]
    assert len(set(results[True])) == 1  # every way of passing the tensors gives the same bits


def test_small_calls_on_torch_tensors_follow_their_memory(comm, algorithm):
    """Small calls keep numpy views of torch tensors between calls (the compiled one reads their addresses
    at every call). The same tensor objects with new
    memory (``.data`` replaced, ``set_``), transposed in place (same shape, not contiguous), or other
    tensors at the same addresses must each give the result of fresh tensors, in their current memory."""
    rank = comm.Get_rank()
    rng = np.random.default_rng([17, rank])
    values = [rng.standard_normal(s).astype(np.float32) for s in ((40, 40), (300,), (7,))]

    def want():
        fresh = [torch.from_numpy(v.copy()) for v in values]
        adasum.adasum_allreduce_inplace(fresh, comm=comm)
        return [f.numpy().tobytes() for f in fresh]

    expected = want()
    tensors = [torch.from_numpy(v.copy()) for v in values]
    for step in range(2):  # the second call finds the views it kept
        for t, v in zip(tensors, values):
            t.copy_(torch.from_numpy(v))
        adasum.adasum_allreduce_inplace(tensors, comm=comm)
        assert [t.numpy().tobytes() for t in tensors] == expected, f"rank {rank}, call {step}"
    old = tensors[1]
    tensors[1].data = torch.from_numpy(values[1].copy())  # same object, other memory
    tensors[2].set_(torch.from_numpy(values[2].copy()))
    tensors[0].copy_(torch.from_numpy(values[0]))
    adasum.adasum_allreduce_inplace(tensors, comm=comm)
    assert [t.numpy().tobytes() for t in tensors] == expected
    assert old is tensors[1]
    # the same object restrided in place: same shape and address, every other element of its storage
    spread = torch.zeros(2 * values[1].size)
    spread[0::2] = torch.from_numpy(values[1])
    tensors[1].set_(spread.untyped_storage(), 0, (values[1].size,))
    for t, v in ((tensors[0], values[0]), (tensors[2], values[2])):
        t.copy_(torch.from_numpy(v))
    adasum.adasum_allreduce_inplace(tensors, comm=comm)  # contiguous: keeps views of the new memory
    tensors[1].set_(spread.untyped_storage(), 0, (values[1].size,))
    for t, v in ((tensors[0], values[0]), (tensors[2], values[2])):
        t.copy_(torch.from_numpy(v))
    spread[0::2] = torch.from_numpy(values[1])
    address = tensors[1].data_ptr()
    tensors[1].as_strided_((values[1].size,), (2,))
    assert not tensors[1].is_contiguous() and tensors[1].data_ptr() == address
    adasum.adasum_allreduce_inplace(tensors, comm=comm)
    assert [np.ascontiguousarray(t.numpy()).tobytes() for t in tensors] == expected
    # new tensor objects, possibly at the addresses of freed ones
    for _ in range(3):
        del tensors
        tensors = [torch.from_numpy(v.copy()) for v in values]
        adasum.adasum_allreduce_inplace(tensors, comm=comm)
        assert [t.numpy().tobytes() for t in tensors] == expected
    # freed tensors leave nothing behind: no kept view holds their memory
    torch_adapter = context_for(comm).adapters.of("torch")
    if algorithm == "halving":  # the compiled small call (doubling) takes their addresses and keeps no views
        assert torch_adapter.kept_view_lists(), "the views of the live tensors are kept"
    del tensors, old
    gc.collect()
    assert not torch_adapter.kept_view_lists(), f"rank {rank}: views of freed tensors are still kept"


def test_ranks_may_mix_compiled_and_python_small_calls(comm, algorithm):
    """Half the ranks make the compiled small call, half the Python one: same messages, same bits; and a
    disagreement raises on every rank, whichever way it made the call."""
    rank = comm.Get_rank()
    layers = _mixed_layers(rank, "float32")
    want = [x.copy() for x in layers]
    adasum.adasum_allreduce_inplace(want, comm=comm)
    try:
        adasum.configure(native_mpi=rank % 2 == 0)
        mine = [x.copy() for x in layers]
        adasum.adasum_allreduce_inplace(mine, comm=comm)
        assert np.concatenate(mine).tobytes() == np.concatenate(want).tobytes()
        if comm.Get_size() > 1:
            bad = [x.copy() for x in layers]
            if rank == comm.Get_size() - 1:
                bad[4] = bad[4][:-1].copy()
            with pytest.raises(AdasumMismatchError, match=r"tensor 4 differs"):
                adasum.adasum_allreduce_inplace(bad, comm=comm)
            assert np.concatenate(bad[:4]).tobytes() == np.concatenate(layers[:4]).tobytes()  # nothing written
    finally:
        adasum.configure(native_mpi=True)
    again = [x.copy() for x in layers]
    adasum.adasum_allreduce_inplace(again, comm=comm)  # the communicator still works
    assert np.concatenate(again).tobytes() == np.concatenate(want).tobytes()
