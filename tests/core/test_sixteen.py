"""float16 and bfloat16 Adasum on the host: bit for bit the serial reference computed the same way (float64
dot products and combine, every level's result rounded to the input dtype), on every instruction set the
compiled kernels have on this machine and on the numpy kernels, under both schedules, the compiled small
call, and in place on tensors that lie apart; at the edges of the 16-bit ranges too (subnormals, values
near float16's largest, infinities, NaN)."""

from __future__ import annotations

import platform
import sys

import numpy as np
import pytest
from helpers import torch  # imported at first use: the numpy tests run without torch

import adasum
from adasum.rule.reference import reference_allreduce

from helpers import as_f64, assert_identical_across_ranks, make

pytestmark = pytest.mark.mpi(min_size=1)

# (kind, dtype): numpy float16, torch CPU float16 and bfloat16
SIXTEEN = [("numpy", "float16"), ("torch", "float16"), ("torch", "bfloat16")]
# the compiled kernels capped at each instruction set (a cap above what the CPU has runs the widest it has),
# and the numpy kernels
BACKENDS = [("c", "auto"), ("c", "avx2"), ("c", "portable"), ("numpy", "auto")]


@pytest.fixture(params=["doubling", "halving"])
def schedule(request):
    old = adasum.configure(small_message_bytes=None if request.param == "doubling" else 0)
    yield request.param
    adasum.configure(old)


@pytest.fixture(params=BACKENDS, ids=lambda b: b[0] if b[0] == "numpy" else b[1])
def backend(request):
    kernels, isa = request.param
    old = adasum.configure(kernels=kernels, kernels_isa=isa)
    yield request.param
    adasum.configure(old)


def _layers(rank: int, seed: int) -> list[np.ndarray]:
    """Rank ``rank``'s layers (float64): a shared part, so that layers are neither orthogonal nor parallel,
    lengths around the kernels' 8- and 32-element steps, an empty layer and one of one element."""
    sizes = [1, 7, 8, 33, 0, 300, 1025]
    rng = np.random.default_rng([seed, rank])
    out = []
    for i, n in enumerate(sizes):
        shared = np.random.default_rng([seed, 99, i]).standard_normal(n)
        out.append(0.7 * shared + rng.standard_normal(n) * rng.uniform(0.2, 3.0))
    return out


def _bits(x: np.ndarray) -> np.ndarray:
    """The float64 bits of ``x`` with every NaN alike (NaN payloads are not part of the contract)."""
    x = np.array(x, dtype=np.float64)
    x[np.isnan(x)] = np.nan
    return x.view(np.uint64)


def _assert_reference(comm, inputs, out, dtype: str, what: str) -> None:
    """``out`` is, bit for bit, the reference computed the same way from every rank's ``inputs``."""
    per_rank = comm.allgather([as_f64(t) for t in inputs])
    want = reference_allreduce(per_rank, "adasum", dtype=dtype)
    for i, (o, w) in enumerate(zip(out, want)):
        got = as_f64(o)
        bad = np.flatnonzero(_bits(got).ravel() != _bits(w).ravel())
        assert bad.size == 0, (f"{what}: tensor {i} differs from the reference at {bad.size} of {got.size} "
                               f"elements, first {bad[0]}: {got.ravel()[bad[0]]!r} != {w.ravel()[bad[0]]!r}")
    assert_identical_across_ranks(comm, out)


@pytest.mark.parametrize("kind,dtype", SIXTEEN)
def test_matches_the_reference_bit_for_bit(comm, schedule, backend, kind, dtype):
    rank = comm.Get_rank()
    for seed in range(2):
        inputs = [make(v, kind, dtype) for v in _layers(rank, seed)]
        # twice: the second call of a kept plan takes the compiled small call where it can
        for attempt in range(2):
            out = adasum.adasum_allreduce(inputs)
            assert all(o.dtype == t.dtype and o.shape == t.shape for o, t in zip(out, inputs))
            _assert_reference(comm, inputs, out, dtype, f"{kind} {dtype} seed {seed} call {attempt}")


@pytest.mark.parametrize("kind,dtype", SIXTEEN)
def test_inplace_on_tensors_apart_matches_the_reference(comm, schedule, kind, dtype):
    """In place on separate tensors, read and combined where they lie (halving) or written where they lie
    (doubling), with no fused buffer: the same bits."""
    rank = comm.Get_rank()
    old = adasum.configure(direct_min_bytes=0, split_min_bytes=0, chunk_bytes=64)
    try:
        inputs = [make(v, kind, dtype) for v in _layers(rank, 5)]
        before = [make(as_f64(t), kind, dtype) for t in inputs]
        for _ in range(2):
            tensors = [make(as_f64(t), kind, dtype) for t in before]
            adasum.adasum_allreduce_inplace(tensors)
            _assert_reference(comm, before, tensors, dtype, f"{kind} {dtype} in place")
    finally:
        adasum.configure(old)


@pytest.mark.parametrize("kind,dtype", SIXTEEN)
def test_kept_calls_take_the_compiled_small_call(comm, kind, dtype):
    """A 16-bit doubling call whose plan is kept runs as one compiled call (counted in ``compiled_calls``),
    in place and out of place, with the reference's bits; with ``native_mpi`` off the same calls take the
    Python path and give the same bits."""
    rank, size = comm.Get_rank(), comm.Get_size()
    compiled_here = (platform.system() == "Linux" and platform.machine() in ("x86_64", "aarch64")
                     and adasum.kernels_backend() == "c" and size > 1)
    inputs = [make(v, kind, dtype) for v in _layers(rank, 7)]
    results = {}
    old = adasum.configure(small_message_bytes=None)
    try:
        for native in (True, False):
            adasum.configure(native_mpi=native)
            adasum.adasum_allreduce(inputs)  # the first call of these shapes makes and keeps the plan
            adasum.adasum_allreduce_inplace([make(as_f64(t), kind, dtype) for t in inputs])
            with adasum.count_traffic() as traffic:
                out = adasum.adasum_allreduce(inputs)
                tensors = [make(as_f64(t), kind, dtype) for t in inputs]
                adasum.adasum_allreduce_inplace(tensors)
            want = 2 if native and compiled_here else 0
            assert traffic.compiled_calls == want, f"rank {rank}: {traffic.compiled_calls} compiled calls, not {want}"
            _assert_reference(comm, inputs, out, dtype, f"{kind} {dtype} native={native}")
            _assert_reference(comm, inputs, tensors, dtype, f"{kind} {dtype} in place native={native}")
            results[native] = [_bits(as_f64(t)).tobytes() for t in [*out, *tensors]]
    finally:
        adasum.configure(old)
    assert results[True] == results[False]


def _info(dtype: str):
    return torch.finfo(getattr(torch, dtype))


@pytest.mark.parametrize("kind,dtype", SIXTEEN)
def test_edges_of_the_range(comm, schedule, backend, kind, dtype):
    """Subnormal inputs, inputs near the largest value (whose squares overflow the dtype but not float64),
    sums that overflow to infinity, and layers poisoned by an infinity or a NaN next to clean ones: all as
    the reference computes them."""
    size, rank = comm.Get_size(), comm.Get_rank()
    info = _info(dtype)
    sub = float(info.smallest_normal) * 2.0 ** -3  # subnormal in the dtype
    top = float(info.max)
    u = np.random.default_rng(11).uniform(1.0, 2.0, 41)
    c = 1.0 + rank / (2 * size)
    layers = [
        sub * np.round(u * 4) * (rank + 1),  # subnormal, parallel (small integers times sub)
        sub * np.eye(size, 12)[rank] * (rank + 1),  # subnormal, orthogonal
        top / 2.1 * c * u / 2,  # near the top, parallel: the mean
        top * 0.6 * np.eye(size, 9)[rank] + top * 0.6 * np.eye(size, 9)[(rank + 1) % size] * (size > 1),
        np.full(10, top * 0.75),  # the same vector on every rank: itself
        u * c,  # clean
        u * c,  # an infinity on the last rank
        u * c,  # a NaN on the last rank
    ]
    if rank == size - 1:
        layers[6][3] = np.inf
        layers[7][5] = np.nan
    inputs = [make(v, kind, dtype) for v in layers]
    out = adasum.adasum_allreduce(inputs)
    _assert_reference(comm, inputs, out, dtype, f"{kind} {dtype} edges")
    got = [as_f64(o) for o in out]
    assert np.isfinite(got[2]).all() and np.isfinite(got[4]).all() and np.isfinite(got[5]).all()
    assert (got[0] != 0).all(), "subnormal inputs lost"
    assert not np.isfinite(got[6]).all() and not np.isfinite(got[7]).all()


@pytest.mark.parametrize("kind,dtype", SIXTEEN)
def test_no_wider_copies(comm, kind, dtype):
    """The buffers a 16-bit call keeps (the context's fused and receive buffers, the adapters' scratch) hold
    16-bit elements: no float32 or float64 copy of the data is made, level by level or whole."""
    from adasum.runtime.context import context_for

    rank = comm.Get_rank()
    adasum.release_buffers()
    old = adasum.configure(small_message_bytes=0, kernels="c")
    try:
        adasum.adasum_allreduce_inplace([make(v, kind, dtype) for v in _layers(rank, 3)])
    finally:
        adasum.configure(old)
    adapters = context_for(comm).adapters
    kept = [entry[0] for entry in context_for(comm).buffers._kept.values() if entry[0] is not None]
    tensors = sys.modules.get("torch") is not None  # else no torch tensor was made (torch may be absent)
    for adapter in (adapters.numpy, adapters.of("torch")) if tensors else (adapters.numpy,):
        kept += [b for b in adapter._scratch.values()
                 if isinstance(b, np.ndarray) or tensors and isinstance(b, torch.Tensor)]
    if comm.Get_size() > 1:
        assert kept
    for buf in kept:
        assert buf.itemsize <= 2 if isinstance(buf, np.ndarray) else buf.element_size() <= 2, buf.dtype
